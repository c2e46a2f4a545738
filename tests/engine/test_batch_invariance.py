"""Batched == alone, bit for bit (issue 12 item 5): a sequence's logits do not depend on the rest of its step.

Engine level, on a tiny random Llama quantized to int4 at load, so the steps reach the kernels SmolLM2 runs on
(``Int4Weight`` with its dense prefill copy: bf16, or fp32 on CPUs without bf16 arithmetic; in_features
multiples of 32, 2 KV heads, decode contexts of more than one chunk, shared chunks over a 320-token common
prefix): every logit row of every sequence equals the row it gets alone, for bf16 and fp32 KV caches,
shared-prefix attention on and off, 1 and 2 threads, and when a prefill chunk joins a decode's step. Kernel
level: the properties the design rests on (each linear kernel gives a row the same bits at any row count; the
LM head likewise), so a torch upgrade that breaks one fails here, not only on the real model
(``bench.batch_invariance``).

Prefill is chunk-invariant too (other token budgets, prefix caching off: bit-identical logits, bf16 and fp32
caches). Across requests (a multi-turn chat): a token generated in one request and found in the prompt of a later
one ran the int4 kernel as a generated token and runs the dense copy as a prompt token, so only prompt tokens'
KV enters the prefix cache by default (``EngineConfig.cache_generated_kv``): the next turn served from the
cache equals it computed cold, bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from engine.linear import Int4Weight, Int8Weight
from engine.native_linear import resolve_linear_kernel
from engine.quantized import int4_groups, int8_groups, quantize
from engine.row_kernels import RowKernels, forward_rows
from tests.engine.engine_helpers import greedy, make_engine, random_tokens, tiny_checkpoint

N_NEW = 6
SHARED = random_tokens(320, 31)  # 20 whole blocks: more than one decode chunk of 256 positions
PROMPTS = [SHARED + random_tokens(n, 40 + i) for i, n in enumerate((30, 45, 17))] + [random_tokens(290, 50)]


def int4_checkpoint(linear_kernel: str = "auto", dense_min_rows: int | None | str = "auto"):
    """The tiny checkpoint quantized to int4 at load; ``linear_kernel``: ``auto`` (the native kernel where it
    builds, ``engine.native_linear``) or ``torch`` (torch's int4 kernel); ``dense_min_rows``: prompt rows on a
    dense copy (an integer), on the weight-only kernel (None: the native kernel's panel path from 16 rows), or
    as this CPU's default (``auto``)."""
    return tiny_checkpoint(weights="int4", linear_kernel=linear_kernel, dense_min_rows=dense_min_rows)


def run_alone(prompts, linear_kernel: str = "auto", dense_min_rows: int | None | str = "auto", **config):
    """Each prompt by itself, one after the other on one engine (later ones hit the shared prefix, as in a
    batch the followers wait for the leader's blocks): (tokens, logits ``[N_NEW, vocab]``) per prompt."""
    eng = make_engine(int4_checkpoint(linear_kernel, dense_min_rows), record_logits=True, **config)
    out = []
    for p in prompts:
        r = eng.add_request(p, greedy(N_NEW))
        eng.run_to_completion()
        out.append((r.output_token_ids, torch.stack(eng.logits_log[r.request_id])))
    return out


def run_batched(prompts, linear_kernel: str = "auto", dense_min_rows: int | None | str = "auto", **config):
    eng = make_engine(int4_checkpoint(linear_kernel, dense_min_rows), record_logits=True, **config)
    reqs = [eng.add_request(p, greedy(N_NEW)) for p in prompts]
    eng.run_to_completion()
    return [(r.output_token_ids, torch.stack(eng.logits_log[r.request_id])) for r in reqs]


@pytest.mark.parametrize("linear_kernel", ["auto", "torch"])
@pytest.mark.parametrize("decode_kernel", ["auto", "torch"])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("shared_prefix", [True, False])
@pytest.mark.parametrize("kv_dtype", ["bfloat16", "float32"])
def test_batched_logits_equal_alone_bit_for_bit(
    kv_dtype, shared_prefix, threads, decode_kernel, linear_kernel, dense_min_rows="auto"
):
    assert "Int4Weight" in int4_checkpoint(linear_kernel).model.weight_formats
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        # a budget that takes every prompt whole: the prompts are chunked alike batched and alone (chunk
        # boundaries that differ change prefill attention's rounding: module docstring)
        config = dict(
            kv_dtype=kv_dtype,
            shared_prefix_attention=shared_prefix,
            num_threads=threads,
            max_num_batched_tokens=4096,
            decode_kernel=decode_kernel,  # auto: the native kernel where it builds (engine.native_decode)
        )
        # auto: the native linear kernel where it builds (engine.native_linear)
        alone = run_alone(PROMPTS, linear_kernel, dense_min_rows, **config)
        batched = run_batched(PROMPTS, linear_kernel, dense_min_rows, **config)
    finally:
        torch.set_num_threads(previous)
    for (tokens, logits), (want_tokens, want_logits) in zip(batched, alone, strict=True):
        assert tokens == want_tokens
        assert torch.equal(logits, want_logits)  # every row, every bit


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dense_min_rows", [10, None], ids=["dense copy", "kernel rows"])
def test_batched_logits_equal_alone_with_prompt_rows_on_either_kernel(dense_min_rows, threads):
    """As above with prompt rows on a dense copy and on the weight-only kernel, whichever this CPU's default
    (``engine.dense_min_rows: auto``) is: four prompts' 350-row step takes the native AVX2 kernel's panel path,
    each prompt alone its own row count."""
    test_batched_logits_equal_alone_bit_for_bit("bfloat16", True, threads, "auto", "auto", dense_min_rows)


@pytest.mark.parametrize(
    "config",
    [
        {"max_num_batched_tokens": 100},  # every prompt cut into chunks of other lengths than alone
        {"max_num_batched_tokens": 37},  # chunks that end mid-block, a last chunk of a few rows
        {"enable_prefix_caching": False},  # every prompt prefilled whole: no prefix hit
        {"enable_prefix_caching": False, "max_num_batched_tokens": 64},
    ],
    ids=["budget 100", "budget 37", "cache off", "cache off, budget 64"],
)
@pytest.mark.parametrize("kv_dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("dense_min_rows", [10, None], ids=["dense copy", "kernel rows"])
def test_chunked_and_uncached_prefills_give_the_same_bits(config, kv_dtype, dense_min_rows):
    """Prefill attention cuts keys at fixed positions (``engine.chunked_prefill``): a prompt's K/V, and so every
    logit, do not depend on how it was chunked or whether its prefix came from the cache, whether prompt rows
    run on the dense copy or on the weight-only kernel (whose native AVX2 build switches to its panel path at
    16 rows: chunks of 37 and 64 rows against tails of a few)."""
    alone = run_alone(PROMPTS, kv_dtype=kv_dtype, max_num_batched_tokens=4096, dense_min_rows=dense_min_rows)
    got = run_batched(PROMPTS, kv_dtype=kv_dtype, dense_min_rows=dense_min_rows, **config)
    for (tokens, logits), (want_tokens, want_logits) in zip(got, alone, strict=True):
        assert tokens == want_tokens
        assert torch.equal(logits, want_logits)


def test_a_decode_row_keeps_its_bits_when_a_prefill_chunk_joins_its_step():
    """A 290-row prefill chunk in the same step as a one-row decode: by the step's row count the decode row
    would have run on the dense copy (``dense_min_rows``); per row it stays on the int4 kernel."""
    eng = make_engine(int4_checkpoint(), record_logits=True, kv_dtype="bfloat16")
    a = eng.add_request(PROMPTS[0], greedy(N_NEW))
    eng.step()  # a's prefill
    eng.step()  # a's first decode, alone
    b = eng.add_request(PROMPTS[3], greedy(N_NEW))
    eng.run_to_completion()
    assert b.num_cached_tokens == 0
    (want_a, want_a_logits), (want_b, want_b_logits) = run_alone(
        [PROMPTS[0], PROMPTS[3]], kv_dtype="bfloat16"
    )
    assert a.output_token_ids == want_a and b.output_token_ids == want_b
    assert torch.equal(torch.stack(eng.logits_log[a.request_id]), want_a_logits)
    assert torch.equal(torch.stack(eng.logits_log[b.request_id]), want_b_logits)


# ---- the kernel properties the engine relies on ------------------------------------------------------------


def quantized_linears() -> dict[str, Int4Weight | Int8Weight]:
    """Int4 (Q4_1) and int8 (Q8_0) linears 96 x 128 on torch's int4 kernel, and (``native ...``) on the native
    kernel where it builds (``engine.native_linear``)."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(96, 128, generator=g) / 128**0.5
    cpu = torch.device("cpu")
    native = resolve_linear_kernel("auto", cpu)
    out = {
        "int4": Int4Weight(int4_groups(quantize(w, "Q4_1")), None, cpu),
        "int8": Int8Weight(int8_groups(quantize(w, "Q8_0")), None, cpu),
    }
    if native is not None:
        out["native int4"] = Int4Weight(int4_groups(quantize(w, "Q4_1")), None, cpu, native=native)
        out["native int8"] = Int8Weight(int8_groups(quantize(w, "Q8_0")), None, cpu, native=native)
    return out


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("kind", list(quantized_linears()))
def test_each_linear_kernel_gives_a_row_the_same_bits_at_any_row_count(kind, threads):
    lin = quantized_linears()[kind]
    x = torch.randn(300, 128, generator=torch.Generator().manual_seed(4))
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = {d: torch.cat([lin.forward(x[i : i + 1], dense=d) for i in range(300)]) for d in (True, False)}
        torch.set_num_threads(threads)
        for rows in [*range(2, 18), 64, 300]:
            for dense in (True, False):
                assert torch.equal(lin.forward(x[:rows], dense=dense), one[dense][:rows]), (rows, dense)
    finally:
        torch.set_num_threads(previous)
    assert not torch.equal(one[True], one[False])  # two kernels, two roundings: hence the choice per row


def test_forward_rows_runs_each_row_on_its_own_kernel():
    lin = quantized_linears()["int4"]
    x = torch.randn(12, 128, generator=torch.Generator().manual_seed(5))
    prompt = torch.tensor([True] * 5 + [False, True, False] + [True] * 4)
    rows = RowKernels(prompt.nonzero().view(-1), (~prompt).nonzero().view(-1))
    got = forward_rows(lin, x, rows)
    for i in range(12):
        assert torch.equal(got[i], lin.forward(x[i : i + 1], dense=bool(prompt[i]))[0])
    assert torch.equal(forward_rows(lin, x, RowKernels(None, torch.arange(12))), lin.forward(x, dense=False))
    assert torch.equal(forward_rows(lin, x, RowKernels(torch.arange(12), None)), lin.forward(x, dense=True))
    assert torch.equal(forward_rows(lin, x, None), lin.forward(x))  # by row count: 12 >= dense_min_rows


@pytest.mark.parametrize("bf16_cpu", [True, False], ids=["bf16 CPU", "fp32 CPU"])
def test_the_lm_head_on_torch_kernels_gives_a_row_the_same_bits_in_any_batch(tmp_path, monkeypatch, bf16_cpu):
    """Without the native kernel, a Q8_0 head runs on torch's int4 kernel (two planes) with its top candidates
    rescored in fp32 where the CPU has bf16 arithmetic, and as a dense fp32 ``DenseWeight`` where it has not
    (``engine.weight_format.resolve``): both give a row the same logits alone and in any batch."""
    import engine.weight_format as weight_format
    from engine.checkpoint import load_checkpoint
    from engine.linear import DenseWeight
    from tests.engine.checkpoints import make_tiny_gguf_llama

    monkeypatch.setattr(weight_format, "bf16_kernels_available", lambda device: bf16_cpu)
    monkeypatch.setattr(weight_format, "fast_bf16_gemm", lambda device: bf16_cpu)
    # a Q8_0 GGUF with a tied embedding: on a bf16 CPU the head runs on the int4 kernel's two planes, its rows
    # decoded from the same blocks for the rescoring (as SmolLM2's)
    path = make_tiny_gguf_llama(tmp_path / "q8.gguf", tensor_type="Q8_0")
    model = load_checkpoint(str(path), weights="native", linear_kernel="torch").model
    if bf16_cpu:
        assert model.head_rows is not None  # the quantized head's top candidates are rescored in fp32
    else:
        assert isinstance(model.lm_head, DenseWeight) and model.head_rows is None
    h = torch.randn(16, model.config.hidden_size, generator=torch.Generator().manual_seed(6))
    one = torch.cat([model.compute_logits(h[i : i + 1]) for i in range(16)])
    for rows in (2, 3, 8, 16):
        assert torch.equal(model.compute_logits(h[:rows]), one[:rows])


def test_the_native_lm_head_gives_a_row_the_same_bits_in_any_batch_without_rescoring(tmp_path):
    from engine.checkpoint import load_checkpoint
    from tests.engine.checkpoints import make_tiny_gguf_llama

    path = make_tiny_gguf_llama(tmp_path / "q8.gguf", tensor_type="Q8_0")
    model = load_checkpoint(str(path), weights="native", linear_kernel="auto").model
    native = resolve_linear_kernel("auto", torch.device("cpu")) is not None
    assert model.lm_head.fp32_kernel == native
    assert (model.head_rows is None) == native  # fp32 logits: nothing to rescore
    h = torch.randn(16, model.config.hidden_size, generator=torch.Generator().manual_seed(6))
    one = torch.cat([model.compute_logits(h[i : i + 1]) for i in range(16)])
    if native:
        assert torch.equal(one, model.lm_head.forward(h))
    for rows in (2, 3, 8, 16):
        assert torch.equal(model.compute_logits(h[:rows]), one[:rows])


@pytest.mark.parametrize(("out_features", "in_features"), [(3072, 576), (576, 1536)])
def test_the_dense_copy_gives_a_prompt_row_the_same_bits_at_smollm2_sizes(out_features, in_features):
    """Before: on a Xeon with AMX, oneDNN's bf16 GEMM computed ~15 % of the rows of a 700-row call otherwise
    than alone (SmolLM2's gate/up and down shapes; the 128-wide layers above never showed it), so
    ``bench.batch_invariance`` found 1-2 of 8 SmolLM2 streams differing batched vs alone and cache off vs on.
    Calls there are now cut into ``ROW_INVARIANT_ROWS``-row slices (``engine.bf16_gemm.row_slices_needed``)."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(out_features, in_features, generator=g) / in_features**0.5
    lin = Int4Weight(int4_groups(quantize(w, "Q4_1")), None, torch.device("cpu"))
    assert lin.dense is not None
    x = torch.randn(1100, in_features, generator=g)
    alone = torch.cat([lin.forward(x[i : i + 1], dense=True) for i in range(0, 1100, 7)])
    for rows in (33, 100, 512, 700, 1100):
        batch = lin.forward(x[:rows], dense=True)
        assert torch.equal(batch[::7], alone[: len(batch[::7])]), rows


def test_bf16_gemms_are_cut_into_row_invariant_slices_where_needed(monkeypatch):
    import engine.bf16_gemm as gemm

    seen: list[int] = []

    def one_call(part: torch.Tensor) -> torch.Tensor:
        seen.append(part.shape[0])
        return part * 2

    x = torch.arange(70 * 3, dtype=torch.bfloat16).view(70, 3)
    monkeypatch.setattr(gemm, "row_slices_needed", lambda: True)
    assert torch.equal(gemm.bf16_gemm(x, one_call), x * 2)
    assert seen == [32, 32, 6]
    seen.clear()
    monkeypatch.setattr(gemm, "row_slices_needed", lambda: False)
    assert torch.equal(gemm.bf16_gemm(x, one_call), x * 2)
    assert seen == [70]


@pytest.mark.parametrize("slices", [True, False])
def test_a_lone_bf16_gemm_row_runs_as_a_two_row_call(monkeypatch, slices):
    """oneDNN's one-row bf16 GEMM differed by an ulp from the same row in any bigger call on a Zen 4
    (``engine.bf16_gemm._at_least_two_rows``): a lone row, or a last slice of one row, is computed twice."""
    import engine.bf16_gemm as gemm

    seen: list[int] = []

    def one_call(part: torch.Tensor) -> torch.Tensor:
        seen.append(part.shape[0])
        return part * 2

    monkeypatch.setattr(gemm, "row_slices_needed", lambda: slices)
    x = torch.arange(65 * 3, dtype=torch.bfloat16).view(65, 3)
    assert torch.equal(gemm.bf16_gemm(x[:1], one_call), x[:1] * 2)
    assert torch.equal(gemm.bf16_gemm(x, one_call), x * 2)
    assert seen == ([2, 32, 32, 2] if slices else [2, 65])


@pytest.mark.parametrize("dense_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_the_dense_copy_gives_a_lone_prompt_row_the_bits_it_has_in_a_chunk(dense_dtype):
    """A prefix hit leaves one prompt token (or a few) to compute; their rows must equal those tokens' rows in a
    whole chunk (cache on == cache off), at SmolLM2's down-projection shape, where a one-row bf16 call differed
    on a Zen 4 and fp32 calls of 1-3 and 5-11 rows differed on an AVX2 Zen 3 (``engine.bf16_gemm.fp32_gemm``)."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(576, 1536, generator=g) / 1536**0.5
    lin = Int4Weight(int4_groups(quantize(w, "Q4_1")), None, torch.device("cpu"), dense_dtype=dense_dtype)
    assert lin.dense.dtype == dense_dtype
    x = torch.randn(64, 1536, generator=g)
    chunk = lin.forward(x, dense=True)
    alone = torch.cat([lin.forward(x[i : i + 1], dense=True) for i in range(64)])
    assert torch.equal(alone, chunk)
    for rows in range(2, 16):  # the few-token tails of prefix hits
        assert torch.equal(lin.forward(x[-rows:], dense=True), chunk[-rows:]), rows


def test_a_dense_fp32_weight_gives_a_row_the_same_bits_at_any_row_count():
    """``DenseWeight`` (``weights: float32`` layers; the fp32 LM head of CPUs without bf16 arithmetic): a decode
    row alone, in a batch of 8 and in a 300-row prefill chunk comes out the same (the prepacked copy at every row
    count; the plain GEMM's one-row and many-row calls round differently)."""
    from engine.linear import DenseWeight

    g = torch.Generator().manual_seed(8)
    lin = DenseWeight(torch.randn(1536, 576, generator=g) / 24, torch.randn(1536, generator=g))
    x = torch.randn(300, 576, generator=g)
    alone = torch.cat([lin.forward(x[i : i + 1]) for i in range(300)])
    for rows in (2, 3, 8, 13, 48, 49, 300):
        assert torch.equal(lin.forward(x[:rows]), alone[:rows]), rows
    assert torch.equal(lin.forward(x.view(3, 100, 576)).view(300, -1), alone)


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "float32"])
def test_a_next_turn_served_from_the_cache_equals_it_cold_bit_for_bit(kv_dtype):
    """Turn 2's prompt holds turn 1's prompt and answer. Before (a burst trial: 3 of 24 greedy SmolLM2 turns
    answered otherwise warm than after the cache was cleared), turn 1's answer blocks were cached with the KV
    the decode path wrote, and turn 2 read them where a cold turn 2 computes them as prompt rows."""
    first = random_tokens(150, seed=11)
    eng = make_engine(int4_checkpoint(), record_logits=True, kv_dtype=kv_dtype)
    turn1 = eng.add_request(first, greedy(40))
    eng.run_to_completion()
    second = first + turn1.output_token_ids + random_tokens(20, seed=12)
    warm = eng.add_request(second, greedy(N_NEW))
    eng.run_to_completion()
    assert warm.num_cached_tokens == len(first)  # the prompt, token-granular: none of the answer
    cold_eng = make_engine(int4_checkpoint(), record_logits=True, kv_dtype=kv_dtype)
    cold = cold_eng.add_request(second, greedy(N_NEW))
    cold_eng.run_to_completion()
    assert cold.num_cached_tokens == 0
    assert warm.output_token_ids == cold.output_token_ids
    assert torch.equal(
        torch.stack(eng.logits_log[warm.request_id]), torch.stack(cold_eng.logits_log[cold.request_id])
    )
    eng.kv.check_invariants()


def test_with_cache_generated_kv_the_next_turn_reuses_the_answer_blocks():
    """The opt-in (vLLM's behaviour): the answer's full blocks are cached and served to the next turn."""
    first = random_tokens(150, seed=11)
    eng = make_engine(int4_checkpoint(), cache_generated_kv=True)
    turn1 = eng.add_request(first, greedy(40))
    eng.run_to_completion()
    second = first + turn1.output_token_ids + random_tokens(20, seed=12)
    warm = eng.add_request(second, greedy(N_NEW))
    eng.run_to_completion()
    # every token turn 1 computed: its prompt and its answer less the last token (never fed back)
    assert warm.num_cached_tokens == len(first) + len(turn1.output_token_ids) - 1
