"""Release signatures: what a release key signs, and checking it against the key a node pinned.

A release is a wheel of the agent. Its signature is Ed25519 over a short statement that binds the
version, the wheel's file name and its sha256 (`statement`), so a signature can neither be moved to
another file nor replay an old wheel under a new version number. The private key lives on the
admin's machine (`python -m agent release keygen` / `release sign`); the control plane holds the
public half and hands it to nodes at enrollment, and a node accepts only releases signed by the key it
pinned then. docs/security.md describes the threat model.

Imports nothing of ours outside `agent.wire`.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import re
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

# A version as pip spells it in a wheel name (digits, letters, dots, +local); no path characters.
VERSION_RE = re.compile(r"^[0-9][0-9A-Za-z.+!_-]{0,39}$")
WHEEL_NAME_RE = re.compile(r"^[A-Za-z0-9_.+!-]{1,150}\.whl$")
_DOMAIN = b"gguf-swarm release v1\n"


class ReleaseError(ValueError):
    """A release that is malformed, or whose signature does not verify with the pinned key."""


def statement(version: str, filename: str, sha256: str) -> bytes:
    """The bytes a release key signs: a domain tag, the version, the wheel's name and its sha256."""
    if not VERSION_RE.match(version):
        raise ReleaseError(f"bad release version {version[:40]!r}")
    if not WHEEL_NAME_RE.match(filename):
        raise ReleaseError(f"bad wheel file name {filename[:60]!r}")
    if not re.fullmatch(r"[0-9a-f]{64}", sha256):
        raise ReleaseError("sha256 must be 64 lowercase hex digits")
    return _DOMAIN + f"{version}\n{filename}\n{sha256}\n".encode()


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def generate_key() -> Ed25519PrivateKey:
    return Ed25519PrivateKey.generate()


def private_key_pem(key: Ed25519PrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def load_private_key(path: Path) -> Ed25519PrivateKey:
    try:
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    except (OSError, ValueError) as e:
        raise ReleaseError(f"{path}: cannot read a release key ({e})") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise ReleaseError(f"{path}: not an Ed25519 private key")
    return key


def public_key_b64(key: Ed25519PrivateKey | Ed25519PublicKey) -> str:
    """The raw 32-byte public key, base64: what nodes pin and what RELEASE_PUBLIC_KEY holds."""
    pub = key.public_key() if isinstance(key, Ed25519PrivateKey) else key
    return base64.b64encode(
        pub.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    ).decode()


def load_public_key(b64: str) -> Ed25519PublicKey:
    try:
        raw = base64.b64decode(b64.strip(), validate=True)
    except (binascii.Error, ValueError):
        raise ReleaseError("the release public key is not base64") from None
    if len(raw) != 32:
        raise ReleaseError("the release public key must be 32 raw bytes (base64)")
    return Ed25519PublicKey.from_public_bytes(raw)


def sign(key: Ed25519PrivateKey, version: str, filename: str, sha256: str) -> str:
    """The detached signature (base64) of a release."""
    return base64.b64encode(key.sign(statement(version, filename, sha256))).decode()


def verify(public_key_b64_: str, version: str, filename: str, sha256: str, signature_b64: str) -> None:
    """Raise ReleaseError unless `signature_b64` is the pinned key's signature of this release."""
    if not public_key_b64_:
        raise ReleaseError("no release key is pinned: this node was enrolled without one")
    key = load_public_key(public_key_b64_)
    try:
        sig = base64.b64decode(signature_b64.strip(), validate=True)
    except (binascii.Error, ValueError):
        raise ReleaseError("the release signature is not base64") from None
    if len(sig) != 64:
        raise ReleaseError("the release signature must be 64 bytes (base64)")
    try:
        key.verify(sig, statement(version, filename, sha256))
    except InvalidSignature:
        raise ReleaseError(
            f"release {version} is not signed by the pinned release key (forged or signed by another key)"
        ) from None
