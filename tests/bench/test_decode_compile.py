"""``bench.decode_compile``: its plain-function regions are the decoder layer's own math (so the compile A/B
compares like with like), and its decode metadata addresses each sequence's next slot."""

from __future__ import annotations

import torch

from bench.decode_compile import (
    BASE_ATTENTION_MODULES,
    BLOCK,
    _kernel_input,
    attention_tables,
    decode_meta,
    kernel_call,
    layer_regions,
    load_base_attention,
)
from engine.attention import attention_dtype, plan_attention
from engine.checkpoint import load_checkpoint
from engine.linear import Int4Weight, Int8Weight
from engine.rope_table import rope_rotation
from tests.engine.checkpoints import make_tiny_gguf_llama


def test_plain_regions_equal_the_eager_layer(tmp_path):
    path = make_tiny_gguf_llama(tmp_path / "tiny-q41.gguf", tensor_type="Q4_1", seed=3)
    # the compile A/B times torch's int4 kernel (``main`` loads the model so)
    model = load_checkpoint(str(path), weights="int4", linear_kernel="torch").model
    c = model.config
    pre_eager, post_eager, pre_fn, post_fn, pre_args, post_args = layer_regions(model.layers[1])
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for b in (1, 3):
            h = torch.randn(b, c.hidden_size, generator=g)
            rot = rope_rotation(model.inv_freq, torch.arange(5, 5 + b))
            cos, sin = rot.real.contiguous(), rot.imag.contiguous()
            for want, got in zip(pre_eager(h, rot), pre_fn(*pre_args(h, cos, sin)), strict=True):
                assert got.shape == want.shape
                torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
            attn = torch.randn(b, c.num_heads * c.head_dim, generator=g).to(torch.bfloat16)
            want = post_eager(h.clone(), attn)
            got = post_fn(*post_args(h.clone(), attn))
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_decode_meta_points_at_each_sequences_next_slot():
    meta, pos = decode_meta(3, 20, blocks_per_seq=4)
    assert pos.tolist() == [20, 20, 20]
    assert meta.query_start_loc == [0, 1, 2, 3] and meta.seq_lens == [21, 21, 21]
    # position 20 is offset 4 of logical block 1; sequence i owns blocks 4i .. 4i + 3
    assert meta.slot_mapping.tolist() == [(4 * i + 1) * BLOCK + 4 for i in range(3)]
    assert meta.block_tables[2].tolist() == [8, 9, 10, 11]


def test_decode_meta_with_shared_blocks_plans_the_cascade():
    meta, _ = decode_meta(3, 70, blocks_per_seq=6, shared_blocks=4)
    # blocks 0-3 are every sequence's first four; position 70 is offset 6 of logical block 4, its own
    assert meta.block_tables.tolist() == [[0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 10, 11], [0, 1, 2, 3, 16, 17]]
    assert meta.slot_mapping.tolist() == [4 * BLOCK + 6, 10 * BLOCK + 6, 16 * BLOCK + 6]
    # on CPU the cascade is whole shared chunks of 256 positions (``engine.chunked_decode``): none here, one below
    plan = plan_attention(meta, torch.device("cpu"), 18, cache_dtype=torch.bfloat16)
    assert plan.decode.chunked is not None and plan.decode.chunked.shared_chunks == 0
    meta, _ = decode_meta(3, 300, blocks_per_seq=20, shared_blocks=17)
    plan = plan_attention(meta, torch.device("cpu"), 60, cache_dtype=torch.bfloat16)
    # shared chunks where attention computes in bf16 (a CPU with bf16 kernels), none elsewhere
    bf16 = attention_dtype(torch.bfloat16, torch.float32, torch.device("cpu")) == torch.bfloat16
    assert plan.decode.chunked.shared_chunks == (1 if bf16 else 0)


def test_attention_ab_cases_are_the_layouts_they_name():
    n = 1070
    nb = -(-(n + 1) // BLOCK)
    (t,), lens = attention_tables("b1 consecutive", n)
    assert t == list(range(nb)) and lens == [n + 1]
    (t,), _ = attention_tables("b1 prefix hit", n)
    assert t[:62] == list(range(62)) and t[62] == 8 * nb and len(t) == nb
    private, lens = attention_tables("b8 private", n)
    shared, _ = attention_tables("b8 shared", n)
    assert lens == [n + 1] * 8 and all(len(t) == nb for t in private + shared)
    ids = [b for t in private for b in t]
    assert len(set(ids)) == len(ids)  # no block shared
    assert all(t[:62] == list(range(62)) for t in shared)
    assert len({b for t in shared for b in t[62:]}) == 8 * (nb - 62)


def test_attention_ab_base_reads_its_decode_paths_from_its_own_checkout(tmp_path):
    import sys
    from pathlib import Path

    import engine.attention
    import engine.decode_attention

    root = Path(__file__).resolve().parents[2]
    base_dir = tmp_path / "base"
    (base_dir / "engine").mkdir(parents=True)
    for name in BASE_ATTENTION_MODULES:
        (base_dir / "engine" / f"{name}.py").write_text((root / "engine" / f"{name}.py").read_text())
    base = load_base_attention(str(base_dir))
    assert base is not engine.attention and base.__file__ == str(base_dir / "engine" / "attention.py")
    base_decode = sys.modules["base_decode_attention"]
    assert base_decode.__file__ == str(base_dir / "engine" / "decode_attention.py")
    assert base.decode_attention is base_decode.decode_attention  # not this checkout's
    assert base.decode_attention is not engine.decode_attention.decode_attention
    assert sys.modules["engine.decode_attention"] is engine.decode_attention  # restored
    assert sys.modules["engine.attention"] is engine.attention


def test_kernel_call_is_the_linear_s_weight_only_kernel(tmp_path):
    """``--breakdown`` / ``--linear-ab`` time ``kernel_call``: the kernel a generated token's row runs on,
    torch's int4 kernel (bf16, Q8_0 as two planes) or the native one (fp32), without bias or casts."""
    path = make_tiny_gguf_llama(tmp_path / "tiny-q80.gguf", tensor_type="Q8_0", seed=3)
    for setting in ("torch", "auto"):
        model = load_checkpoint(str(path), weights="native", linear_kernel=setting).model
        # the head is dense fp32 on torch's side where bf16 GEMMs are slow (engine.model): no weight-only kernel
        heads = [model.lm_head] if isinstance(model.lm_head, Int4Weight | Int8Weight) else []
        for lin in (model.layers[0].qkv, *heads):
            x = _kernel_input(
                lin, torch.randn(3, lin.in_features, generator=torch.Generator().manual_seed(1))
            )
            assert x.dtype == (torch.float32 if lin.fp32_kernel else torch.bfloat16)
            assert torch.equal(kernel_call(lin, x).float(), lin.forward(x.float(), dense=False))
