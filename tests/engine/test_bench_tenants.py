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


def test_an_aligned_public_prompt_is_prefilled_once_for_every_tenant(tmp_path):
    ck = load_checkpoint(make_tiny_hf_llama(tmp_path / "tiny", seed=0))
    config = EngineConfig(block_size=16, num_blocks=256, max_batch=16, device="cpu")

    def make_engine() -> LLMEngine:
        return LLMEngine(ck.model, config, ck.model_id, ck.tokenizer)

    one = layered_prefill(make_engine, ck.tokenizer, 48, "layered", 1, align=True)
    many = layered_prefill(make_engine, ck.tokenizer, 48, "layered", 16, align=True)
    assert one["public_tokens"] % 16 == 0 and one["public_tokens"] >= 48
    assert many["public_prefill_tokens"] == one["public_prefill_tokens"] == one["public_tokens"]


@pytest.mark.parametrize("tier", ["disk", "redis"])
def test_tier_side_channel_counts(tmp_path, tier):
    """The tier part of the bench on the tiny checkpoint: B never hits A's tier entries, A's repeat always
    does (exact token counts; the p-values are timing and not asserted)."""
    import uuid

    from bench.tenants import tier_engine, tier_side_channel
    from bench.tiers import drop_deployment

    ck = load_checkpoint(make_tiny_hf_llama(tmp_path / "tiny", seed=0))
    config = EngineConfig(block_size=16, num_blocks=256, max_batch=16, device="cpu")
    prefix = f"pgtest-bench-{uuid.uuid4().hex[:10]}"
    url = "redis://127.0.0.1:6379/0"
    eng = tier_engine(ck, config, tier, tmp_path / "tiers", url, prefix)
    try:
        r = tier_side_channel(eng, tier, pairs=8, length=64, vocab=ck.config.vocab_size, seed=3)
    finally:
        eng.close()
        drop_deployment(url, prefix)
    assert (r["b_cached_tokens"], r["b_tier_hit_tokens"]) == (0, 0)
    assert r["a_usable_tokens"] == 8 * 48  # (64 - 1) // 16 = 3 blocks per pair
    assert r["a_tier_hit_tokens"] == r["a_cached_tokens"] == r["a_usable_tokens"]
    assert 0.0 < r["side_channel_p_value"] <= 1.0
