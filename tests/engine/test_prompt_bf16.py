"""Prompt-only steps in bf16 between the dense copies (``DecoderLayer.prompt_bf16``): the same logits as the fp32
round trip, bit for bit, and taken only where every dense copy rounds to bf16 and returns bf16."""

from __future__ import annotations

import pytest
import torch

from engine.amx_gemm import AmxDenseWeight
from engine.linear import dense_bf16_in_out
from tests.engine.engine_helpers import greedy, make_engine, random_tokens, tiny_checkpoint

SHARED = random_tokens(70, 81)
PROMPTS = [SHARED + random_tokens(n, 82 + i) for i, n in enumerate((33, 9, 61))] + [random_tokens(120, 86)]


def run(ck, bf16: bool, monkeypatch, **config) -> list[tuple[list[int], torch.Tensor]]:
    """Tokens and logits of ``PROMPTS`` (batched after ``SHARED`` was cached) with every layer's ``prompt_bf16``
    set to ``bf16``."""
    with monkeypatch.context() as m:
        for layer in ck.model.layers:
            m.setattr(layer, "prompt_bf16", bf16)
        eng = make_engine(ck, record_logits=True, **config)
        eng.generate([SHARED], greedy(1))
        reqs = [eng.add_request(p, greedy(4)) for p in PROMPTS]
        eng.run_to_completion()
        return [(r.output_token_ids, torch.stack(eng.logits_log[r.request_id])) for r in reqs]


@pytest.mark.parametrize(("kv_dtype", "budget"), [("bfloat16", 40), ("float32", 4096)])
def test_prompt_steps_in_bf16_give_the_fp32_round_trips_logits(kv_dtype, budget, monkeypatch):
    ck = tiny_checkpoint("hf", weights="int4", dense_gemm="onednn")
    layer = ck.model.layers[0]
    dense = layer.gate_up.dense
    # where the dense copies are oneDNN's bf16 (CPUs with bf16 GEMMs) the flag is on and must change nothing;
    # elsewhere (fp32 copies, or none) it is off
    assert layer.prompt_bf16 == (isinstance(dense, torch.Tensor) and dense.dtype == torch.bfloat16)
    if not layer.prompt_bf16:
        assert not dense_bf16_in_out(layer.gate_up)
        return
    config = dict(kv_dtype=kv_dtype, max_num_batched_tokens=budget)
    on = run(ck, True, monkeypatch, **config)
    off = run(ck, False, monkeypatch, **config)
    for (tokens_on, logits_on), (tokens_off, logits_off) in zip(on, off, strict=True):
        assert tokens_on == tokens_off
        assert torch.equal(logits_on, logits_off)


def test_dense_bf16_in_out_needs_a_bf16_onednn_copy_and_no_bias():
    ck = tiny_checkpoint("hf", weights="int4", dense_gemm="onednn")
    lin = ck.model.layers[0].down
    if not isinstance(lin.dense, torch.Tensor) or lin.dense.dtype != torch.bfloat16:
        assert not dense_bf16_in_out(lin)
        return
    assert dense_bf16_in_out(lin)
    kernel = type("Kernel", (), {"mm": lambda self, w, x, threads=None: x})()
    amx = AmxDenseWeight(
        torch.zeros(1, 1, 16, 16, 2, dtype=torch.bfloat16), lin.out_features, lin.in_features, kernel
    )
    with pytest.MonkeyPatch.context() as m:
        m.setattr(lin, "dense", amx)  # the AMX GEMM's copy returns fp32
        assert not dense_bf16_in_out(lin)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(lin, "dense", torch.zeros(lin.out_features, lin.in_features))  # an fp32 copy: no rounding
        assert not dense_bf16_in_out(lin)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(lin, "bias", torch.zeros(lin.out_features))  # an fp32 bias add after the bf16 result
        assert not dense_bf16_in_out(lin)
