"""The paged forward pass gives the same logits however a sequence is chunked, laid out in blocks or batched."""

from __future__ import annotations

import random

import pytest
import torch

from engine.attention import AttentionMetadata
from engine.checkpoint import load_checkpoint
from engine.model import allocate_kv_cache
from tests.engine.model_driver import Seq, prefill_logits, step

BLOCK = 16
TOL = 1e-5


@pytest.fixture(scope="module")
def ck(tiny_hf_dir):
    return load_checkpoint(str(tiny_hf_dir))


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 384) for _ in range(n)]


def fresh_cache(ck, num_blocks: int = 64):
    return allocate_kv_cache(ck.config, num_blocks, BLOCK, torch.float32, "cpu")


def assert_close(a: torch.Tensor, b: torch.Tensor, tol: float = TOL) -> None:
    err = (a - b).abs().max().item()
    assert err <= tol, f"max |diff| {err:.3g} > {tol}"


def test_allocate_kv_cache_shape_and_dtype(ck):
    kv = allocate_kv_cache(ck.config, 7, 4, torch.bfloat16, "cpu")
    c = ck.config
    assert kv.shape == (c.num_layers, 2, 7, 4, c.num_kv_heads, c.head_dim)
    assert kv.dtype == torch.bfloat16 and not kv.any()
    with pytest.raises(ValueError):
        allocate_kv_cache(ck.config, 0, 16, torch.float32, "cpu")


@pytest.mark.parametrize("chunks", [[70], [1] * 70, [16, 16, 16, 16, 6], [5, 30, 1, 33, 1], [69, 1]])
def test_chunked_prefill_equals_one_shot(ck, chunks):
    prompt = tokens(70, seed=1)
    ref = prefill_logits(ck.model, fresh_cache(ck), Seq(prompt, list(range(5))), [70], BLOCK)
    got = prefill_logits(ck.model, fresh_cache(ck), Seq(prompt, list(range(5))), chunks, BLOCK)
    assert_close(got, ref)


def test_scrambled_block_table_equals_contiguous(ck):
    prompt = tokens(75, seed=2)
    ref = prefill_logits(ck.model, fresh_cache(ck), Seq(prompt, list(range(5))), [75], BLOCK)
    blocks = random.Random(0).sample(range(64), 5)
    assert blocks != sorted(blocks)
    kv = fresh_cache(ck)
    assert_close(prefill_logits(ck.model, kv, Seq(prompt, blocks), [75], BLOCK), ref)
    assert_close(prefill_logits(ck.model, fresh_cache(ck), Seq(prompt, blocks), [20, 40, 15], BLOCK), ref)
    used = set(blocks)
    k = kv[:, :, [b for b in range(64) if b not in used]]
    assert not k.any()  # nothing written outside the sequence's own blocks


def test_shared_prefix_blocks_written_by_another_sequence(ck):
    """B reuses A's two full prefix blocks (prefix caching) and computes only its own suffix."""
    prefix = tokens(32, seed=3)
    a = prefix + tokens(10, seed=4)
    b = prefix + tokens(21, seed=5)
    ref_b = prefill_logits(ck.model, fresh_cache(ck), Seq(b, [0, 1, 2, 3]), [len(b)], BLOCK)
    kv = fresh_cache(ck)
    prefill_logits(ck.model, kv, Seq(a, [9, 4, 7]), [len(a)], BLOCK)
    seq_b = Seq(b, [9, 4, 12, 30])
    seq_b.computed = 32  # blocks 9 and 4 already hold the prefix's K/V
    assert_close(prefill_logits(ck.model, kv, seq_b, [len(b) - 32], BLOCK), ref_b)
    # a wholly cached prompt still computes its last token
    seq_a2 = Seq(prefix, [9, 4])
    seq_a2.computed = 31
    ref_p = prefill_logits(ck.model, fresh_cache(ck), Seq(prefix, [0, 1]), [32], BLOCK)
    assert_close(prefill_logits(ck.model, kv, seq_a2, [1], BLOCK), ref_p)


def decode_alone(ck, prompt: list[int], n: int, blocks: list[int]) -> list[torch.Tensor]:
    kv = fresh_cache(ck)
    seq = Seq(prompt, blocks)
    logits = [prefill_logits(ck.model, kv, seq, [len(prompt)], BLOCK)]
    for _ in range(n):
        seq.tokens.append(int(logits[-1].argmax()))
        logits.append(ck.model.compute_logits(step(ck.model, kv, [seq], [1], BLOCK))[0])
    return logits


def test_batched_and_mixed_steps_equal_each_sequence_alone(ck):
    """Three sequences of different lengths: prefilled in a mixed step with a decode, then decoded together."""
    prompts = [tokens(40, 10), tokens(7, 11), tokens(23, 12)]
    tables = [[3, 8, 1, 20], [5, 9], [17, 2, 30]]
    refs = [decode_alone(ck, p, 6, t) for p, t in zip(prompts, tables, strict=True)]
    kv = fresh_cache(ck)
    seqs = [Seq(p, t) for p, t in zip(prompts, tables, strict=True)]
    logits: list[list[torch.Tensor]] = [[], [], []]
    # step 1: seq 0 prefills whole; seq 1 prefills a first chunk of 3
    h = step(ck.model, kv, seqs[:2], [40, 3], BLOCK)
    logits[0].append(ck.model.compute_logits(h[:1])[0])
    seqs[0].tokens.append(int(logits[0][-1].argmax()))
    # step 2 (mixed): seq 0 decodes, seq 1 finishes its prompt, seq 2 prefills whole
    out = ck.model.compute_logits(step(ck.model, kv, seqs, [1, 4, 23], BLOCK))
    for i in range(3):
        logits[i].append(out[i])
        seqs[i].tokens.append(int(out[i].argmax()))
    # steps 3..: all three decode in one batch
    for _ in range(5):
        out = ck.model.compute_logits(step(ck.model, kv, seqs, [1, 1, 1], BLOCK))
        for i in range(3):
            logits[i].append(out[i])
            seqs[i].tokens.append(int(out[i].argmax()))
    for i in range(3):
        n = len(logits[i])
        for got, ref in zip(logits[i], refs[i][:n], strict=True):
            assert_close(got, ref)


def test_decode_rows_interleaved_with_prefill_rows(ck):
    """Decode rows before and after a prefill chunk in the flat batch (rows are not grouped by kind)."""
    p0, p1, p2 = tokens(20, 20), tokens(33, 21), tokens(12, 22)
    r0 = decode_alone(ck, p0, 1, [0, 1])
    r2 = decode_alone(ck, p2, 1, [4])
    r1 = prefill_logits(ck.model, fresh_cache(ck), Seq(p1, [0, 1, 2]), [33], BLOCK)
    kv = fresh_cache(ck)
    s0, s1, s2 = Seq(p0, [10, 11]), Seq(p1, [12, 13, 14]), Seq(p2, [15])
    step(ck.model, kv, [s0, s2], [20, 12], BLOCK)
    s0.tokens.append(int(r0[0].argmax()))
    s2.tokens.append(int(r2[0].argmax()))
    out = ck.model.compute_logits(step(ck.model, kv, [s0, s1, s2], [1, 33, 1], BLOCK))
    assert_close(out[0], r0[1])
    assert_close(out[1], r1)
    assert_close(out[2], r2[1])


def meta(slots, qsl, lens, tables):
    return AttentionMetadata(torch.tensor(slots), qsl, lens, torch.tensor(tables), BLOCK)


def test_inconsistent_metadata_is_rejected(ck):
    kv = fresh_cache(ck)
    ids, pos = torch.tensor([5, 6, 7]), torch.arange(3)
    with pytest.raises(ValueError, match="query_len"):  # 3 new tokens but context of 2
        ck.model(ids, pos, kv, meta([0, 1, 2], [0, 3], [2], [[0]]))
    with pytest.raises(ValueError, match="blocks"):  # 20 tokens need 2 blocks, table has 1
        ck.model(ids, pos, kv, meta([0, 1, 2], [0, 3], [20], [[0]]))
    with pytest.raises(ValueError, match="slot_mapping"):
        ck.model(ids, pos, kv, meta([0, 1], [0, 3], [3], [[0]]))
    with pytest.raises(ValueError, match="query_start_loc"):
        ck.model(ids, pos, kv, meta([0, 1, 2], [0, 3], [3, 3], [[0], [1]]))
    with pytest.raises(ValueError, match="outside the pool of 64"):
        ck.model(ids, pos, kv, meta([0, 1, 2], [0, 3], [3], [[64]]))
    with pytest.raises(ValueError, match="outside the pool"):  # a decode row whose table is padding
        ck.model(ids[:1], pos[:1], kv, meta([0], [0, 1], [5], [[-1]]))
