"""How a model is served: layer windows routed across nodes, whole on one llamacpp node, or not at all."""

from __future__ import annotations

from dataclasses import dataclass

from agent.artifacts import archs

LAYERS = "layers"  # layer windows on the native executor, split over as many nodes as memory needs
WHOLE = "whole"  # every layer in one shard on one node, run by llama.cpp (the llamacpp backend)
WHOLE_MODEL_BACKEND = "llamacpp"

# Every name of LLM_ARCH_NAMES in src/llama-arch.cpp of the llama.cpp that llama-cpp-python 0.3.36
# vendors (commit 0c1e5709), "(unknown)" left out. A table rather than a runtime look-up: llama.cpp
# exports no list of its architectures, and the gguf package (0.19.0 on PyPI) lists only 126 of these
# 153 (deepseek4 and minimax-m3 among the missing). tests/agent/test_routing.py checks the table
# against the installed libllama and gguf, so a version bump that changes the set fails there.
_LLAMA_CPP_NAMES = """
clip llama llama4 deci falcon grok gpt2 gptj gptneox mpt baichuan starcoder refact bert modern-bert
nomic-bert nomic-bert-moe neo-bert jina-bert-v2 jina-bert-v3 eurobert bloom stablelm qwen qwen2
qwen2moe qwen2vl qwen3 qwen3moe qwen3next qwen3vl qwen3vlmoe qwen35 qwen35moe qwen4exp phi2 phi3
phimoe plamo plamo2 plamo3 codeshell orion internlm2 minicpm minicpm3 gemma gemma2 gemma3 gemma3n
gemma4 gemma4-assistant gemma-embedding starcoder2 mamba mamba2 maple jamba falcon-h1 xverse
command-r cohere2 cohere2moe dbrx olmo olmo2 olmoe muse-glimmer openelm arctic deepseek deepseek2
deepseek2-ocr deepseek32 deepseek4 chatglm glm4 glm4moe glm-dsa bitnet t5 t5encoder jais jais2
nemotron nemotron_h nemotron_h_moe exaone exaone4 exaone-moe rwkv6 rwkv6qwen2 rwkv7 arwkv7 granite
granitemoe granitehybrid graniteswitch granite_swa chameleon wavtokenizer-dec plm bailingmoe
bailingmoe2 bailingmoe3 dots1 dots3note arcee afmoe laguna ernie4_5 ernie4_5-moe hunyuan-moe
hunyuan-dense hunyuan_vl hy_v3 hy_v4 smollm3 gpt-oss lfm2 lfm2moe dream smallthinker llada llada-moe
seed_oss grovemoe apertus minimax-01 hrm_text minimax-m2 minimax-m3 cogvlm rnd1 pangu-embedded
mistral3 eagle3 dflash mistral4 paddleocr mimo2 step35 spark2_5 llama-embed maincoder kimi-linear
kimi-k3 glm5-next talkie mellum nanbeige qwen3tts pockettts
"""
LLAMA_CPP_KNOWN: frozenset[str] = frozenset(_LLAMA_CPP_NAMES.split())

# Names llama.cpp knows but cannot run as the llamacpp backend runs a model (llama_decode, then the
# next token's logits), each as the same llama-model.cpp says: no KV memory at all (create_memory
# returns nullptr: encoders, embedding models, the audio decoder, diffusion LMs), an encoder pass
# first (llama_model_has_encoder: T5 and the speculative-decoding drafts that need a target model),
# and "clip", which llama.cpp refuses as a main model.
NOT_TEXT_DECODERS: frozenset[str] = frozenset(
    {
        "bert",
        "modern-bert",
        "nomic-bert",
        "nomic-bert-moe",
        "neo-bert",
        "jina-bert-v2",
        "jina-bert-v3",
        "eurobert",
        "gemma-embedding",
        "wavtokenizer-dec",
        "dream",
        "llada",
        "llada-moe",
        "rnd1",
        "t5",
        "t5encoder",
        "eagle3",
        "dflash",
        "clip",
    }
)

# What the llamacpp backend can run whole on one node.
WHOLE_ARCHITECTURES: frozenset[str] = LLAMA_CPP_KNOWN - NOT_TEXT_DECODERS


@dataclass(frozen=True)
class Routing:
    """The decision for one model: `mode` LAYERS, WHOLE or "" (refused), and `reason` in words."""

    mode: str
    reason: str

    @property
    def servable(self) -> bool:
        return bool(self.mode)


def routing_mode(arch: str, executor_problem: str = "") -> Routing:
    """How a GGUF of architecture `arch` is served; `executor_problem` is the native executor's refusal
    of the file itself (Manifest.executor_problem: its architecture is in the table, something else in
    the file is not), which leaves the model refused as before rather than guessing llama.cpp takes it."""
    if arch in archs.SERVABLE_ARCHITECTURES:
        if executor_problem:
            return Routing(
                "", f"not servable by this agent: the native executor refuses the file: {executor_problem}"
            )
        return Routing(LAYERS, f"the native executor runs {arch!r} layer windows: routes across nodes")
    fallback = f"whole model on one node with the {WHOLE_MODEL_BACKEND} backend"
    if arch in WHOLE_ARCHITECTURES:
        return Routing(
            WHOLE,
            f"architecture {arch!r} has no layer windows in the native executor yet; it runs as a "
            f"{fallback} (llama.cpp runs {arch!r})",
        )
    if arch in NOT_TEXT_DECODERS:
        why = f"llama.cpp knows {arch!r} but does not decode text with it token by token"
    else:
        why = f"llama.cpp (llama-cpp-python 0.3.36) does not know {arch!r} either"
    return Routing(
        "",
        f"not servable by this agent: architecture {arch!r} has no layer-window executor yet, and the "
        f"fallback, a {fallback}, is closed too: {why} (layer windows: "
        f"{', '.join(sorted(archs.SERVABLE_ARCHITECTURES))})",
    )
