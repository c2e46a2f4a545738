"""The last layer for the output rows only (``engine.output_rows``): the same logits as the whole step, bit for
bit, with only the LM head's rows going through the last layer after its K/V store."""

from __future__ import annotations

import pytest
import torch

import engine.model as model_module
from engine.amx_gemm import AmxDenseWeight
from engine.attention import AttentionMetadata
from engine.output_rows import output_step
from engine.row_kernels import RowKernels
from tests.engine.engine_helpers import greedy, make_engine, random_tokens, tiny_checkpoint

SHARED = random_tokens(80, 61)
PROMPTS = [SHARED + random_tokens(n, 62 + i) for i, n in enumerate((37, 5, 70))] + [random_tokens(130, 66)]


def logits_per_request(ck, shortcut: bool, monkeypatch, **config) -> list[tuple[list[int], torch.Tensor]]:
    """Tokens and logits ``[new, vocab]`` of ``PROMPTS`` (batched, after ``SHARED`` alone was cached), with the
    output rows' last layer on or off (``engine.model.output_step`` then finds no shortcut)."""
    with monkeypatch.context() as m:
        if not shortcut:
            m.setattr(model_module, "output_step", lambda *args: None)
        eng = make_engine(ck, record_logits=True, **config)
        eng.generate([SHARED], greedy(1))
        reqs = [eng.add_request(p, greedy(5)) for p in PROMPTS]
        eng.run_to_completion()
        return [(r.output_token_ids, torch.stack(eng.logits_log[r.request_id])) for r in reqs]


@pytest.mark.parametrize(
    ("kind", "weights", "kv_dtype", "budget"),
    [
        ("hf", "int4", "bfloat16", 48),  # prompts in chunks: steps with no output row, mixed prefill + decode
        ("hf", "int4", "float32", 4096),
        ("hf-d64", "float32", "bfloat16", 40),  # SmolLM2's attention shape (the AMX prefill where it runs)
    ],
)
def test_output_rows_give_the_whole_steps_logits_bit_for_bit(kind, weights, kv_dtype, budget, monkeypatch):
    ck = tiny_checkpoint(kind, weights=weights)
    # 2 threads, whatever an earlier test left torch's count at: ``prefill_kernel: auto`` takes the AVX2 build
    # (CPUs without AVX-512) only from 2 threads
    config = dict(kv_dtype=kv_dtype, max_num_batched_tokens=budget, num_threads=2)
    eng = make_engine(ck, **config)
    assert eng.runner.glue_kernel is not None and eng.runner.prefill_kernel is not None
    on = logits_per_request(ck, True, monkeypatch, **config)
    off = logits_per_request(ck, False, monkeypatch, **config)
    for (tokens_on, logits_on), (tokens_off, logits_off) in zip(on, off, strict=True):
        assert tokens_on == tokens_off
        assert torch.equal(logits_on, logits_off)


def test_only_output_rows_reach_the_last_layers_mlp(monkeypatch):
    """A 100-token prompt in chunks of at most 32 tokens and one generated token: every layer but the last runs
    the MLP on all 100 rows, the last only on the final chunk's last row (2 threads: the shortcut needs the
    native prefill kernel, which ``auto`` takes on AVX2-only CPUs from 2 threads)."""
    ck = tiny_checkpoint("hf", weights="int4")
    layers = ck.model.layers
    seen: dict[int, list[int]] = {0: [], len(layers) - 1: []}
    real = model_module.forward_rows

    def counting(linear, x, rows):
        for i in seen:
            if linear is layers[i].down:
                seen[i].append(x.shape[0])
        return real(linear, x, rows)

    monkeypatch.setattr(model_module, "forward_rows", counting)
    eng = make_engine(ck, max_num_batched_tokens=32, enable_prefix_caching=False, num_threads=2)
    one_call = eng.runner.decode_step
    eng.runner.decode_step = None  # every layer in Python, to see them
    eng.generate([random_tokens(100, 70)], greedy(1))
    assert sum(seen[0]) == 100 and len(seen[0]) >= 4
    assert seen[len(layers) - 1] == [1]
    if one_call is not None and isinstance(layers[0].qkv.dense, AmxDenseWeight):
        # with the one-call layer step, each prompt chunk's other layers run in C (on the AMX dense copies),
        # and the last layer still runs its MLP on the final chunk's last row alone
        seen = {0: [], len(layers) - 1: []}
        eng = make_engine(ck, max_num_batched_tokens=32, enable_prefix_caching=False, num_threads=2)
        before = one_call.prompt_steps
        eng.generate([random_tokens(100, 71)], greedy(1))
        assert one_call.prompt_steps - before == 4  # 32 + 32 + 32 + 4 rows
        assert seen == {0: [], len(layers) - 1: [1]}


def meta(qsl: list[int], seq_lens: list[int], prompt_lens: list[int] | None = None, kernels: bool = True):
    """Metadata of a step over ``len(seq_lens)`` sequences with 4-block tables (block ``10 i + j``)."""
    tables = torch.tensor([[10 * i + j for j in range(4)] for i in range(len(seq_lens))])
    kernel = object() if kernels else None
    return AttentionMetadata(torch.arange(qsl[-1]), qsl, seq_lens, tables, 16, kernel, prompt_lens, kernel)


def test_output_step_keeps_each_rows_sequence_context_and_role():
    m = meta([0, 5, 6, 9], [20, 33, 9], [20, 40, 9])
    rows = RowKernels(torch.tensor([0, 1, 2, 3, 4, 6, 7, 8]), torch.tensor([5]))
    step = output_step(m, rows, torch.tensor([4, 5, 8]))
    assert step is not None
    assert step.meta.query_start_loc == [0, 1, 2, 3]
    assert step.meta.seq_lens == [20, 33, 9]
    assert step.meta.prompt_lens == [20, 40, 9]
    assert step.meta.slot_mapping.tolist() == [4, 5, 8]
    assert torch.equal(step.meta.block_tables, m.block_tables)
    assert step.row_kernels.dense.tolist() == [0, 2] and step.row_kernels.kernel.tolist() == [1]
    # the second sequence only: its own table and lengths
    one = output_step(m, rows, torch.tensor([5]))
    assert one.meta.seq_lens == [33] and one.meta.block_tables.tolist() == [[10, 11, 12, 13]]
    assert one.row_kernels.dense is None and one.row_kernels.kernel.tolist() == [0]
    # no output row (a prefill chunk that does not end its prompt): an empty step
    none = output_step(m, rows, torch.tensor([], dtype=torch.int64))
    assert none.meta.query_start_loc == [0] and none.meta.seq_lens == [] and none.rows.numel() == 0


def test_output_step_declines_what_it_cannot_keep_bit_exact():
    m = meta([0, 5, 6], [20, 33])
    assert output_step(m, None, torch.tensor([3])) is None  # not its sequence's last row
    assert output_step(m, None, torch.tensor([4, 4])) is None  # one sequence twice
    assert output_step(meta([0, 5, 6], [20, 33], kernels=False), None, torch.tensor([4, 5])) is None
    assert output_step(m, None, torch.tensor([4, 5])) is not None
    assert output_step(meta([0, 1, 2], [20, 33]), None, torch.tensor([0, 1])) is None  # every row: a decode
    with pytest.raises(ValueError, match="outside the step's 6 rows"):
        output_step(m, None, torch.tensor([6]))


@pytest.mark.parametrize("glue", [True, False])
def test_forward_returns_the_output_rows_of_the_whole_step(glue):
    """``LlamaModel.forward(output_rows=)`` on the torch and the glue path: the whole step's rows, bit for bit;
    no output row at all: an empty result, the K/V still stored (the next step reads them)."""
    ck = tiny_checkpoint("hf", weights="int4")
    eng = make_engine(ck)
    runner = eng.runner
    kernel = runner.glue_kernel if glue else None
    ids = torch.tensor(random_tokens(40, 71))
    m = AttentionMetadata(
        torch.cat([torch.arange(25), 32 + torch.arange(15)]),  # blocks 0, 1 and block 2
        [0, 25, 40],
        [25, 15],
        torch.tensor([[0, 1], [2, 0]]),
        16,
        runner.decode_kernel,
        [25, 30],
        runner.prefill_kernel,
    )
    positions = torch.cat([torch.arange(25), torch.arange(15)])
    rows = RowKernels(torch.arange(40), None)
    whole = ck.model(ids, positions, runner.kv_cache, m, row_kernels=rows, glue=kernel)
    cache = runner.kv_cache.clone()
    runner.kv_cache.zero_()
    got = ck.model(
        ids, positions, runner.kv_cache, m, row_kernels=rows, glue=kernel, output_rows=torch.tensor([24])
    )
    assert torch.equal(got, whole[24:25])
    assert torch.equal(runner.kv_cache, cache)
    runner.kv_cache.zero_()
    empty = ck.model(
        ids,
        positions,
        runner.kv_cache,
        m,
        row_kernels=rows,
        glue=kernel,
        output_rows=torch.tensor([], dtype=torch.int64),
    )
    assert empty.shape == (0, ck.config.hidden_size)
    assert torch.equal(runner.kv_cache, cache)


def test_output_rows_step_refuses_a_cache_the_glue_does_not_store():
    """The last layer's output-rows step relies on the glue kernel having stored every row's K/V (fp32 / bf16
    caches); with another cache dtype the layer refuses it by name instead of dropping the other rows' K/V."""
    ck = tiny_checkpoint("hf", weights="int4")
    runner = make_engine(ck).runner
    c = ck.config
    ids = torch.tensor(random_tokens(3, 72))
    positions = torch.arange(3)
    m = AttentionMetadata(
        torch.arange(3),
        [0, 3],
        [3],
        torch.tensor([[0]]),
        16,
        runner.decode_kernel,
        [3],
        runner.prefill_kernel,
    )
    step = output_step(m, None, torch.tensor([2]))
    h = ck.model.embed_tokens(ids)
    x = runner.glue_kernel.rmsnorm(h, ck.model.layers[-1].input_norm, c.rms_norm_eps)
    cos_sin = torch.view_as_real(ck.model.rope.rotations(positions)).view(3, -1, 2)
    fp16_cache = torch.zeros(2, 4, 16, c.num_kv_heads, c.head_dim, dtype=torch.float16)
    with pytest.raises(ValueError, match="needs K/V stored by the glue kernel"):
        ck.model.layers[-1].forward_glued(
            h, x, cos_sin, fp16_cache, None, None, runner.glue_kernel, ck.model.norm, (step, None)
        )
