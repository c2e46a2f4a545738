"""Where a decode step's time goes, and whether ``torch.compile`` pays on the parts with stable shapes.

Two measurements of SmolLM2-135M (``--weights``, default ``auto``: Q4_1 as int4), bf16 KV cache, one new token
per sequence at ``--context`` tokens of context, batch 1 and 8:

- ``--breakdown``: medians (ms per step) of the whole forward + LM head, of the step's int4 kernel calls alone
  (121 ``_weight_int4pack_mm_for_cpu`` calls on inputs of the same shapes) and of its 30 ``paged_attention``
  calls alone; ``rest`` = the difference (norms, RoPE, casts, residual adds, views: Python and dispatch).
- default: one decoder layer's two attention-free regions, eager (``engine.model.DecoderLayer``'s own code)
  against ``torch.compile`` (inductor, C++ codegen) of the same math written as plain functions with the
  weights as inputs (one graph serves all 30 layers): pre-attention (RMSNorm + QKV + RoPE) and post-attention
  (o_proj + residual + RMSNorm + gate/up + SiLU * up + down + residual). Prints the first compiled call of each
  batch size (compile time: cold, or warm from inductor's FX graph cache in ``TORCHINDUCTOR_CACHE_DIR``), the
  largest difference from eager, and per-layer ms interleaved eager/compiled.

- ``--breakdown --glue-ab``: the same rounds with a fourth contender, the whole step on the native layer-glue
  kernel (``engine.native_glue``: norms, RoPE, K/V store, residual adds, SiLU * up in C): ``full_glue``,
  ``rest_glue`` and ``glue_over_torch`` (ratios inside one run are what count on a shared machine).
- ``--attention-ab DIR``: attention inside a step (each layer's int4 calls, then its ``paged_attention``, minus
  the int4 calls alone), ``DIR``'s ``engine/attention.py`` against this checkout's, interleaved, for one
  sequence (consecutive blocks; a prefix hit whose fresh blocks lie elsewhere) and 8 (private; sharing 62
  blocks).

Compilation runs before ``--lock`` is taken; only the timed loops hold it. ``--threads 1`` times with this
thread's CPU time (``time.thread_time``), which other processes on a shared machine do not inflate.
Results and what they decided: ``docs/engine-step.md``. Run: ``python -m bench.decode_compile [--breakdown]``.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import functools
import json
import os
import statistics
import time
from collections.abc import Callable, Iterator
from inspect import signature

import torch
import torch.nn.functional as F

from engine.attention import AttentionMetadata, paged_attention, plan_attention
from engine.attention_kernels import resolve_decode_kernel
from engine.checkpoint import default_model_path, load_checkpoint
from engine.linear import Int4Weight, Int8Weight, LinearWeight
from engine.model import DecoderLayer, LlamaModel, allocate_kv_cache, apply_rope, rms_norm
from engine.native_glue import resolve_glue_kernel
from engine.rope_table import rope_rotation

BLOCK = 16


@contextlib.contextmanager
def bench_lock(path: str | None) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (None: no lock) so timed loops of several processes never overlap."""
    if path is None:
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def interleaved_ms(fns: dict[str, Callable[[], object]], rounds: int, calls: int, clock) -> dict[str, float]:
    """Median over ``rounds`` of ms per call of each of ``fns``, the functions taking turns every round, in an
    order rotated by one every round (so none always runs right after the same other)."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for f in fns.values():
        f()
    items = list(fns.items())
    for r in range(rounds):
        for name, f in items[r % len(items) :] + items[: r % len(items)]:
            t = clock()
            for _ in range(calls):
                f()
            times[name].append((clock() - t) * 1e3 / calls)
    return {name: statistics.median(v) for name, v in times.items()}


def decode_meta(
    b: int,
    context: int,
    blocks_per_seq: int,
    shared_blocks: int = 0,
    decode_kernel=None,
) -> tuple[AttentionMetadata, torch.Tensor]:
    """Metadata of one decode step of ``b`` sequences, each with ``context`` cached tokens in its own
    consecutive blocks, the first ``shared_blocks`` of them common to all (one cached system prompt: cascade
    attention); and the int64 positions ``[b]``. ``decode_kernel``: the native kernel, or None for torch's."""
    slots, qsl, tables = [], [0], []
    for i in range(b):
        base = i * blocks_per_seq
        table = list(range(shared_blocks)) + list(range(base + shared_blocks, base + blocks_per_seq))
        slots.append(table[context // BLOCK] * BLOCK + context % BLOCK)
        qsl.append(qsl[-1] + 1)
        tables.append(table)
    meta = AttentionMetadata(
        torch.tensor(slots),
        qsl,
        [context + 1] * b,
        torch.tensor(tables),
        BLOCK,
        decode_kernel=decode_kernel,
    )
    return meta, torch.full((b,), context, dtype=torch.int64)


def _int4(lin: LinearWeight) -> Int4Weight:
    """The ``Int4Weight`` running ``lin`` on torch's int4 kernel (an ``Int8Weight``'s two planes are one);
    TypeError otherwise (the compile and attention A/Bs load the model with ``linear_kernel="torch"``)."""
    inner = lin.inner if isinstance(lin, Int8Weight) else lin
    if not isinstance(inner, Int4Weight) or inner.packed is None:
        raise TypeError(f"{type(lin).__name__} is not an int4/int8 linear on torch's kernel (--weights auto)")
    return inner


def _quantized(lin: LinearWeight) -> Int4Weight | Int8Weight:
    """``lin`` if it is an int4/int8 weight-only linear (either kernel); TypeError otherwise."""
    if not isinstance(lin, Int4Weight | Int8Weight):
        raise TypeError(f"{type(lin).__name__} is not an int4/int8 weight-only linear (use --weights auto)")
    return lin


def _kernel_input(lin: Int4Weight | Int8Weight, x: torch.Tensor) -> torch.Tensor:
    """``x`` in the dtype ``lin``'s kernel takes (fp32 native, bf16 torch's; ``[x, x]`` for torch's Q8_0
    planes), so a timed loop of ``kernel_call`` times the kernel alone, as a step calls it."""
    return x.float() if lin.fp32_kernel else x.to(torch.bfloat16)


def kernel_call(lin: Int4Weight | Int8Weight, x: torch.Tensor) -> torch.Tensor:
    """The weight-only kernel of ``lin`` on ``x`` (``_kernel_input``'s dtype)."""
    if lin.fp32_kernel:
        return lin.native.mm(lin.native_packed, x)
    inner = _int4(lin)
    if isinstance(lin, Int8Weight):
        x = torch.cat([x, x], dim=-1)
    return torch._weight_int4pack_mm_for_cpu(x, inner.packed, 32, inner.scale_zero_bf16)


def breakdown(
    model: LlamaModel, context: int, rounds: int, clock, decode_kernel=None, glue=None
) -> dict[str, dict[str, float]]:
    """ms per decode step (median): ``full`` forward + logits, ``int4_only``, ``attn_only``, ``rest``, and
    ``attn_in_step``: each layer's int4 calls then its attention, as a step orders them, minus ``int4_only``.

    ``attn_only`` reads the 30 layers' contexts back to back, which on a CPU whose last-level cache holds
    them (SmolLM2 at ~1,000 tokens, bf16: 25 MB) finds them in cache; in a step ~66 MB of int4 weights stream
    between two reads of a layer's context, so it comes from memory: ``attn_in_step`` is that cost.
    ``rest = full - int4_only - attn_in_step``. Rows: ``b1``, ``b8`` (8 private contexts) and ``b8s`` (8
    contexts sharing their first ``context // 16 * 16 - 64`` tokens: cascade attention). ``decode_kernel``:
    the native decode kernel (``engine.native_decode``), or None for torch's paths. ``glue``: the native layer-glue
    kernel (``engine.native_glue``): then ``full_glue`` (the same step with it) joins the interleaved rounds, with
    ``rest_glue = full_glue - int4_only - attn_in_step`` and ``glue_over_torch = full_glue / full``."""
    c = model.config
    bps = -(-(context + 64) // BLOCK)
    kv = allocate_kv_cache(c, bps * 8, BLOCK, torch.bfloat16, "cpu").normal_()
    lins = [_quantized(lin) for L in model.layers for lin in (L.qkv, L.o_proj, L.gate_up, L.down)]
    lins.append(_quantized(model.lm_head))
    out = {}
    for name, b, shared in (("b1", 1, 0), ("b8", 8, 0), ("b8s", 8, context // BLOCK - 4)):
        meta, pos = decode_meta(b, context, bps, shared, decode_kernel)
        tok = torch.randint(100, 1000, (b,))
        xs = [_kernel_input(lin, torch.randn(b, lin.in_features)) for lin in lins]
        plan = plan_attention(meta, model.device, kv.shape[2], cache_dtype=kv.dtype)
        q = torch.randn(b, c.num_heads, c.head_dim)
        k, v = torch.randn(2, b, c.num_kv_heads, c.head_dim)

        def int4_only(xs=xs) -> None:
            for lin, x in zip(lins, xs, strict=True):
                kernel_call(lin, x)

        def attn_only(q=q, k=k, v=v, plan=plan) -> None:
            for i in range(c.num_layers):
                paged_attention(q, k, v, kv[i], plan, c.head_dim**-0.5, torch.bfloat16)

        def int4_attn(xs=xs, q=q, k=k, v=v, plan=plan) -> None:
            for i in range(c.num_layers):
                for lin, x in zip(lins[4 * i : 4 * i + 4], xs[4 * i : 4 * i + 4], strict=True):
                    kernel_call(lin, x)
                paged_attention(q, k, v, kv[i], plan, c.head_dim**-0.5, torch.bfloat16)
            kernel_call(lins[-1], xs[-1])

        fns = {
            "full": lambda tok=tok, pos=pos, meta=meta: model.compute_logits(model(tok, pos, kv, meta)),
            "int4_only": int4_only,
            "attn_only": attn_only,
            "int4_attn": int4_attn,
        }
        if glue is not None:
            fns["full_glue"] = lambda tok=tok, pos=pos, meta=meta: model.compute_logits(
                model(tok, pos, kv, meta, glue=glue)
            )
        row = interleaved_ms(fns, rounds, 1, clock)
        row["attn_in_step"] = row.pop("int4_attn") - row["int4_only"]
        row["rest"] = row["full"] - row["int4_only"] - row["attn_in_step"]
        if glue is not None:
            row["rest_glue"] = row["full_glue"] - row["int4_only"] - row["attn_in_step"]
            row["glue_over_torch"] = row["full_glue"] / row["full"]
        out[name] = row
    return out


def linear_ab(
    models: dict[str, LlamaModel], context: int, rounds: int, clock, decode_kernel=None
) -> dict[str, dict[str, float]]:
    """ms per decode step (median) of the same model loaded with each linear kernel (``models``: name ->
    model, e.g. ``torch`` / ``native``), interleaved: ``full_<name>`` (forward + logits) and ``lin_<name>``
    (the step's 121 weight-only kernel calls alone, inputs in the kernel's dtype; a dense head as it runs); rows
    ``b1`` and ``b8``
    (8 private contexts), ``b4`` too."""
    c = next(iter(models.values())).config
    bps = -(-(context + 64) // BLOCK)
    kv = allocate_kv_cache(c, bps * 8, BLOCK, torch.bfloat16, "cpu").normal_()
    out = {}
    for name, b in (("b1", 1), ("b4", 4), ("b8", 8)):
        meta, pos = decode_meta(b, context, bps, 0, decode_kernel)
        tok = torch.randint(100, 1000, (b,))
        fns = {}
        for kname, model in models.items():
            lins = [_quantized(lin) for L in model.layers for lin in (L.qkv, L.o_proj, L.gate_up, L.down)]
            head = model.lm_head  # dense fp32 on torch's side where bf16 GEMMs are slow (engine.model)
            quantized_head = isinstance(head, Int4Weight | Int8Weight)
            if quantized_head:
                lins.append(head)
            xs = [_kernel_input(lin, torch.randn(b, lin.in_features)) for lin in lins]
            hx = torch.randn(b, c.hidden_size)

            def lin_only(lins=lins, xs=xs, head=None if quantized_head else head, hx=hx) -> None:
                for lin, x in zip(lins, xs, strict=True):
                    kernel_call(lin, x)
                if head is not None:
                    head.forward(hx)

            fns[f"full_{kname}"] = lambda m=model, tok=tok, pos=pos, meta=meta: m.compute_logits(
                m(tok, pos, kv, meta)
            )
            fns[f"lin_{kname}"] = lin_only
        out[name] = interleaved_ms(fns, rounds, 1, clock)
    return out


ATTN_CASES = ("b1 consecutive", "b1 prefix hit", "b8 private", "b8 shared")


def attention_tables(case: str, context: int, bs: int = BLOCK) -> tuple[list[list[int]], list[int]]:
    """Block tables and lengths (``context + 1`` each) of ``attention_ab``'s cases: one sequence in consecutive
    blocks; one whose first 62 blocks (a cached system prompt) lie apart from its fresh ones; 8 such
    sequences with private prompts and fresh blocks interleaved as the engine hands them out; the same 8
    sharing their first 62 blocks (cascade)."""
    n = context + 1
    nb = -(-n // bs)
    head = min(62, nb - 1)
    if case == "b1 consecutive":
        return [list(range(nb))], [n]
    if case == "b1 prefix hit":
        return [list(range(head)) + list(range(8 * nb, 9 * nb - head))], [n]
    fresh = [[8 * nb + i + 8 * j for j in range(nb - head)] for i in range(8)]
    if case == "b8 private":
        return [list(range(i * head, (i + 1) * head)) + fresh[i] for i in range(8)], [n] * 8
    return [list(range(head)) + fresh[i] for i in range(8)], [n] * 8


BASE_ATTENTION_MODULES = ("block_gather", "chunked_decode", "decode_attention", "attention")
"""The attention modules of ``engine/``, in import order (a checkout before their split has only ``attention``)."""


def load_base_attention(base_dir: str):
    """``base_dir``'s ``engine/attention.py`` as module ``base_attention``, the attention modules it imports
    (``BASE_ATTENTION_MODULES`` that ``base_dir`` has) read from ``base_dir`` too, not from this checkout: each
    is loaded as ``base_<name>`` and stands in for ``engine.<name>`` only while the next ones load."""
    import importlib.util
    import sys

    names = [n for n in BASE_ATTENTION_MODULES if os.path.exists(f"{base_dir}/engine/{n}.py")]
    saved = {n: sys.modules.get(f"engine.{n}") for n in names}
    try:
        for n in names:
            spec = importlib.util.spec_from_file_location(f"base_{n}", f"{base_dir}/engine/{n}.py")
            mod = importlib.util.module_from_spec(spec)
            sys.modules[f"base_{n}"] = mod  # dataclasses look their module up
            sys.modules[f"engine.{n}"] = mod
            spec.loader.exec_module(mod)
    finally:
        for n, mod in saved.items():
            if mod is None:
                sys.modules.pop(f"engine.{n}", None)
            else:
                sys.modules[f"engine.{n}"] = mod
    return sys.modules["base_attention"]


def attention_ab(
    model: LlamaModel, base_dir: str, context: int, rounds: int, clock
) -> dict[str, dict[str, float]]:
    """ms per decode step of attention inside a step, ``base`` (``engine/attention.py`` of checkout
    ``base_dir``, ``load_base_attention``) against this checkout's, interleaved: per layer the layer's four int4
    calls (real weights, streamed from memory as in a step) then ``paged_attention``, minus the int4 calls alone
    (``none``)."""
    import engine.attention as new

    base = load_base_attention(base_dir)
    c = model.config
    nb = -(-(context + 1) // BLOCK)
    kv = allocate_kv_cache(c, 9 * nb + 8, BLOCK, torch.bfloat16, "cpu").normal_()
    lins = [[_int4(lin) for lin in (L.qkv, L.o_proj, L.gate_up, L.down)] for L in model.layers]
    out = {}
    for case in ATTN_CASES:
        tables, lens = attention_tables(case, context)
        b = len(lens)
        width = max(len(t) for t in tables)
        slots = [t[(n - 1) // BLOCK] * BLOCK + (n - 1) % BLOCK for t, n in zip(tables, lens, strict=True)]
        padded = torch.tensor([t + [0] * (width - len(t)) for t in tables])
        plans = {
            name: (
                mod,
                mod.plan_attention(
                    mod.AttentionMetadata(torch.tensor(slots), list(range(b + 1)), lens, padded, BLOCK),
                    model.device,
                    kv.shape[2],
                    # the cache's dtype, where the planner takes it (shared decode chunks are bf16-only)
                    **(
                        {"cache_dtype": kv.dtype}
                        if "cache_dtype" in signature(mod.plan_attention).parameters
                        else {}
                    ),
                ),
            )
            for name, mod in (("base", base), ("new", new))
        }
        xs = [[torch.randn(b, lin.in_features).to(torch.bfloat16) for lin in layer] for layer in lins]
        q = torch.randn(b, c.num_heads, c.head_dim)
        k, v = torch.randn(2, b, c.num_kv_heads, c.head_dim)

        def step(which: str, xs=xs, q=q, k=k, v=v, plans=plans) -> None:
            for i, layer in enumerate(lins):
                for lin, x in zip(layer, xs[i], strict=True):
                    torch._weight_int4pack_mm_for_cpu(x, lin.packed, 32, lin.scale_zero_bf16)
                if which != "none":
                    mod, plan = plans[which]
                    mod.paged_attention(q, k, v, kv[i], plan, c.head_dim**-0.5, torch.bfloat16)

        row = interleaved_ms(
            {w: functools.partial(step, w) for w in ("none", "base", "new")}, rounds, 1, clock
        )
        out[case] = {"base": row["base"] - row["none"], "new": row["new"] - row["none"], "int4": row["none"]}
        out[case]["base_over_new"] = out[case]["base"] / out[case]["new"]
    return out


def layer_regions(layer: DecoderLayer):
    """Eager and plain-function forms of a layer's pre- and post-attention regions (module docstring).

    Returns ``(pre_eager, post_eager, pre_fn, post_fn, pre_args, post_args)``; the ``_fn`` forms take the
    weights as arguments (``pre_args(h, cos, sin)``, ``post_args(h, attn)`` build them) so one compiled graph
    serves every layer."""
    c = layer.config
    nh, nkv, hd, inter, eps = c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size, c.rms_norm_eps
    qkv, o, gu, down = (_int4(lin) for lin in (layer.qkv, layer.o_proj, layer.gate_up, layer.down))

    def pre_eager(h, rotation):
        t = h.shape[0]
        x = rms_norm(h, layer.input_norm, eps)
        y = layer.qkv.forward(x).view(t, nh + 2 * nkv, hd)
        qk = apply_rope(y[:, : nh + nkv], rotation)
        return qk[:, :nh], qk[:, nh:], y[:, nh + nkv :]

    def post_eager(h, attn):
        h = h.add_(layer.o_proj.forward(attn))
        x = rms_norm(h, layer.post_norm, eps)
        g, u = layer.gate_up.forward(x).split(inter, dim=-1)
        act = F.silu(g, inplace=True).mul_(u).to(torch.bfloat16)
        return h.add_(layer.down.forward(act))

    def mm(x, p, sz):
        return torch._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), p, 32, sz)

    def pre_fn(h, norm_w, p, sz, cos, sin):
        t = h.shape[0]
        x = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * norm_w
        y = mm(x, p, sz).float().view(t, nh + 2 * nkv, hd)
        pairs = y[:, : nh + nkv].unflatten(-1, (hd // 2, 2))
        a, b = pairs[..., 0], pairs[..., 1]
        qk = torch.stack((a * cos - b * sin, b * cos + a * sin), -1).flatten(-2)
        return qk[:, :nh], qk[:, nh:], y[:, nh + nkv :]

    def post_fn(h, attn, po, szo, norm_w, pgu, szgu, pd, szd):
        h = h + mm(attn, po, szo)
        x = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * norm_w
        g, u = mm(x, pgu, szgu).float().split(inter, dim=-1)
        return h + mm(F.silu(g) * u, pd, szd)

    def pre_args(h, cos, sin):
        return (h, layer.input_norm, qkv.packed, qkv.scale_zero_bf16, cos, sin)

    def post_args(h, attn):
        w = (o.packed, o.scale_zero_bf16, layer.post_norm, gu.packed, gu.scale_zero_bf16)
        return (h, attn, *w, down.packed, down.scale_zero_bf16)

    return pre_eager, post_eager, pre_fn, post_fn, pre_args, post_args


def compile_ab(
    model: LlamaModel,
    batches: list[int],
    dynamic: bool,
    mode: str | None,
    lock: str | None,
    clock,
    timed: bool = True,
) -> dict[str, dict[str, float]]:
    """Per-layer ms of the attention-free regions, eager vs compiled, per batch size (module docstring);
    ``timed=False``: only the first compiled call (compile time) and the difference from eager."""
    layer = model.layers[0]
    pre_eager, post_eager, pre_fn, post_fn, pre_args, post_args = layer_regions(layer)
    pre_c = torch.compile(pre_fn, dynamic=dynamic, mode=mode)
    post_c = torch.compile(post_fn, dynamic=dynamic, mode=mode)
    c = model.config
    out = {}
    for b in batches:
        h = torch.randn(b, c.hidden_size)
        rot = rope_rotation(model.inv_freq, torch.full((b,), 1070))
        cos, sin = rot.real.contiguous(), rot.imag.contiguous()
        attn = torch.randn(b, c.num_heads * c.head_dim).to(torch.bfloat16)
        t = time.perf_counter()
        pre_c(*pre_args(h, cos, sin))
        post_c(*post_args(h.clone(), attn))
        first_call_s = time.perf_counter() - t
        diff = max(
            (e - g).abs().max().item()
            for e, g in zip(pre_eager(h, rot), pre_c(*pre_args(h, cos, sin)), strict=True)
        )
        diff = max(
            diff, (post_eager(h.clone(), attn) - post_c(*post_args(h.clone(), attn))).abs().max().item()
        )
        out[f"b{b}"] = {"first_call_s": first_call_s, "max_abs_diff": diff, "load1": os.getloadavg()[0]}
        if not timed:
            continue
        with bench_lock(lock):
            load = os.getloadavg()[0]
            row = interleaved_ms(
                {
                    "eager": lambda h=h, rot=rot, attn=attn: (pre_eager(h, rot), post_eager(h.clone(), attn)),
                    "compiled": lambda h=h, cos=cos, sin=sin, attn=attn: (
                        pre_c(*pre_args(h, cos, sin)),
                        post_c(*post_args(h.clone(), attn)),
                    ),
                },
                rounds=9,
                calls=100,
                clock=clock,
            )
        out[f"b{b}"] = {"first_call_s": first_call_s, "max_abs_diff": diff, "load1": load, **row}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument(
        "--breakdown", action="store_true", help="whole-step breakdown instead of the compile A/B"
    )
    ap.add_argument("--weights", default="auto")
    ap.add_argument(
        "--decode-kernel", default="auto", help="--breakdown: engine.decode_kernel (auto | native | torch)"
    )
    ap.add_argument(
        "--linear-kernel",
        default="auto",
        help="--breakdown: engine.linear_kernel (auto | native | torch); the A/Bs below use torch's",
    )
    ap.add_argument(
        "--linear-ab",
        action="store_true",
        help="whole steps and linears alone, the model on torch's int4 kernel against the native one, interleaved",
    )
    ap.add_argument(
        "--glue-ab",
        action="store_true",
        help="--breakdown: also the whole step with the native layer-glue kernel (engine.native_glue), interleaved",
    )
    ap.add_argument("--context", type=int, default=1070)
    ap.add_argument("--threads", type=int, default=None, help="torch threads; 1 = timed by thread CPU time")
    ap.add_argument("--batches", default="1,8", help="compile A/B: batch sizes, in order")
    ap.add_argument("--dynamic", action="store_true", help="compile A/B: dynamic batch dimension")
    ap.add_argument(
        "--mode", default=None, help="compile A/B: torch.compile mode (e.g. max-autotune-no-cudagraphs)"
    )
    ap.add_argument("--compile-only", action="store_true", help="compile A/B: compile time only, no timing")
    ap.add_argument("--lock", default=None, help="flock this file around timed loops (/work/wt/bench.lock)")
    ap.add_argument(
        "--attention-ab",
        default=None,
        metavar="DIR",
        help="attention inside a step, DIR's engine/attention.py against this checkout's (e.g. a git archive of main)",
    )
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    torch.set_grad_enabled(False)
    kernel_setting = args.linear_kernel if args.breakdown else "torch"
    model = load_checkpoint(default_model_path(), weights=args.weights, linear_kernel=kernel_setting).model
    if args.linear_ab:
        native = load_checkpoint(default_model_path(), weights=args.weights, linear_kernel="native").model
        with torch.inference_mode(), bench_lock(args.lock):
            load = os.getloadavg()[0]
            c = model.config
            kernel = resolve_decode_kernel(
                args.decode_kernel, model.device, c.num_heads // c.num_kv_heads, c.head_dim
            )
            res = linear_ab({"torch": model, "native": native}, args.context, 15, clock, kernel)
    elif args.attention_ab:
        with torch.inference_mode(), bench_lock(args.lock):
            load = os.getloadavg()[0]
            res = attention_ab(model, args.attention_ab, args.context, 11, clock)
    elif args.breakdown:
        with torch.inference_mode(), bench_lock(args.lock):
            load = os.getloadavg()[0]
            c = model.config
            kernel = resolve_decode_kernel(
                args.decode_kernel, model.device, c.num_heads // c.num_kv_heads, c.head_dim
            )
            glue = resolve_glue_kernel("native", model.device) if args.glue_ab else None
            res = breakdown(model, args.context, 15, clock, kernel, glue)
    else:
        load = os.getloadavg()[0]
        batches = [int(b) for b in args.batches.split(",")]
        res = compile_ab(
            model, batches, args.dynamic, args.mode, args.lock, clock, timed=not args.compile_only
        )
    for name, row in res.items():
        print(f"{name:<15}" + "  ".join(f"{k} {v:.3f}" for k, v in row.items()))
    info = {"threads": torch.get_num_threads(), "load1_start": load, "context": args.context}
    info["decode_kernel"] = args.decode_kernel
    info["linear_kernel"] = "torch vs native" if args.linear_ab else kernel_setting
    info["glue_ab"] = args.glue_ab
    info["load1_end"] = os.getloadavg()[0]
    print(json.dumps({"result": res, **info, "dynamic": args.dynamic, "mode": args.mode}))


if __name__ == "__main__":
    main()
