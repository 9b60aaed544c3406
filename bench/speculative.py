"""Speculative decoding over a 3-hop native route on 127.0.0.1 against plain decoding and llama-cpp-python.

    python bench/speculative.py [--tokens 128] [--rounds 3] [--draft 8] [--threads 2] [--delay-ms 0,25]

SmolLM2 in three `agent serve` hops (chain mode, the product's route). Per prompt kind (a code edit that
repeats its input, a quotation, an open chat question): decode tok/s of the route plainly and with
prompt-lookup drafts (agent/client/spec.py), tokens per round trip, whether the greedy tokens are the
plain ones, and llama-cpp-python decoding the same prompt plainly in one process. Medians of
interleaved rounds; prints JSON last.

`--draft-model`: also speculate with a draft model in this process (agent/client/drafts.py), keys with a
`_model` suffix.

`--delay-ms`: each delay in turn is added in both directions in front of every hop (client to hop 0 and
hop to hop: agent/dev/relay.py on 127.0.0.1; 25 ms one way makes a 3-hop chain step 150 ms of links).
The native lanes connect hop to hop on their own ports, past these relays, so both the plain and the
speculative route take the Python path in every delayed run; the loopback keys (`_loopback_`) are
measured with the lanes, as the product runs. `--links netns` (as root) runs the delayed routes in the
link harness instead (agent/dev/links.py, docs/links.md): hops in network namespaces, mutual TLS,
relays in front of the data plane and the lane ports (so the lanes run), `--rate-mbit` links.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agent.artifacts.manifest import build_manifest  # noqa: E402
from agent.artifacts.packaged import packaged_model_path  # noqa: E402
from agent.client.drafts import ModelDrafter  # noqa: E402
from agent.client.recovery import minted_hops  # noqa: E402
from agent.client.route import RouteClient  # noqa: E402
from agent.client.spec import Drafter  # noqa: E402
from agent.client.tokenizer import ChatTokenizer  # noqa: E402
from agent.dev.relay import RelayProcess  # noqa: E402
from agent.procs import stop  # noqa: E402
from agent.wire.routetoken import RouteHop, generate_key, public_key_b64  # noqa: E402
from agent.wire.sampling import SamplingParams  # noqa: E402
from bench._common import cpu_kind, start_serve  # noqa: E402
from bench._llamacpp import open_llama  # noqa: E402

RANGES = ((0, 10), (10, 20), (20, 30))
CODE = '''def moving_average(values, window):
    """Return the moving averages of values over window items."""
    if window <= 0:
        raise ValueError("window must be positive")
    out = []
    total = 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            out.append(total / window)
    return out
'''
QUOTE = (
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of "
    "foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the season of Light, "
    "it was the season of Darkness, it was the spring of hope, it was the winter of despair."
)
PROMPTS = {
    "code": f"Rename the function moving_average to rolling_mean and return the whole code:\n\n{CODE}",
    "quote": f"Repeat this passage word for word:\n\n{QUOTE}",
    "chat": "What should I pack for a week of hiking in the mountains?",
}


def llamacpp_tok_s(llm: Any, prompt: list[int], n: int) -> tuple[float, list[int]]:  # noqa: ANN401
    """Plain greedy decoding in one process: tok/s after the first token, and the tokens."""
    import llama_cpp
    import numpy as np

    vocab = llm.n_vocab()

    def argmax() -> int:
        ptr = llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1)
        return int(np.argmax(np.ctypeslib.as_array(ptr, shape=(vocab,))))

    llm.reset()
    llm.eval(prompt)
    out = [argmax()]
    t0 = time.perf_counter()
    for _ in range(n - 1):
        llm.eval([out[-1]])
        out.append(argmax())
    return (n - 1) / (time.perf_counter() - t0), out


async def route_tok_s(
    hops_for: Any,  # noqa: ANN401
    prompt: list[int],
    n: int,
    draft: int,
    lane: bool,
    drafter: Drafter | None = None,
    ssl_context: Any = None,  # noqa: ANN401
) -> tuple[float, list[int], dict[str, Any]]:
    """Decode tok/s over the route (after the first token), the tokens, and the speculation figures."""
    session = os.urandom(16)
    client = RouteClient(
        hops_for(session), session_id=session, mode="chain", lane=lane, ssl_context=ssl_context
    )
    try:
        out: list[int] = []
        t0 = 0.0
        async for tok, _ in client.generate(prompt, SamplingParams(), n, speculate=draft, drafter=drafter):
            if not out:
                t0 = time.perf_counter()
            out.append(tok)
        return (len(out) - 1) / (time.perf_counter() - t0), out, client.last_spec.as_dict()
    finally:
        await client.close()


async def run(args: argparse.Namespace) -> dict[str, Any]:
    path = str(packaged_model_path())
    manifest = build_manifest(path)
    tok = ChatTokenizer(path)
    prompts = {k: tok.encode_chat([{"role": "user", "content": v}]) for k, v in PROMPTS.items()}
    delays = [float(d) for d in args.delay_ms.split(",") if d != ""]
    key = generate_key()
    logdir = Path(tempfile.mkdtemp(prefix="bench-spec-"))
    procs, plan, relays, lab = [], [], None, None
    llm = open_llama(path, args.threads, 2048)
    try:
        for a, b in RANGES:
            proc, url, node = start_serve(
                path, f"{a}:{b}", "native", public_key_b64(key.public_key()), args.threads, logdir
            )
            procs.append(proc)
            plan.append(RouteHop(node, url, a, b))
        # one relay in front of each hop: the route's URLs are the relays'
        pairs = [(("127.0.0.1", 0), ("127.0.0.1", int(h.url.rsplit(":", 1)[1]))) for h in plan]
        relays = RelayProcess(pairs, logdir / "relay.log")
        relayed = [
            RouteHop(h.node, f"http://{host}:{port}", h.layer_start, h.layer_end)
            for h, (host, port) in zip(plan, relays.addresses, strict=True)
        ]

        def hops_for(session: bytes, via: list[RouteHop]) -> Any:  # noqa: ANN401
            return minted_hops(key, session, manifest.sha256, via)

        samples: dict[str, list[float]] = {}
        figures: dict[str, Any] = {"cpu": cpu_kind(), "tokens": args.tokens, "draft": args.draft}
        identical = True
        llamacpp_tok_s(llm, prompts["chat"], 8)  # warm-ups: the first decode of each side is slower
        await route_tok_s(lambda s: hops_for(s, plan), prompts["chat"], 8, 0, True)
        # prompt lookup always; a draft model when asked (the same file here: see --draft-model)
        drafters: dict[str, Drafter | None] = {"lookup": None}
        if args.draft_model:
            drafters["model"] = ModelDrafter(args.draft_model, threads=1)
        # (tag, delay, lanes, route, client TLS, how to set the delay)
        settings: list[tuple[str, float, bool, list[RouteHop], Any, Any]] = [
            ("loopback", 0.0, True, plan, None, lambda d: None)
        ]
        if args.links == "netns":
            # the link harness: hops in namespaces, mutual TLS, relays for the data plane and the lanes
            # (so the lanes run, delayed like everything else), rate-limited links, a tenth's jitter
            from agent.dev.links import LinkLab

            lab = LinkLab(len(RANGES), logdir / "lab", tls=True)
            lab.open()
            lab.start_hops(path, RANGES, public_key_b64(key.public_key()), threads=args.threads)
            lab.shape(args.rate_mbit)
            via = [RouteHop(*h) for h in lab.plan()]
            figures["links"] = f"netns, TLS, lanes, {args.rate_mbit:g} Mbit/s, jitter 0.1 x delay"
            for d in delays:
                settings.append(
                    (f"{d:g}ms", d, True, via, lab.client_ssl(), lambda d, lab=lab: lab.set_delay(d, d / 10))
                )
        else:
            figures["links"] = "loopback relays, no lanes"
            settings += [(f"{d:g}ms", d, False, relayed, None, relays.set_delay) for d in delays]
        for r in range(args.rounds):
            for kind, prompt in prompts.items():
                lc, lc_out = llamacpp_tok_s(llm, prompt, args.tokens)
                samples.setdefault(f"{kind}_llamacpp", []).append(lc)
                for tag, delay, lane, via, ssl_ctx, set_delay in settings:
                    set_delay(delay)

                    def bound(session: bytes, via: list[RouteHop] = via) -> Any:  # noqa: ANN401
                        return hops_for(session, via)

                    # plain and each drafter in turn, the order reversed every other round: on a
                    # shared machine whoever runs first in a round would otherwise be favoured
                    runs: list[tuple[str, Drafter | None, int]] = [("plain", None, 0)]
                    runs += [(name, drafter, args.draft) for name, drafter in drafters.items()]
                    outs: dict[str, list[int]] = {}
                    for name, drafter, draft in runs if r % 2 == 0 else runs[::-1]:
                        speed, out, st = await route_tok_s(
                            bound, prompt, args.tokens, draft, lane, drafter, ssl_ctx
                        )
                        outs[name] = out
                        samples.setdefault(f"{kind}_{tag}_{name}", []).append(speed)
                        if name != "plain":
                            figures[f"{kind}_{tag}_{name}_tokens_per_round_trip"] = st[
                                "tokens_per_round_trip"
                            ]
                            figures[f"{kind}_{tag}_{name}_acceptance"] = st["acceptance"]
                    figures[f"{kind}_plain_equals_llamacpp"] = outs["plain"] == lc_out
                    identical &= all(out == outs["plain"] for out in outs.values())
        for name, vals in samples.items():
            figures[f"{name}_tok_s"] = round(statistics.median(vals), 2)
        for kind in prompts:
            for name in drafters:
                suffix = "" if name == "lookup" else f"_{name}"
                for tag, *_ in settings:
                    speedup = figures[f"{kind}_{tag}_{name}_tok_s"] / figures[f"{kind}_{tag}_plain_tok_s"]
                    figures[f"spec_speedup_{tag}_3hop_{kind}{suffix}"] = round(speedup, 3)
                vs = figures[f"{kind}_loopback_{name}_tok_s"] / figures[f"{kind}_llamacpp_tok_s"]
                figures[f"spec_loopback_{kind}_vs_llamacpp{suffix}"] = round(vs, 3)
        figures["spec_greedy_identical"] = int(identical)
        return figures
    finally:
        if lab is not None:
            lab.close()
        if relays is not None:
            relays.close()
        stop(procs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--draft", type=int, default=8, help="most draft tokens per verification step")
    ap.add_argument(
        "--delay-ms", default="25", help="one-way link delays to run beside loopback, comma-separated"
    )
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--links",
        choices=("relay", "netns"),
        default="relay",
        help="delayed links: relays on 127.0.0.1 (no lanes), or the link harness (as root: namespaces, TLS, lanes)",
    )
    ap.add_argument("--rate-mbit", type=float, default=100.0, help="--links netns: each link's rate each way")
    ap.add_argument(
        "--draft-model",
        default="",
        help="a GGUF of the route model's vocabulary to draft with in this process ('packaged': SmolLM2-135M "
        "itself, the only SmolLM2 here, so its drafts are the route's own greedy tokens: an upper bound)",
    )
    args = ap.parse_args()
    if args.draft_model == "packaged":
        args.draft_model = str(packaged_model_path())
    print(json.dumps(asyncio.run(run(args)), indent=1))


if __name__ == "__main__":
    main()
