"""The native decode-attention kernel (``engine.native_decode``): against float64 attention, a sequence's result
independent of the rest of the batch (bit for bit), bad arguments refused, the build cached and checked, and the
engine setting ``engine.decode_kernel``."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from engine import native_decode
from engine.attention_kernels import decode_kernel_variant, resolve_decode_kernel
from engine.native_build import NativeKernelError
from engine.native_decode import NativeDecodeKernel, reference_decode
from tests.engine.engine_helpers import (
    greedy,
    make_engine,
    random_tokens,
    smollm2_checkpoint,
    tiny_checkpoint,
)

AVAILABLE = native_decode._cpu_ok(native_decode.build_isa())[0] and native_decode._compiler() is not None
needs_kernel = pytest.mark.skipif(
    not AVAILABLE, reason="needs an AVX-512 or AVX2 x86-64 CPU and a C compiler"
)


@pytest.fixture(scope="module")
def kernel(tmp_path_factory) -> NativeDecodeKernel:
    if not AVAILABLE:
        pytest.skip("needs an AVX-512 or AVX2 x86-64 CPU and a C compiler")
    return NativeDecodeKernel.build(tmp_path_factory.mktemp("kernels"), group=3, head_dim=64)


@pytest.fixture(scope="module")
def generic_kernel(kernel, tmp_path_factory) -> NativeDecodeKernel:
    """The same source without the model's shape compiled in (runtime sizes)."""
    return NativeDecodeKernel.build(tmp_path_factory.mktemp("generic"))


def random_case(gen, b, group, kvh, d, lens, dtype, block_size=16, num_blocks=128):
    cache = torch.randn(2, num_blocks, block_size, kvh, d, generator=gen).to(dtype)
    width = max(-(-n // block_size) for n in lens) + 1
    ids = torch.randperm(num_blocks, generator=gen)[: b * width]
    tables = ids.view(b, width).to(torch.int32).contiguous()
    q = torch.randn(b, group * kvh, d, generator=gen)
    return q, cache, tables, torch.tensor(lens, dtype=torch.int32)


@needs_kernel
@pytest.mark.parametrize(
    "group, kvh, d, dtype",
    [
        (3, 3, 64, torch.bfloat16),  # SmolLM2's shapes, bf16 cache
        (3, 3, 64, torch.float32),
        (4, 2, 128, torch.bfloat16),  # Llama-style head_dim
        (1, 4, 32, torch.float32),  # head_dim off the constant shapes, still 16-lane
        (2, 1, 24, torch.bfloat16),  # head_dim not a multiple of 16: the scalar loops
        (9, 1, 64, torch.float32),  # more query heads per KV head than the vector path holds
    ],
)
def test_kernel_matches_float64_attention(kernel, group, kvh, d, dtype):
    gen = torch.Generator().manual_seed(group * 100 + d)
    lens = [1, 15, 16, 17, 100, 201]
    q, cache, tables, lens_t = random_case(gen, len(lens), group, kvh, d, lens, dtype)
    got = kernel.attend(q, cache, tables, lens_t, max(lens), d**-0.5)
    want = reference_decode(q, cache, tables, lens_t, d**-0.5)
    assert got.dtype == torch.float32 and got.shape == q.shape
    torch.testing.assert_close(got.double(), want, rtol=2e-5, atol=2e-6)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("magnitude", [30.0, 1e29])
def test_peaked_scores_far_past_the_exp_clamp_match_float64_attention(kernel, dtype, magnitude):
    """Each query head a multiple of one key of its sequence: score gaps far beyond 87 (e^x clamped at -87) and,
    at 1e29, near 1e30 (past what the range reduction takes unclamped): one-hot softmaxes, finite outputs equal to
    float64 attention (that key's value)."""
    gen = torch.Generator().manual_seed(23)
    lens = [1, 17, 100, 201]
    q, cache, tables, lens_t = random_case(gen, len(lens), 3, 3, 64, lens, dtype)
    block_size = cache.shape[2]
    for b, n in enumerate(lens):
        for head in range(q.shape[1]):
            pos = int(torch.randint(0, n, (1,), generator=gen))
            q[b, head] = (
                cache[0, int(tables[b, pos // block_size]), pos % block_size, head // 3].float() * magnitude
            )
    got = kernel.attend(q, cache, tables, lens_t, max(lens), 0.125)
    assert bool(torch.isfinite(got).all())
    torch.testing.assert_close(
        got.double(), reference_decode(q, cache, tables, lens_t, 0.125), rtol=2e-5, atol=2e-6
    )


@needs_kernel
@pytest.mark.parametrize("block_size", [1, 8, 24, 32])
def test_kernel_walks_blocks_of_any_size(kernel, block_size):
    """The tiles of 16 positions find their rows block by block from one division per tile: blocks smaller than,
    larger than and not a multiple of a tile still give every position's row (against float64)."""
    gen = torch.Generator().manual_seed(block_size)
    lens = [1, 7, 16, 33, 100, 229]
    blocks = len(lens) * (-(-max(lens) // block_size) + 1)
    q, cache, tables, lens_t = random_case(gen, len(lens), 3, 3, 64, lens, torch.bfloat16, block_size, blocks)
    got = kernel.attend(q, cache, tables, lens_t, max(lens), 0.125)
    want = reference_decode(q, cache, tables, lens_t, 0.125)
    torch.testing.assert_close(got.double(), want, rtol=2e-5, atol=2e-6)


@needs_kernel
def test_bf16_queries_are_widened_exactly(kernel):
    gen = torch.Generator().manual_seed(1)
    q, cache, tables, lens = random_case(gen, 2, 3, 3, 64, [50, 70], torch.bfloat16)
    qb = q.to(torch.bfloat16)
    assert torch.equal(
        kernel.attend(qb, cache, tables, lens, 70, 0.125),
        kernel.attend(qb.float(), cache, tables, lens, 70, 0.125),
    )


@needs_kernel
def test_a_sequence_gets_the_same_bits_alone_and_in_any_batch(kernel):
    # batched == alone by construction: the kernel computes each sequence alone, its positions in order
    gen = torch.Generator().manual_seed(2)
    lens = [300, 17, 1, 129, 64]
    q, cache, tables, lens_t = random_case(gen, 5, 3, 3, 64, lens, torch.bfloat16)
    together = kernel.attend(q, cache, tables, lens_t, 300, 0.125)
    for i in range(5):
        alone = kernel.attend(q[i : i + 1], cache, tables[i : i + 1], lens_t[i : i + 1], lens[i], 0.125)
        assert torch.equal(alone[0], together[i])
    # the same sequence sharing its leading blocks with others (one system prompt, many users)
    shared = tables.clone()
    shared[1:, :4] = shared[0, :4]
    lens2 = torch.tensor([300, 80, 90, 129, 70], dtype=torch.int32)
    batch = kernel.attend(q, cache, shared, lens2, 300, 0.125)
    alone = kernel.attend(q[2:3], cache, shared[2:3], lens2[2:3], 90, 0.125)
    assert torch.equal(alone[0], batch[2])
    # the shared blocks walked across the sequences (read once) or each sequence alone: the same bits
    assert torch.equal(kernel.attend(q, cache, shared, lens2, 300, 0.125, shared_len=64), batch)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("length", [1, 15, 16, 17, 300, 1071])
def test_a_lone_sequence_over_threads_gets_the_one_thread_bits(kernel, generic_kernel, dtype, length):
    # one sequence spread over a team (scores by positions, softmax by heads, values by KV head and half of D; or
    # whole KV heads per thread): every number computed as on one thread, so any team size gives the same bits
    gen = torch.Generator().manual_seed(length)
    q, cache, tables, lens = random_case(gen, 1, 3, 3, 64, [length], dtype, num_blocks=80)
    one = kernel.attend(q, cache, tables, lens, 1071, 0.125)
    for threads in (2, 3, 5):
        for split in ("auto", "positions", "heads"):
            got = kernel.attend(q, cache, tables, lens, 1071, 0.125, threads=threads, split=split)
            assert torch.equal(got, one)
    # shapes off the compiled constants: two KV heads of 128 (one half of D each), an odd number of 16-chunks
    for group, kvh, d in ((4, 2, 128), (2, 3, 48)):
        q, cache, tables, lens = random_case(gen, 1, group, kvh, d, [length], dtype, num_blocks=80)
        one = generic_kernel.attend(q, cache, tables, lens, 1071, d**-0.5)
        for split in ("positions", "heads"):
            got = generic_kernel.attend(q, cache, tables, lens, 1071, d**-0.5, threads=2, split=split)
            assert torch.equal(got, one)


@needs_kernel
def test_bad_arguments_are_refused_before_any_read(kernel):
    gen = torch.Generator().manual_seed(3)
    q, cache, tables, lens = random_case(gen, 2, 3, 3, 64, [20, 40], torch.bfloat16)
    bad = tables.clone()
    bad[1, 0] = cache.shape[1]  # a block id outside the pool
    with pytest.raises(ValueError, match="refused"):
        kernel.attend(q, cache, bad, lens, 40, 0.125)
    with pytest.raises(ValueError, match="refused"):
        kernel.attend(q, cache, tables, torch.tensor([20, 41], dtype=torch.int32), 40, 0.125)  # past max_len
    with pytest.raises(ValueError, match="refused"):
        kernel.attend(q, cache, tables, torch.tensor([0, 40], dtype=torch.int32), 40, 0.125)  # empty context
    with pytest.raises(ValueError, match="refused"):  # a table too short for its length
        kernel.attend(q, cache, tables[:, :1].contiguous(), lens, 40, 0.125)
    with pytest.raises(ValueError, match="int32"):
        kernel.attend(q, cache, tables.long(), lens, 40, 0.125)
    with pytest.raises(ValueError, match="does not match"):
        kernel.attend(q[:, :, :32].contiguous(), cache, tables, lens, 40, 0.125)
    with pytest.raises(ValueError, match="refused"):  # shared positions not a multiple of 16
        kernel.attend(q, cache, tables, lens, 40, 0.125, shared_len=8)
    with pytest.raises(ValueError, match="refused"):  # shared positions past a length
        kernel.attend(q, cache, tables, lens, 40, 0.125, shared_len=32)
    with pytest.raises(ValueError, match="refused"):  # 64-bit arguments reach the kernel whole (2**32 + 16)
        kernel.attend(q, cache, tables, lens, 40, 0.125, shared_len=2**32 + 16)
    with pytest.raises(ValueError, match="scratch"):
        kernel.attend(q, cache, tables, lens, 40, 0.125, torch.empty(3))
    with pytest.raises(ValueError, match="threads"):
        kernel.attend(q[:1], cache, tables[:1], lens[:1], 40, 0.125, threads=0)
    with pytest.raises(ValueError, match="split"):
        kernel.attend(q[:1], cache, tables[:1], lens[:1], 40, 0.125, threads=2, split="rows")


@needs_kernel
def test_the_shape_compiled_with_constants_gives_the_generic_code_s_bits(kernel, generic_kernel):
    # the model's shape is compiled with constants (accumulators in registers); the arithmetic and its order are
    # those of the runtime-sized code: the same bits
    generic = generic_kernel
    assert generic.path != kernel.path
    gen = torch.Generator().manual_seed(4)
    lens = [1, 33, 500, 1071]
    q, cache, tables, lens_t = random_case(gen, 4, 3, 3, 64, lens, torch.bfloat16, num_blocks=320)
    assert torch.equal(
        kernel.attend(q, cache, tables, lens_t, 1071, 0.125),
        generic.attend(q, cache, tables, lens_t, 1071, 0.125),
    )


@needs_kernel
def test_the_build_is_cached_by_source_and_compiler(tmp_path):
    first = NativeDecodeKernel.build(tmp_path)
    built = sorted(p.name for p in tmp_path.iterdir())
    assert len(built) == 1 and built[0].startswith("paged_decode-") and built[0].endswith(".so")
    mtime = first.path.stat().st_mtime_ns
    again = NativeDecodeKernel.build(tmp_path)
    assert again.path == first.path and again.path.stat().st_mtime_ns == mtime  # found, not rebuilt


def test_no_compiler_is_a_named_error_and_auto_falls_back(monkeypatch, tmp_path):
    monkeypatch.setattr(native_decode, "_compiler", lambda: None)
    monkeypatch.setattr(native_decode, "_cpu_ok", lambda isa="avx512": (True, ""))
    with pytest.raises(NativeKernelError, match="no C compiler"):
        NativeDecodeKernel.build(tmp_path)
    native_decode._shared_kernel.cache_clear()
    try:
        assert resolve_decode_kernel("auto", torch.device("cpu")) is None
        with pytest.raises(
            ValueError, match="engine.decode_kernel: native is not available here: no C compiler"
        ):
            resolve_decode_kernel("native", torch.device("cpu"))
    finally:
        native_decode._shared_kernel.cache_clear()


def test_a_failed_compile_leaves_no_library(monkeypatch, tmp_path):
    monkeypatch.setattr(native_decode, "_cpu_ok", lambda isa="avx512": (True, ""))
    monkeypatch.setattr(
        native_decode, "FLAGS", (*native_decode.FLAGS, "-DPREFIXGATE_NO_SUCH=", "-Werror=unknown")
    )
    fake = tmp_path / "fake-cc"
    fake.write_text(
        "#!/bin/sh\n[ \"$1\" = --version ] && { echo fake 1.0; exit 0; }\necho 'error: broken' >&2\nexit 1\n"
    )
    fake.chmod(0o755)
    monkeypatch.setenv("CC", str(fake))
    out = tmp_path / "kernels"
    with pytest.raises(NativeKernelError, match="compiling paged_decode.c failed: error: broken"):
        NativeDecodeKernel.build(out)
    assert list(out.iterdir()) == []  # no half-written library, no temporary left


def test_the_setting_is_checked(monkeypatch):
    with pytest.raises(
        ValueError, match="engine.decode_kernel must be one of auto, native, avx512-bf16, torch"
    ):
        resolve_decode_kernel("fast", torch.device("cpu"))
    assert resolve_decode_kernel("torch", torch.device("cpu")) is None
    with pytest.raises(ValueError, match="CPU only"):
        resolve_decode_kernel("native", torch.device("meta"))


def test_other_cpus_are_refused_with_the_reason(monkeypatch, tmp_path):
    monkeypatch.delenv("PREFIXGATE_ATTENTION_ISA", raising=False)
    if os.uname().machine == "x86_64":
        monkeypatch.setattr("engine.weight_format.cpu_flags", lambda: frozenset({"avx2", "fma"}))
        assert native_decode.build_isa() == "avx2"  # AVX2 CPUs get the AVX2 build
        with pytest.raises(NativeKernelError, match="no avx512bw, avx512f, avx512vl on this CPU"):
            NativeDecodeKernel.build(tmp_path, isa="avx512")
        monkeypatch.setattr("engine.weight_format.cpu_flags", lambda: frozenset({"sse4_2"}))
        with pytest.raises(NativeKernelError, match="no avx2, fma on this CPU"):
            NativeDecodeKernel.build(tmp_path)


def test_the_decode_kernel_names_its_build_in_the_model_id():
    ck = tiny_checkpoint()
    mc = ck.model.config
    kernel = resolve_decode_kernel("auto", torch.device("cpu"), mc.num_heads // mc.num_kv_heads, mc.head_dim)
    torch_engine = make_engine(ck, decode_kernel="torch", prefill_kernel="torch", glue_kernel="torch")
    assert torch_engine.model_id == ck.model_id  # torch's paths add nothing
    assert decode_kernel_variant(None) == ""
    if kernel is not None:
        native_engine = make_engine(ck, decode_kernel="native", prefill_kernel="torch", glue_kernel="torch")
        assert native_engine.model_id == ck.model_id + decode_kernel_variant(kernel)
    for isa, bf16, variant in (
        ("avx512", False, "/native-decode"),
        ("avx2", False, "/native-decode-avx2"),
        ("avx512-bf16", False, "/native-decode-avx512-bf16"),
        ("avx512-bf16", True, "/native-decode-bf16-dot"),  # another arithmetic than that build's fp32 decode
    ):
        fake = NativeDecodeKernel.__new__(NativeDecodeKernel)
        fake.isa, fake.bf16_decode = isa, bf16
        assert decode_kernel_variant(fake) == variant


def test_kernel_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("PREFIXGATE_KERNEL_DIR", str(tmp_path))
    assert native_decode.kernel_dir() == tmp_path
    monkeypatch.delenv("PREFIXGATE_KERNEL_DIR")
    assert native_decode.kernel_dir() == Path.home() / ".cache" / "prefixgate" / "kernels"


@needs_kernel
@pytest.mark.parametrize("kind", ["hf", "gguf"])
@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16"])
def test_engine_tokens_equal_native_and_torch_and_batched_equal_alone(kind, kv_dtype):
    # the whole engine: greedy tokens of the native decode kernel equal torch's decode paths on a tiny model
    # (prompt rows on torch's prefill in both: over a bf16 cache torch attends in bf16 and the native prefill
    # kernel in fp32, which may flip a tiny model's token), and with every native kernel, prompt rows
    # included, each prompt's tokens batched (a shared system prompt) equal the prompt alone
    ck = tiny_checkpoint(kind)
    system = random_tokens(150, 7)
    prompts = [system + random_tokens(5 + 3 * i, 20 + i) for i in range(5)]
    results = {}
    for setting in ("native", "torch"):
        engine = make_engine(ck, kv_dtype=kv_dtype, decode_kernel=setting, prefill_kernel="torch")
        assert (engine.runner.decode_kernel is not None) == (setting == "native")
        engine.generate([system], greedy(1))
        results[setting] = engine.generate(prompts, greedy(12))
    assert results["native"] == results["torch"]
    batched = make_engine(ck, kv_dtype=kv_dtype, decode_kernel="native", prefill_kernel="native")
    batched.generate([system], greedy(1))
    together = batched.generate(prompts, greedy(12))
    alone = make_engine(ck, kv_dtype=kv_dtype, decode_kernel="native", prefill_kernel="native")
    assert [alone.generate([p], greedy(12))[0] for p in prompts] == together


@needs_kernel
def test_smollm2_native_decode_batched_equals_alone_with_a_cached_system_prompt():
    # the real model (bf16 cache): greedy tokens of 6 prompts sharing a system prompt, batched after it is cached
    # (its blocks walked across the sequences), equal each prompt's alone with caching off
    ckpt = smollm2_checkpoint()
    tok = ckpt.tokenizer
    system = "You are a helpful assistant for a train company. Answer briefly and politely. " * 8
    questions = (
        "When is the first train?",
        "How much is a ticket?",
        "Can I bring a bike?",
        "Is there wifi on board?",
        "Where do I buy a pass?",
        "Are dogs allowed?",
    )
    prompts = [
        tok.render_chat([{"role": "system", "content": system}, {"role": "user", "content": q}])
        for q in questions
    ]
    n_new = 16
    refs = []
    for p in prompts:
        alone = make_engine(ckpt, kv_dtype="bfloat16", enable_prefix_caching=False, decode_kernel="native")
        refs.append(alone.generate([p], greedy(n_new))[0])
    eng = make_engine(ckpt, kv_dtype="bfloat16", decode_kernel="native")
    eng.generate([prompts[0]], greedy(2))
    assert eng.generate(prompts, greedy(n_new)) == refs


@needs_kernel
def test_generated_tokens_go_to_the_kernel_and_a_lone_prompt_token_to_the_prefill_path(kernel):
    # every generated token is attended by the kernel, blocks shared by the step's sequences walked across them;
    # a one-token query that is still a prompt token (its prompt's rest cached) takes the prefill path, like
    # every other prompt token
    from engine.attention import AttentionMetadata, plan_attention

    def plan(tables, prompt_lens=None):
        lens = [len(t) * 16 - 3 for t in tables]
        slots = torch.tensor([t[-1] * 16 + 12 for t in tables])
        meta = AttentionMetadata(
            slots, list(range(len(tables) + 1)), lens, torch.tensor(tables), 16,
            decode_kernel=kernel, prompt_lens=prompt_lens,
        )  # fmt: skip
        return plan_attention(meta, torch.device("cpu"), 64, cache_dtype=torch.bfloat16)

    shared = [[0, 1, 2, 3, 4, 10], [0, 1, 2, 3, 4, 11]]
    private = [[0, 1, 2, 3, 4, 10], [5, 6, 7, 8, 9, 11]]
    assert plan(private).decode.native is not None and plan(private).decode.native.shared_len == 0
    assert plan(shared).decode.native.shared_len == 80
    mixed = plan(shared, prompt_lens=[50, 93])  # the second one's new token is its prompt's last
    assert mixed.decode.native.lens.tolist() == [93] and len(mixed.prefills) == 1
    assert mixed.prefills[0].start == 1 and mixed.prefills[0].chunked is not None


@pytest.mark.parametrize(
    ("vendor", "isa", "flags"),
    [
        ("AuthenticAMD", "avx512", ("-DPD_ONE_SEQUENCE_SPLIT=2",)),
        ("AuthenticAMD", "avx512-bf16", ("-DPD_ONE_SEQUENCE_SPLIT=2",)),
        ("AuthenticAMD", "avx2", ()),  # the AVX2 build's own default is positions
        ("GenuineIntel", "avx512", ()),
        ("", "avx512", ()),
    ],
)
def test_the_one_sequence_split_follows_the_vendor(monkeypatch, vendor, isa, flags):
    monkeypatch.setattr("engine.weight_format.cpu_vendor", lambda: vendor)
    assert native_decode.split_flags(isa) == flags


@needs_kernel
def test_the_vendors_split_reaches_the_build_and_keeps_the_bits(monkeypatch, tmp_path):
    """Built as on an AMD CPU (positions) and as on an Intel one (heads): two AVX-512 libraries (one AVX2 library,
    whose split is the same for every vendor), and a lone sequence on 2 threads (``split="auto"``, the build's)
    gets the one-thread bits from each."""
    gen = torch.Generator().manual_seed(29)
    q, cache, tables, lens = random_case(gen, 1, 3, 3, 64, [1071], torch.bfloat16, num_blocks=80)
    builds = []
    for vendor in ("AuthenticAMD", "GenuineIntel"):
        monkeypatch.setattr("engine.weight_format.cpu_vendor", lambda vendor=vendor: vendor)
        k = NativeDecodeKernel.build(tmp_path, group=3, head_dim=64)
        builds.append(k.path)
        one = k.attend(q, cache, tables, lens, 1071, 0.125)
        assert torch.equal(k.attend(q, cache, tables, lens, 1071, 0.125, threads=2), one)
    if native_decode.build_isa() == "avx2":  # the AVX2 build has one split (positions) whatever the vendor
        assert builds[0] == builds[1]
    else:
        assert builds[0] != builds[1]
