"""The one-call layer step's checks against the Python layer loop (``engine.native_step``'s
``NativeDecodeStep.self_check``, and the tests): random small models through ``run`` / ``run_prompt`` and
through the kernels called one by one as ``engine.model.DecoderLayer.forward_glued`` calls them, compared bit for
bit (the step's output, residual and KV cache). Each function returns None when they agree, else what differed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engine.native_decode import NativeDecodeKernel
    from engine.native_glue import NativeGlueKernel
    from engine.native_linear import NativeLinearKernel
    from engine.native_step import NativeDecodeStep


def _namespace_model(gen: torch.Generator, linear, hid: int, nh: int, nkv: int, hd: int, inter: int):
    """A two-layer stand-in for ``LlamaModel`` (``SimpleNamespace``s with the attributes the step reads):
    ``linear(out_features, in_features, layer_index, name)`` makes each linear; the norms are random in [0.5,
    1.5), drawn after each layer's linears and, for the final norm, after the layers."""
    from types import SimpleNamespace

    layers = [
        SimpleNamespace(
            qkv=linear((nh + 2 * nkv) * hd, hid, i, "qkv"),
            o_proj=linear(hid, nh * hd, i, "o_proj"),
            gate_up=linear(2 * inter, hid, i, "gate_up"),
            down=linear(hid, inter, i, "down"),
            input_norm=torch.rand(hid, generator=gen) + 0.5,
            post_norm=torch.rand(hid, generator=gen) + 0.5,
        )
        for i in range(2)
    ]
    config = SimpleNamespace(
        num_heads=nh,
        num_kv_heads=nkv,
        head_dim=hd,
        intermediate_size=inter,
        hidden_size=hid,
        rms_norm_eps=1e-5,
    )
    return SimpleNamespace(layers=layers, norm=torch.rand(hid, generator=gen) + 0.5, config=config)


def check_decode_against_python(
    step: NativeDecodeStep, lin: NativeLinearKernel, glue: NativeGlueKernel, attend: NativeDecodeKernel
) -> str | None:
    """A random two-layer decode step of three sequences, then of one, through ``step.run`` (on 1, 2 and 3
    threads) and through the kernels called one by one as ``forward_glued`` calls them; None when the output,
    the residual and the KV cache are bit-identical, else what differed (``NativeDecodeStep.self_check``'s
    first part; the tests call it with the kernels they build)."""
    from types import SimpleNamespace

    from engine.decode_attention import NativeDecode
    from engine.native_linear import pack_int4, pack_int8, random_groups
    from engine.row_kernels import RowKernels

    gen = torch.Generator().manual_seed(0)
    hid, nh, nkv, hd, inter, nl, bs, nb = 64, 6, 3, 16, 96, 2, 16, 12

    def linear(n: int, k: int, bits: int):
        groups = random_groups(bits, n, k, gen)
        packed = pack_int4(groups) if bits == 4 else pack_int8(groups)
        return SimpleNamespace(native=lin, native_packed=packed, bias=None)

    model = _namespace_model(
        gen, lambda n, k, i, name: linear(n, k, 8 if name == "o_proj" and i else 4), hid, nh, nkv, hd, inter
    )
    layers = model.layers
    model._decode_step_ok = True
    cache = torch.randn(nl, 2, nb, bs, nkv, hd, generator=gen)
    # three sequences (attention split by sequences), then one (spread by the kernel: the build's split)
    for lens in ([37, 16, 5], [37]):
        t = len(lens)
        tables = torch.tensor([[0, 1, 2], [3, 4, 5], [6, 7, 8]][:t], dtype=torch.int32)
        slots = torch.tensor([int(tables[i, (n - 1) // bs]) * bs + (n - 1) % bs for i, n in enumerate(lens)])
        h0 = torch.randn(t, hid, generator=gen)
        angles = torch.rand(t, hd // 2, generator=gen) * 6
        cos_sin = torch.view_as_real(torch.polar(torch.ones(t, hd // 2), angles))

        def plan(tables=tables, lens=lens, slots=slots):
            native = NativeDecode(attend, tables, torch.tensor(lens, dtype=torch.int32), max(lens))
            decode = SimpleNamespace(rows=None, native=native)
            return SimpleNamespace(decode=decode, prefills=[], slot_mapping=slots)

        # the Python loop, kernel by kernel (forward_glued's calls)
        h_py, cache_py = h0.clone(), cache.clone()
        x = glue.rmsnorm(h_py, layers[0].input_norm, 1e-5)
        p = plan()
        for i, layer in enumerate(layers):
            nxt = layers[i + 1].input_norm if i + 1 < nl else model.norm
            qkv = lin.mm(layer.qkv.native_packed, x)
            q = glue.rope_store(qkv, cos_sin, nh, nkv, hd, cache_py[i], slots)
            a = p.decode.native.attend(q, cache_py[i], hd**-0.5).reshape(t, nh * hd)
            x = glue.rmsnorm(h_py, layer.post_norm, 1e-5, lin.mm(layer.o_proj.native_packed, a))
            act = glue.silu_mul(lin.mm(layer.gate_up.native_packed, x))
            x = glue.rmsnorm(h_py, nxt, 1e-5, lin.mm(layer.down.native_packed, act))
        # the same step in one call, on 1-3 threads
        for threads in (1, 2, 3):
            h_c, cache_c = h0.clone(), cache.clone()
            x_c = glue.rmsnorm(h_c, layers[0].input_norm, 1e-5)
            rows = RowKernels(None, torch.arange(t))
            got = step.run(model, h_c, x_c, cos_sin, plan(), cache_c, rows, glue, threads)
            if got is None:
                return "the step was not taken"
            for name, a, b in (("output", got, x), ("residual", h_c, h_py), ("KV cache", cache_c, cache_py)):
                if not torch.equal(a, b):
                    return f"{name} differs from the kernels called one by one (sequences={t}, threads={threads})"
    return None


def _random_check_model(gen: torch.Generator, amx, lin: NativeLinearKernel | None = None):
    """The self-checks' random two-layer model (a ``SimpleNamespace`` with ``LlamaModel``'s attributes: 4 query
    heads of 64 over 2 KV heads, hidden 96, intermediate 160): each linear's dense copy on ``amx`` (an
    ``AmxGemmKernel``) and, with ``lin``, random int4 groups on the native kernel too."""
    from types import SimpleNamespace

    from engine.native_linear import pack_int4, random_groups

    hid, nh, nkv, hd, inter = 96, 4, 2, 64, 160

    def linear(n: int, k: int) -> SimpleNamespace:
        weight = SimpleNamespace(dense=amx.pack(torch.randn(n, k, generator=gen) / 8), bias=None)
        if lin is not None:
            weight.native, weight.native_packed = lin, pack_int4(random_groups(4, n, k, gen))
        return weight

    model = _namespace_model(gen, lambda n, k, i, name: linear(n, k), hid, nh, nkv, hd, inter)
    model._prompt_step_ok = True
    model._decode_step_ok = lin is not None
    return model


def _first_difference(got: tuple, want: tuple) -> str | None:
    """The name of the first of the output, the residual and the KV cache whose bits differ, or None."""
    for name, a, b in zip(("output", "residual", "KV cache"), got, want, strict=True):
        if not torch.equal(a, b):
            return name
    return None


def check_prompt_against_python(
    step: NativeDecodeStep, glue: NativeGlueKernel, attend: NativeDecodeKernel
) -> str | None:
    """``run_prompt`` against the kernels called one by one as ``forward_glued`` calls them for prompt rows:
    a random two-layer model on the AMX GEMM's dense copies, chunks of 1, 20 and 37 rows over 0 and 19 cached
    positions and a step of two sequences' chunks, every layer and the first only, an fp32 cache on
    ``attend``'s prefill and, where the AMX build of the attention kernel builds, a bf16 cache on its prefill.
    None when the output, the residual and the KV cache are bit-identical (or the AMX GEMM does not build here:
    the path is then never taken), else what differed."""
    from types import SimpleNamespace

    from engine import amx_gemm, native_decode
    from engine.attention import NativePrefill
    from engine.row_kernels import RowKernels

    amx = amx_gemm._shared_kernel()
    if isinstance(amx, str):
        return None
    prefills = [(torch.float32, attend)]
    amx_attend = native_decode._shared_kernel(None, None, "amx")
    if not isinstance(amx_attend, str):
        prefills.append((torch.bfloat16, amx_attend))
    gen = torch.Generator().manual_seed(1)
    model = _random_check_model(gen, amx)
    layers, c = model.layers, model.config
    hid, nh, nkv, hd, nl, bs, nb, eps = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, 2, 16, 8, 1e-5
    ids = torch.randperm(nb, generator=gen).to(torch.int32)
    table, other = ids[:4].contiguous(), ids[4:].contiguous()  # two sequences' blocks
    # (block table, cached positions, new rows) per chunk; the last case: two sequences' chunks in one step
    cases = ([(table, 0, 1)], [(table, 0, 37)], [(table, 19, 20)], [(table, 19, 20), (other, 0, 13)])
    for cache_dtype, kernel in prefills:
        cache = torch.randn(nl, 2, nb, bs, nkv, hd, generator=gen).to(cache_dtype)
        for case in cases:
            t = sum(n for _, _, n in case)
            slots = torch.cat(
                [
                    tab.long()[pos // bs] * bs + pos % bs
                    for tab, start, n in case
                    for pos in [torch.arange(start, start + n)]
                ]
            )
            h0 = torch.randn(t, hid, generator=gen)
            angles = torch.rand(t, hd // 2, generator=gen) * 6
            cos_sin = torch.view_as_real(torch.polar(torch.ones(t, hd // 2), angles))
            rows = RowKernels(torch.arange(t), None)
            bounds = [0]
            for _, _, n in case:
                bounds.append(bounds[-1] + n)
            for count in (nl, 1):
                h_py, cache_py = h0.clone(), cache.clone()
                x = glue.rmsnorm(h_py, layers[0].input_norm, eps)
                natives = [NativePrefill(kernel, tab, start) for tab, start, _ in case]
                for i, layer in enumerate(layers[:count]):
                    nxt = layers[i + 1].input_norm if i + 1 < nl else model.norm
                    qkv = layer.qkv.dense.mm(x)
                    q = glue.rope_store(qkv, cos_sin, nh, nkv, hd, cache_py[i], slots)
                    a = torch.cat(
                        [
                            nat.attend(q[r0:r1], cache_py[i], hd**-0.5)
                            for nat, r0, r1 in zip(natives, bounds[:-1], bounds[1:], strict=True)
                        ]
                    ).reshape(t, nh * hd)
                    x = glue.rmsnorm(h_py, layer.post_norm, eps, layer.o_proj.dense.mm(a))
                    act = glue.silu_mul(layer.gate_up.dense.mm(x))
                    x = glue.rmsnorm(h_py, nxt, eps, layer.down.dense.mm(act))
                h_c, cache_c = h0.clone(), cache.clone()
                x_c = glue.rmsnorm(h_c, layers[0].input_norm, eps)
                chunks = [
                    SimpleNamespace(start=r0, end=r1, native=NativePrefill(kernel, tab, start))
                    for (tab, start, _), r0, r1 in zip(case, bounds[:-1], bounds[1:], strict=True)
                ]
                plan = SimpleNamespace(decode=None, prefills=chunks, slot_mapping=slots)
                got = step.run_prompt(model, h_c, x_c, cos_sin, plan, cache_c, rows, glue, count)
                if got is None:
                    return "the prompt step was not taken"
                name = _first_difference((got, h_c, cache_c), (x, h_py, cache_py))
                if name is not None:
                    where = (
                        f"chunks {[(start, n) for _, start, n in case]}, layers={count}, cache {cache_dtype}"
                    )
                    return f"the prompt step's {name} differs from the kernels called one by one ({where})"
    return None


def check_mixed_against_python(
    step: NativeDecodeStep, lin: NativeLinearKernel, glue: NativeGlueKernel, attend: NativeDecodeKernel
) -> str | None:
    """``run_prompt`` on a mixed step (two sequences' generated rows, then a 23-row prompt chunk over 19
    cached positions) against the kernels called one by one as ``forward_glued`` calls them: the generated
    rows on the native int4 kernel and the decode kernel, the prompt rows on the AMX GEMM and ``attend``'s
    prefill; a random two-layer model, an fp32 and a bf16 cache, every layer and the first only. None when the
    output, the residual and the KV cache are bit-identical (or the AMX GEMM does not build here), else what
    differed."""
    from types import SimpleNamespace

    from engine import amx_gemm
    from engine.attention import NativePrefill
    from engine.decode_attention import NativeDecode
    from engine.row_kernels import RowKernels

    amx = amx_gemm._shared_kernel()
    if isinstance(amx, str):
        return None
    gen = torch.Generator().manual_seed(2)
    model = _random_check_model(gen, amx, lin)
    layers, c = model.layers, model.config
    hid, nh, nkv, hd = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim
    nl, bs, nb, eps = 2, 16, 12, 1e-5
    ids = torch.randperm(nb, generator=gen).to(torch.int32)
    table, dec_tables = ids[:4].contiguous(), ids[4:12].view(2, 4).contiguous()
    lens, (start, n) = [37, 9], (19, 23)
    g, t = len(lens), len(lens) + n
    pos = torch.arange(start, start + n)
    slots = torch.cat(
        [
            torch.tensor([int(dec_tables[i, (m - 1) // bs]) * bs + (m - 1) % bs for i, m in enumerate(lens)]),
            table.long()[pos // bs] * bs + pos % bs,
        ]
    )
    angles = torch.rand(t, hd // 2, generator=gen) * 6
    cos_sin = torch.view_as_real(torch.polar(torch.ones(t, hd // 2), angles))
    rows = RowKernels(torch.arange(g, t), torch.arange(g))

    def by_rows(layer_lin, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([lin.mm(layer_lin.native_packed, x[:g]), layer_lin.dense.mm(x[g:])])

    for cache_dtype in (torch.float32, torch.bfloat16):
        cache = torch.randn(nl, 2, nb, bs, nkv, hd, generator=gen).to(cache_dtype)
        h0 = torch.randn(t, hid, generator=gen)
        for count in (nl, 1):
            decode = NativeDecode(attend, dec_tables, torch.tensor(lens, dtype=torch.int32), max(lens))
            prefill = NativePrefill(attend, table, start)
            h_py, cache_py = h0.clone(), cache.clone()
            x = glue.rmsnorm(h_py, layers[0].input_norm, eps)
            for i, layer in enumerate(layers[:count]):
                nxt = layers[i + 1].input_norm if i + 1 < nl else model.norm
                q = glue.rope_store(by_rows(layer.qkv, x), cos_sin, nh, nkv, hd, cache_py[i], slots)
                a = torch.cat(
                    [
                        decode.attend(q[:g], cache_py[i], hd**-0.5),
                        prefill.attend(q[g:], cache_py[i], hd**-0.5),
                    ]
                )
                x = glue.rmsnorm(h_py, layer.post_norm, eps, by_rows(layer.o_proj, a.reshape(t, nh * hd)))
                act = glue.silu_mul(by_rows(layer.gate_up, x))
                x = glue.rmsnorm(h_py, nxt, eps, by_rows(layer.down, act))
            h_c, cache_c = h0.clone(), cache.clone()
            x_c = glue.rmsnorm(h_c, layers[0].input_norm, eps)
            plan = SimpleNamespace(
                decode=SimpleNamespace(
                    rows=torch.arange(g),
                    native=NativeDecode(attend, dec_tables, torch.tensor(lens, dtype=torch.int32), max(lens)),
                ),
                prefills=[SimpleNamespace(start=g, end=t, native=NativePrefill(attend, table, start))],
                slot_mapping=slots,
            )
            got = step.run_prompt(model, h_c, x_c, cos_sin, plan, cache_c, rows, glue, count)
            if got is None:
                return "the mixed step was not taken"
            name = _first_difference((got, h_c, cache_c), (x, h_py, cache_py))
            if name is not None:
                return (
                    f"the mixed step's {name} differs from the kernels called one by one (layers={count}, "
                    f"cache {cache_dtype})"
                )
    return None
