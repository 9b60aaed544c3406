"""GGUF model-artifact manifest: tensors, byte ranges, hashes, per-layer sizes and shard roles.

The manifest is what placement (bytes per layer), torrent piece selection and partial loading work
from. It is computed once per file and travels as JSON; the per-architecture structure (state kinds, seam
width, unsplittable groups) comes from `archs` (see docs/architecture.md, "Architectures").
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import re
import struct
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from agent.artifacts.archs import StatePart, describe, servable_problem
from agent.artifacts.gguf_meta import GGUF_MAGIC, SUPPORTED_GGUF_VERSIONS, GgufMetaError, read_gguf_meta
from agent.artifacts.routing import Routing, routing_mode

MANIFEST_VERSION = 2  # 2: per-layer state parts, expert bytes, MTP blocks, unsplittable groups
_READABLE_VERSIONS = (1, MANIFEST_VERSION)  # a version 1 manifest is re-described from its hparams
_LAYER_RE = re.compile(r"^blk\.(\d+)\.")
_HASH_CHUNK = 8 << 20


class ManifestError(ValueError):
    """The file is not a GGUF we can describe; the message says what is wrong."""


@dataclass(frozen=True)
class TensorInfo:
    """One tensor: where its bytes are in the file and what they hash to."""

    name: str
    layer: int | None
    ggml_type: str
    shape: list[int]  # ggml order: ne0 (fastest varying) first
    offset: int  # absolute byte offset in the file
    nbytes: int
    sha256: str

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


@dataclass(frozen=True)
class LayerInfo:
    """One transformer block: the union of its tensors' byte ranges and what state it keeps."""

    index: int
    ranges: list[tuple[int, int]]  # merged [start, end) absolute byte ranges
    nbytes: int  # every tensor of the block, routed experts included
    state_kind: str  # "kv", "recurrent", "latent_kv" or "compressed_kv" (archs.STATE_KINDS)
    state: list[StatePart] = field(default_factory=list)
    expert_bytes: int = 0  # the routed-expert tensors' share of nbytes
    needs_token_ids: bool = False  # a window starting here needs the token ids with the boundary state

    def state_bytes(self, n_ctx: int, kv_bytes: float = 2.0) -> int:
        """Per-sequence state of this layer at `n_ctx` tokens (KV cache of `kv_bytes` per element)."""
        return sum(p.bytes_at(n_ctx, kv_bytes) for p in self.state)


@dataclass(frozen=True)
class Manifest:
    """Everything the fleet needs to know about one GGUF file, addressed by its sha256."""

    sha256: str
    file_size: int
    gguf_version: int
    architecture: str
    name: str
    n_layers: int
    boundary_dim: int
    context_length: int
    hparams: dict[str, Any]
    has_tokenizer: bool
    has_chat_template: bool
    tensors: list[TensorInfo]
    layers: list[LayerInfo]
    roles: dict[str, list[str]]  # "first" / "last" / "all" -> non-layer tensor names needed
    manifest_version: int = MANIFEST_VERSION
    tensor_data_offset: int = 0
    mtp_layers: int = 0  # multi-token-prediction blocks after the trunk; their tensors are "last" role
    layer_groups: list[tuple[int, int]] = field(default_factory=list)  # [start, end) never split
    leading_dense_layers: int = 0
    # why the native executor refuses the file although its architecture is in its table ("": it opens
    # it, or it was not asked); set by agent.backends.check from libggswarm's own reading of the header
    executor_problem: str = ""
    _by_name: dict[str, TensorInfo] = field(default_factory=dict, compare=False, repr=False)

    def tensor(self, name: str) -> TensorInfo:
        if not self._by_name:
            self._by_name.update({t.name: t for t in self.tensors})
        try:
            return self._by_name[name]
        except KeyError:
            raise ManifestError(f"tensor {name!r} is not in this GGUF") from None

    def has_tensor(self, name: str) -> bool:
        try:
            self.tensor(name)
        except ManifestError:
            return False
        return True

    @property
    def header_end(self) -> int:
        """End of the GGUF header (metadata, tokenizer, tensor table): every shard's file needs it."""
        return self.tensor_data_offset or min((t.offset for t in self.tensors), default=0)

    @property
    def tied_embeddings(self) -> bool:
        return not self.has_tensor("output.weight")

    @property
    def servable_problem(self) -> str:
        """Why this agent cannot serve the model layer by layer ("" when it can)."""
        arch = servable_problem(self.architecture)
        if arch or not self.executor_problem:
            return arch
        return f"not servable by this agent: the native executor refuses the file: {self.executor_problem}"

    @property
    def routing(self) -> Routing:
        """Layer windows across nodes, whole on one llamacpp node, or refused; with the reason."""
        return routing_mode(self.architecture, self.executor_problem)

    @property
    def token_id_layers(self) -> int:
        """Layers [0, n) route experts by token id (deepseek4's hash layers): a hop starting below n needs
        the ids with the boundary state (RouteClient(token_id_layers=n)); 0 when no layer does."""
        return max((layer.index + 1 for layer in self.layers if layer.needs_token_ids), default=0)

    @property
    def expert_bytes(self) -> int:
        return sum(layer.expert_bytes for layer in self.layers)

    def boundary_allowed(self, layer: int) -> bool:
        """May a shard boundary sit before `layer`? Never inside an unsplittable group."""
        return not any(s < layer < e for s, e in self.layer_groups)

    def tensors_for_range(self, layer_start: int, layer_end: int) -> list[TensorInfo]:
        """The tensors a shard holding [layer_start, layer_end) must read, role tensors included."""
        check_range(self, layer_start, layer_end)
        names = set(self.roles.get("all", []))
        if layer_start == 0:
            names.update(self.roles.get("first", []))
        if layer_end == self.n_layers:
            names.update(self.roles.get("last", []))
        out = [t for t in self.tensors if t.layer is not None and layer_start <= t.layer < layer_end]
        # role tensors by name: MTP blocks carry a layer index past the trunk, so no range selects them
        out += [t for t in self.tensors if t.name in names and (t.layer is None or t.layer >= self.n_layers)]
        return out

    def byte_ranges_for_range(self, layer_start: int, layer_end: int) -> list[tuple[int, int]]:
        """Merged absolute byte ranges a shard needs (drives piece selection and partial loading)."""
        return merge_ranges([(t.offset, t.end) for t in self.tensors_for_range(layer_start, layer_end)])

    def bytes_for_range(self, layer_start: int, layer_end: int) -> int:
        return sum(e - s for s, e in self.byte_ranges_for_range(layer_start, layer_end))

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("_by_name", None)
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Manifest:
        version = d.get("manifest_version")
        if version not in _READABLE_VERSIONS:
            raise ManifestError(f"unsupported manifest version {version!r} (readable: {_READABLE_VERSIONS})")
        d = dict(d)
        d.pop("_by_name", None)
        d["tensors"] = [TensorInfo(**t) for t in d["tensors"]]
        if version == 1:
            return _upgrade_v1(d)
        d["layers"] = [
            LayerInfo(
                index=x["index"],
                ranges=[tuple(r) for r in x["ranges"]],
                nbytes=x["nbytes"],
                state_kind=x["state_kind"],
                state=[StatePart(**p) for p in x.get("state", [])],
                expert_bytes=x.get("expert_bytes", 0),
                needs_token_ids=x.get("needs_token_ids", False),
            )
            for x in d["layers"]
        ]
        d["layer_groups"] = [(int(s), int(e)) for s, e in d.get("layer_groups", [])]
        return cls(**d)

    @classmethod
    def from_json(cls, s: str) -> Manifest:
        return cls.from_dict(json.loads(s))


def _upgrade_v1(d: dict[str, Any]) -> Manifest:
    """A version 1 manifest (llama-like only, no state parts) re-described from its own hparams."""
    tensors: list[TensorInfo] = d["tensors"]
    desc = describe(
        d["architecture"], d["hparams"], d["n_layers"], d["boundary_dim"], [t.name for t in tensors]
    )
    d["layers"] = [
        _layer_info(
            x["index"], [tuple(r) for r in x["ranges"]], x["nbytes"], tensors, desc.layers[x["index"]]
        )
        for x in d["layers"]
    ]
    d["manifest_version"] = MANIFEST_VERSION
    d["boundary_dim"] = desc.boundary_dim
    return Manifest(**d)


def _layer_info(
    index: int, ranges: list[Any], nbytes: int, tensors: list[TensorInfo], desc: Any
) -> LayerInfo:
    experts = sum(t.nbytes for t in tensors if t.layer == index and "_exps." in t.name)
    return LayerInfo(index, ranges, nbytes, desc.state_kind, list(desc.state), experts, desc.needs_token_ids)


def check_range(manifest: Manifest, layer_start: int, layer_end: int) -> None:
    if not (0 <= layer_start < layer_end <= manifest.n_layers):
        raise ManifestError(
            f"layer range {layer_start}:{layer_end} is outside 0:{manifest.n_layers} "
            f"(need 0 <= start < end <= {manifest.n_layers})"
        )


def merge_ranges(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for s, e in sorted(ranges):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def _check_header(path: Path, size: int) -> int:
    if size < 24:
        raise ManifestError(f"{path}: {size} bytes is too short to be a GGUF file")
    with open(path, "rb") as f:
        head = f.read(8)
    if head[:4] != GGUF_MAGIC:
        raise ManifestError(f"{path}: not a GGUF file (magic {head[:4]!r}, expected {GGUF_MAGIC!r})")
    version: int = struct.unpack("<I", head[4:8])[0]
    if version not in SUPPORTED_GGUF_VERSIONS:
        raise ManifestError(f"{path}: GGUF version {version} is not supported ({SUPPORTED_GGUF_VERSIONS})")
    return version


def sha256_file(path: str | os.PathLike[str]) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def build_manifest(path: str | os.PathLike[str], *, hash_tensors: bool = True) -> Manifest:
    """Describe the GGUF at `path`. Raises ManifestError (never a deep traceback) on bad input."""
    p = Path(path)
    try:
        size = p.stat().st_size
        if not p.is_file():
            raise ManifestError(f"{p}: not a regular file")
    except OSError as e:
        raise ManifestError(f"{p}: cannot read ({e.strerror})") from None
    version = _check_header(p, size)
    try:
        meta = read_gguf_meta(p)
    except GgufMetaError as e:
        raise ManifestError(f"{p}: malformed GGUF header or metadata ({e})") from None
    except OSError as e:
        raise ManifestError(f"{p}: cannot read ({e.strerror})") from None

    arch = meta.fields.get("general.architecture")
    if not isinstance(arch, str):
        raise ManifestError(f"{p}: general.architecture is missing")
    hparams: dict[str, Any] = {}
    prefix = arch + "."
    for key, v in meta.fields.items():  # arrays over 1024 elements are left out of meta.fields
        if key.startswith(prefix):
            hparams[key[len(prefix) :]] = v
    n_layers = hparams.get("block_count")
    d_model = hparams.get("embedding_length")
    if not isinstance(n_layers, int) or n_layers <= 0:
        raise ManifestError(f"{p}: {arch}.block_count is missing or invalid")
    if not isinstance(d_model, int) or d_model <= 0:
        raise ManifestError(f"{p}: {arch}.embedding_length is missing or invalid")
    has_tokens = "tokenizer.ggml.tokens" in meta.types
    if has_tokens and "vocab_size" not in hparams:
        hparams["vocab_size"] = meta.array_len["tokenizer.ggml.tokens"]

    tensors: list[TensorInfo] = []
    with open(p, "rb") as fh:
        mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            for t in meta.tensors:
                offset = t.data_offset
                nbytes = t.n_bytes
                if offset + nbytes > size:
                    raise ManifestError(
                        f"{p}: tensor {t.name} ends at byte {offset + nbytes} but the file has {size} "
                        "bytes (truncated download?)"
                    )
                m = _LAYER_RE.match(t.name)
                digest = hashlib.sha256(mm[offset : offset + nbytes]).hexdigest() if hash_tensors else ""
                tensors.append(
                    TensorInfo(
                        name=t.name,
                        layer=int(m.group(1)) if m else None,
                        ggml_type=t.tensor_type.name,
                        shape=[int(x) for x in t.shape],
                        offset=offset,
                        nbytes=nbytes,
                        sha256=digest,
                    )
                )
        finally:
            mm.close()
    for ti in tensors:
        if ti.layer is not None and ti.layer >= n_layers:
            raise ManifestError(f"{p}: tensor {ti.name} names layer {ti.layer} but block_count is {n_layers}")

    try:
        desc = describe(arch, hparams, n_layers, d_model, [t.name for t in tensors])
    except (ValueError, TypeError, IndexError) as e:
        raise ManifestError(f"{p}: {arch} metadata does not describe its layers ({e})") from None
    n_layers = desc.n_layers
    if n_layers <= 0:
        raise ManifestError(f"{p}: {arch}.nextn_predict_layers leaves no trunk layers")
    layers: list[LayerInfo] = []
    for i in range(n_layers):
        ranges = merge_ranges([(t.offset, t.end) for t in tensors if t.layer == i])
        if not ranges:
            raise ManifestError(f"{p}: layer {i} has no tensors")
        layers.append(_layer_info(i, ranges, sum(e - s for s, e in ranges), tensors, desc.layers[i]))

    names = {t.name for t in tensors}
    if "token_embd.weight" not in names:
        raise ManifestError(f"{p}: token_embd.weight is missing")
    roles = _roles(tensors, n_layers)
    ctx = hparams.get("context_length")
    return Manifest(
        sha256=sha256_file(p),
        file_size=size,
        gguf_version=version,
        architecture=arch,
        name=str(meta.fields.get("general.name") or p.stem),
        n_layers=n_layers,
        boundary_dim=desc.boundary_dim,
        context_length=int(ctx) if isinstance(ctx, int) else 0,
        hparams=hparams,
        has_tokenizer=has_tokens,
        has_chat_template="tokenizer.chat_template" in meta.types,
        tensors=tensors,
        layers=layers,
        roles=roles,
        tensor_data_offset=meta.data_offset,
        mtp_layers=desc.mtp_layers,
        layer_groups=desc.groups,
        leading_dense_layers=desc.leading_dense_layers,
    )


# Non-layer tensors the last shard needs besides the output norm and head: deepseek4's
# hyper-connection head collapses the streams before the output norm.
_LAST_PREFIXES = ("output_norm.", "output.", "output_hc_")


def _roles(tensors: list[TensorInfo], n_layers: int) -> dict[str, list[str]]:
    """Which non-trunk tensors each shard role loads: first (embedding), last (head, MTP blocks), all."""
    names = [t.name for t in tensors if t.layer is None]
    last = [n for n in names if n.startswith(_LAST_PREFIXES)]
    if "output.weight" not in names:
        last.append("token_embd.weight")  # tied output head
    last += [t.name for t in tensors if t.layer is not None and t.layer >= n_layers]  # MTP blocks
    # anything else (rope_freqs, unknown extras) goes to every shard: loading too much beats a missing tensor
    always = [n for n in names if n != "token_embd.weight" and n not in last]
    return {"first": ["token_embd.weight"], "last": last, "all": always}


def format_manifest(m: Manifest) -> str:
    """Human-readable summary for `inspect`."""
    counts: dict[str, int] = {}
    for layer in m.layers:
        counts[layer.state_kind] = counts.get(layer.state_kind, 0) + 1
    kinds = ", ".join(f"{k} x{n}" for k, n in counts.items())
    lines = [
        f"file        sha256:{m.sha256}  ({m.file_size / 1e6:.1f} MB, GGUF v{m.gguf_version})",
        f"model       {m.name}  arch={m.architecture}  layers={m.n_layers}  d_model={m.hparams.get('embedding_length')}  "
        f"ctx={m.context_length}",
        f"tokenizer   {'yes' if m.has_tokenizer else 'no'}  chat template: {'yes' if m.has_chat_template else 'no'}"
        f"  tied embeddings: {'yes' if m.tied_embeddings else 'no'}",
        "hparams     "
        + ", ".join(f"{k}={v}" for k, v in sorted(m.hparams.items()) if not isinstance(v, list)),
        f"roles       first={m.roles['first']} last={m.roles['last']} all={m.roles['all']}",
        f"structure   seam={m.boundary_dim} floats/token  state kinds: {kinds}  experts: {m.expert_bytes} bytes"
        f"  leading dense: {m.leading_dense_layers}  mtp blocks: {m.mtp_layers}"
        f"  unsplittable groups: {' '.join(f'[{s},{e})' for s, e in m.layer_groups) or 'none'}",
        f"servable    {m.servable_problem or 'yes'}",
        f"routing     {m.routing.mode or 'refused'}: {m.routing.reason}",
        "",
        f"{'layer':>5} {'bytes':>12} {'experts':>10} {'state':<14} {'state@4K':>10}  ranges",
    ]
    for layer in m.layers:
        rs = " ".join(f"[{s},{e})" for s, e in layer.ranges)
        kind = layer.state_kind + ("+ids" if layer.needs_token_ids else "")
        lines.append(
            f"{layer.index:>5} {layer.nbytes:>12} {layer.expert_bytes:>10} {kind:<14} "
            f"{layer.state_bytes(4096):>10}  {rs}"
        )
    lines.append("")
    lines.append(
        f"{'tensor':<32} {'layer':>5} {'type':>6} {'shape':<16} {'offset':>10} {'bytes':>10}  sha256"
    )
    for t in m.tensors:
        shape = "x".join(str(x) for x in t.shape)
        layer_s = "-" if t.layer is None else str(t.layer)
        lines.append(
            f"{t.name:<32} {layer_s:>5} {t.ggml_type:>6} {shape:<16} {t.offset:>10} {t.nbytes:>10}  {t.sha256[:16]}"
        )
    return "\n".join(lines)
