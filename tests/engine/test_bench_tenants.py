"""``bench.tenants``: the permutation Wilcoxon test, and the layered-sharing count on a tiny checkpoint."""

from __future__ import annotations

import random

import pytest

from bench.tenants import layered_prefill, permutation_p_value
from engine.api import EngineConfig
from engine.checkpoint import load_checkpoint
from engine.llm_engine import LLMEngine
from tests.engine.checkpoints import make_tiny_hf_llama


def test_permutation_p_value_separates_a_shift_from_noise():
    rng = random.Random(1)
    noise = [rng.gauss(0, 1) for _ in range(30)]
    assert permutation_p_value(noise, rounds=4000) > 0.05
    assert permutation_p_value([d + 3 for d in noise], rounds=4000) < 0.001
    # all differences of one sign, 30 pairs: only the all-same-sign flips reach the statistic
    assert permutation_p_value([1.0] * 30, rounds=2000) == pytest.approx(1 / 2001)
    with pytest.raises(ValueError):
        permutation_p_value([0.0, 0.0])


def test_layered_prefill_counts_the_public_prompt_once(tmp_path):
    ck = load_checkpoint(make_tiny_hf_llama(tmp_path / "tiny", seed=0))
    config = EngineConfig(block_size=16, num_blocks=256, max_batch=16, device="cpu")

    def make_engine() -> LLMEngine:
        return LLMEngine(ck.model, config, ck.model_id, ck.tokenizer)

    one = layered_prefill(make_engine, ck.tokenizer, 48, "layered", 1)
    many = layered_prefill(make_engine, ck.tokenizer, 48, "layered", 16)
    isolated = layered_prefill(make_engine, ck.tokenizer, 48, "isolated", 16)
    public, block = one["public_tokens"], one["block_size"]
    assert one["public_prefill_tokens"] == public
    assert many["public_prefill_tokens"] == public + 15 * (public % block)
    assert many["public_full_block_prefill_tokens"] == public // block * block
    assert isolated["public_prefill_tokens"] == 16 * public
