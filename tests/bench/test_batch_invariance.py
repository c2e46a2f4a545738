"""``bench.batch_invariance``: how it reports where two greedy streams part, and its modes on a tiny model."""

from __future__ import annotations

from bench.batch_invariance import first_difference, run_case
from engine.api import EngineConfig
from engine.checkpoint import load_checkpoint
from tests.engine.checkpoints import make_tiny_gguf_llama
from tests.engine.engine_helpers import random_tokens


def test_first_difference_names_the_first_differing_token_or_the_shorter_length():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2
    assert first_difference([], []) is None


def test_batched_and_alone_agree_on_a_tiny_model(tmp_path):
    ck = load_checkpoint(str(make_tiny_gguf_llama(tmp_path / "q41.gguf", tensor_type="Q4_1")), weights="int4")
    config = EngineConfig(num_blocks=128, block_size=16, kv_dtype="bfloat16", max_num_batched_tokens=2048)
    shared = random_tokens(100, 1)
    prompts = [shared + random_tokens(10 + i, 2 + i) for i in range(3)]
    alone = run_case(ck.model, ck, config, prompts, 8, "alone")
    assert all(0 < len(t) <= 8 for t in alone)
    assert run_case(ck.model, ck, config, prompts, 8, "batched") == alone
