"""A Llama-family decoder (Llama, SmolLM, Mistral, Qwen2) whose forward pass runs over a paged KV cache.

Same math as Hugging Face ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` (RMSNorm, RoPE in the rotate-half
convention with the checkpoint's base, grouped-query attention, SiLU-gated MLP, optional q/k/v bias, tied
embeddings), rearranged for serving:

- q/k/v are one matmul and gate/up are one matmul (``engine.linear.DenseWeight.concat``); every linear layer is
  a pluggable ``engine.linear.LinearWeight``.
- q and k rows are stored in RoPE pair order (``interleave_rope_rows``) so the rotation is one complex multiply;
  the K/V cache holds keys in that order.
- a step is a flat batch of ``T`` tokens from any mix of prefill chunks and decodes; K/V go to the paged cache
  and attention reads each sequence's context from its block table (``engine.attention``).
- ``forward`` returns the final-normed hidden states; the caller turns only the rows it needs into logits
  with ``compute_logits`` (the last prompt position of a finished prefill, decode rows).

Step overhead (issue 12; ``docs/engine-step.md``, ``bench/decode_compile.py``): at batch 1 the int4 kernel calls
and the attention kernel are two thirds to three quarters of a decode step and the ~60 small ops per layer
between them (norms, RoPE, casts, residual adds, views) the rest. ``torch.compile`` (inductor, C++) of the two
attention-free regions of a layer gave bit-identical outputs but 10-28 % slower layers with two threads and
1-2 % faster steps with one, for 5-49 s of compile per batch size, so the forward stays eager.

Layer glue kernel (``engine.native_glue``, ``engine.glue_kernel``): with ``forward(..., glue=kernel)`` a layer's
elementwise work runs as four C calls instead of ~26 torch ops (``DecoderLayer.forward_glued``): the residual add
fused with the next RMSNorm (the last layer's with the final norm), RoPE of q (into its own contiguous tensor) and
k (in place) fused with the K/V store into the cache, and SiLU(gate) * up. Every row of every step takes that path
when it is on, so batched == alone and cache on == off hold as with torch's ops; the RMSNorm's sum and SiLU's
exponential round a few ulp apart from torch's, so the engine names it in ``model_id``. Measured in
``docs/engine-step.md`` ("Layer glue kernel").

Weights come in as a dict of Hugging Face names (``model.layers.{i}.self_attn.q_proj.weight`` ...), the layout
``engine.gguf_loader`` and ``engine.hf_loader`` both produce.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from engine.arch_config import ArchConfig
from engine.attention import AttentionMetadata, AttentionPlan, paged_attention, plan_attention
from engine.errors import UnsupportedModelError
from engine.linear import (
    GroupedEmbedding,
    Int4Weight,
    Int8Weight,
    LinearWeight,
    bf16_in_out,
    dense_bf16_in_out,
)
from engine.native_glue import NativeGlueKernel
from engine.native_step import NativeDecodeStep
from engine.output_rows import OutputStep, output_step
from engine.quantized import GGUFBlocks
from engine.rope_table import RopeTable
from engine.row_kernels import RowKernels, forward_rows
from engine.weight_format import WeightPlan


def allocate_kv_cache(
    config: ArchConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device | str
) -> torch.Tensor:
    """The block pool's KV tensor, zero-filled.

    Returns:
        ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`` of ``dtype`` (index 0 = K, 1 = V);
        ``num_blocks * block_size * config.kv_bytes_per_token(dtype bytes)`` bytes.
    """
    if num_blocks <= 0 or block_size <= 0:
        raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be positive")
    shape = (config.num_layers, 2, num_blocks, block_size, config.num_kv_heads, config.head_dim)
    return torch.zeros(shape, dtype=dtype, device=device)


def device_memory_bytes(device: torch.device | str) -> int | None:
    """Memory of ``device`` in bytes: a CUDA device's total memory, or the machine's physical memory
    (``sysconf``: pages x page size) for the CPU; None where neither can be read."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def check_kv_cache_fits(
    config: ArchConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device | str
) -> None:
    """Refuse a block pool larger than the memory of ``device`` before anything is allocated (a trial:
    ``num_blocks: 10000000`` died in torch's allocator after the model loaded, with a traceback naming no
    setting, and ``1000000000000`` grew the process without bound while building the pool's block list).

    Raises:
        ValueError: ``engine.num_blocks: ...``, naming the bytes the pool needs and the device's memory.
    """
    need = num_blocks * block_size * config.kv_bytes_per_token(torch.empty((), dtype=dtype).element_size())
    have = device_memory_bytes(device)
    if have is not None and need > have:
        gib = 1 << 30
        raise ValueError(
            f"engine.num_blocks: {num_blocks} blocks of {block_size} tokens need {need / gib:,.1f} GiB of KV cache "
            f"({dtype}), more than this machine's {have / gib:,.1f} GiB of {torch.device(device).type} memory"
        )


def rope_inv_freq(config: ArchConfig) -> torch.Tensor:
    """RoPE inverse frequencies ``[head_dim / 2]`` fp32: ``1 / theta ** (2i / head_dim)`` (Su et al. 2021),
    computed exactly as Hugging Face's default rope init does."""
    d = config.head_dim
    return 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))


def interleave_rope_rows(t: torch.Tensor, num_heads: int, head_dim: int) -> torch.Tensor:
    """Reorder a q or k projection (weight ``[heads * head_dim, in]`` or bias ``[heads * head_dim]``) so that
    each head's output dims come as pairs ``(d, d + head_dim/2)``: ``0, h/2, 1, h/2 + 1, ...``.

    Hugging Face's rotate-half RoPE rotates dim ``d`` with dim ``d + head_dim/2``; once they are adjacent the
    rotation is one complex multiply (``apply_rope``). q and k get the same order, so every q.k dot product,
    and so attention, is unchanged (up to fp32 summation order); V and ``o_proj`` are untouched.
    """
    if isinstance(t, GGUFBlocks):  # quantized rows: permute whole rows of blocks
        return t.rows(interleave_rope_rows(torch.arange(t.shape[0]), num_heads, head_dim).numpy())
    rest = t.shape[1:]
    return t.reshape(num_heads, 2, head_dim // 2, *rest).transpose(1, 2).reshape(num_heads * head_dim, *rest)


def apply_rope(x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """RoPE (Su et al. 2021) of ``x`` ``[T, heads, head_dim]`` whose dims are in ``interleave_rope_rows`` order:
    each pair ``(x[2j], x[2j+1])`` = ``(x_d, x_{d + head_dim/2})`` of the rotate-half convention is read as one
    complex number and multiplied by ``rotation`` (``rope_rotation``, ``[T, 1, head_dim / 2]``):
    ``(x_d cos - x_{d'} sin, x_{d'} cos + x_d sin)``, which is Hugging Face's ``x * cos + rotate_half(x) * sin``.
    Computed in fp32; returns a new tensor of ``x``'s dtype and shape."""
    t, h, d = x.shape
    xf = x if x.dtype == torch.float32 else x.float()
    out = torch.view_as_real(torch.view_as_complex(xf.view(t, h, d // 2, 2)) * rotation).view(t, h, d)
    return out if out.dtype == x.dtype else out.to(x.dtype)


def _mean_sq(x: torch.Tensor) -> torch.Tensor:
    """``x.pow(2).mean(-1, keepdim=True)`` of fp32 ``x``; on CPU as a sum then a division by the row length,
    which is exactly how torch's CPU ``mean`` computes it (bit-identical), minus the ``mean`` dispatch."""
    if x.device.type != "cpu":
        return x.pow(2).mean(-1, keepdim=True)
    return x.pow(2).sum(-1, keepdim=True).div_(x.shape[-1])


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm (Zhang & Sennrich 2019): ``x / sqrt(mean(x^2) + eps) * weight``, statistics in fp32 as Hugging
    Face computes them. Written out rather than ``F.rms_norm``: on CPU (torch 2.13) the fused kernel took
    1.46 ms for 1,082 x 576 fp32 rows where these four ops take 0.21 ms, with bit-identical results (and at
    one decode row it is no single kernel either: ``_fused_rms_norm`` runs pow/mean/rsqrt inside, 26 us
    against ~12 us here)."""
    if x.dtype == torch.float32:
        return (x * _mean_sq(x).add_(eps).rsqrt_()).mul_(weight)
    xf = x.float()
    xf = xf * torch.rsqrt(_mean_sq(xf) + eps)
    return weight * xf.to(x.dtype)


RESCORE_TOP_K = 32  # logits recomputed exactly per row when the head's kernel rounds (``compute_logits``)


class DecoderLayer(nn.Module):
    """One pre-norm decoder layer: ``h += o(attn(norm(h)))``; ``h += down(silu(gate) * up)(norm(h))``."""

    def __init__(self, config: ArchConfig, w: dict[str, torch.Tensor], prefix: str, plan: WeightPlan) -> None:
        super().__init__()
        self.config = config
        a, m = prefix + "self_attn.", prefix + "mlp."
        self.input_norm = nn.Parameter(w[prefix + "input_layernorm.weight"], requires_grad=False)
        self.post_norm = nn.Parameter(w[prefix + "post_attention_layernorm.weight"], requires_grad=False)

        def rope_order(name: str, heads: int) -> torch.Tensor | None:
            t = w.get(name)
            return None if t is None else interleave_rope_rows(t, heads, config.head_dim)

        self.qkv: LinearWeight = plan.build_linear(
            [
                rope_order(a + "q_proj.weight", config.num_heads),
                rope_order(a + "k_proj.weight", config.num_kv_heads),
                w[a + "v_proj.weight"],
            ],
            [
                rope_order(a + "q_proj.bias", config.num_heads),
                rope_order(a + "k_proj.bias", config.num_kv_heads),
                w.get(a + "v_proj.bias"),
            ],
            a + "qkv",
        )
        self.o_proj: LinearWeight = plan.build_linear(
            [w[a + "o_proj.weight"]], [w.get(a + "o_proj.bias")], a + "o_proj"
        )
        self.gate_up: LinearWeight = plan.build_linear(
            [w[m + "gate_proj.weight"], w[m + "up_proj.weight"]], None, m + "gate_up"
        )
        self.down: LinearWeight = plan.build_linear([w[m + "down_proj.weight"]], None, m + "down_proj")
        # o_proj / down round their input to bf16 and return their kernel's bf16 output: the attention output
        # and the MLP activation go in as bf16 and the bf16 results are added to the fp32 residual directly
        # (bit-identical to widening them to fp32 first; 4 fewer dtype copies per layer and step)
        self.o_bf16 = torch.bfloat16 if bf16_in_out(self.o_proj) else None
        self.down_bf16 = bf16_in_out(self.down)
        # with the glue kernel, gate/up's input is written in bf16 where gate/up rounds it to bf16 anyway (its bf16
        # output then holds the values its fp32 output would: silu * up reads either)
        self.gate_up_in = torch.bfloat16 if bf16_in_out(self.gate_up) else torch.float32
        self.act_dtype = torch.bfloat16 if self.down_bf16 else torch.float32
        # a step whose rows all run the dense copies (prompt rows only, ``RowKernels.kernel`` None) keeps the
        # attention output and the MLP's input and activation in bf16 when o/gate_up/down all round their input
        # to bf16 and return their bf16 result there (``dense_bf16_in_out``): the same bits as the fp32 round trip
        self.prompt_bf16 = all(dense_bf16_in_out(lin) for lin in (self.o_proj, self.gate_up, self.down))

    def forward(
        self,
        h: torch.Tensor,
        rotation: torch.Tensor,
        layer_cache: torch.Tensor,
        plan: AttentionPlan,
        rows: RowKernels | None = None,
    ) -> torch.Tensor:
        c = self.config
        t = h.shape[0]
        x = rms_norm(h, self.input_norm, c.rms_norm_eps)
        qkv = forward_rows(self.qkv, x, rows).view(t, c.num_heads + 2 * c.num_kv_heads, c.head_dim)
        qk = apply_rope(qkv[:, : c.num_heads + c.num_kv_heads], rotation)
        q, k = qk[:, : c.num_heads], qk[:, c.num_heads :]
        v = qkv[:, c.num_heads + c.num_kv_heads :]
        attn = paged_attention(q, k, v, layer_cache, plan, c.head_dim**-0.5, self.o_bf16)
        h = h.add_(
            forward_rows(self.o_proj, attn, rows)
        )  # h is this step's own buffer: residual adds in place
        x = rms_norm(h, self.post_norm, c.rms_norm_eps)
        gu = forward_rows(self.gate_up, x, rows)
        g, u = gu.split(c.intermediate_size, dim=-1)
        act = F.silu(g, inplace=True).mul_(u)  # in gu's storage: no MLP-sized buffer allocated
        if self.down_bf16:
            act = act.to(torch.bfloat16)
        return h.add_(forward_rows(self.down, act, rows))

    def forward_glued(
        self,
        h: torch.Tensor,
        x: torch.Tensor,
        cos_sin: torch.Tensor,
        layer_cache: torch.Tensor,
        plan: AttentionPlan,
        rows: RowKernels | None,
        glue: NativeGlueKernel,
        next_norm: torch.Tensor,
        out: tuple[OutputStep, AttentionPlan] | None = None,
    ) -> torch.Tensor:
        """The layer with its elementwise work on the glue kernel (``engine.native_glue``): ``x`` (fp32 ``[T,
        hidden]``, ``h`` normed by ``input_norm``) in; ``h`` updated in place; returns ``norm(h) * next_norm``
        in fp32 (the next layer's ``x``, or the model's output after the last layer). ``cos_sin``: fp32 ``[T,
        head_dim / 2, 2]``; K/V are stored by the kernel (fp32 and bf16 caches), not by ``paged_attention``.

        ``out``: the output rows' step and its attention plan (``engine.output_rows``; the last layer, K/V
        stored by the kernel): every row's K/V is stored, then only the output rows go on (``h`` is then not
        updated) and the result is ``[N, hidden]``, those rows in ``out``'s order, the same bits as theirs in the
        whole step."""
        c = self.config
        t = h.shape[0]
        eps = c.rms_norm_eps
        qkv = forward_rows(self.qkv, x, rows)
        nh, nkv, hd = c.num_heads, c.num_kv_heads, c.head_dim
        stored = layer_cache.dtype in (torch.float32, torch.bfloat16)
        cache, slots = (layer_cache, plan.slot_mapping) if stored else (None, None)
        q = glue.rope_store(qkv, cos_sin, nh, nkv, hd, cache, slots)  # q: its own contiguous [T, H, D]
        kv = qkv.view(t, nh + 2 * nkv, hd)[:, nh:]
        if out is not None:
            if not stored:
                raise ValueError(
                    "the output rows' step needs K/V stored by the glue kernel (fp32 / bf16 cache)"
                )
            step, plan = out
            if step.rows.numel() == 0:
                return x.new_empty(0, x.shape[1])
            q, kv, h, rows = q[step.rows], kv[step.rows], h[step.rows], step.row_kernels
        k, v = kv[:, :nkv], kv[:, nkv:]
        bf16 = self.prompt_bf16 and rows is not None and rows.kernel is None
        o_dtype, gate_up_in, act_dtype = (
            (torch.bfloat16,) * 3 if bf16 else (self.o_bf16, self.gate_up_in, self.act_dtype)
        )
        attn = paged_attention(q, k, v, layer_cache, plan, c.head_dim**-0.5, o_dtype, kv_stored=stored)
        x = glue.rmsnorm(h, self.post_norm, eps, forward_rows(self.o_proj, attn, rows), gate_up_in)
        act = glue.silu_mul(forward_rows(self.gate_up, x, rows), act_dtype)
        return glue.rmsnorm(h, next_norm, eps, forward_rows(self.down, act, rows))


class LlamaModel(nn.Module):
    """Llama-family decoder over a paged KV cache.

    Args:
        config: the model's shape.
        weights: Hugging Face-named tensors (``model.embed_tokens.weight``, ``model.layers.{i}...``,
            ``model.norm.weight``, ``lm_head.weight`` unless tied), already in the compute dtype and on the
            device, or ``engine.quantized.GGUFBlocks`` for quantized 2-D tensors. Norms are used as given;
            linear weights and the embedding are built by ``plan`` (``engine.weight_format``).
        plan: the weight formats; None = dense weights in the embedding's dtype (``float32`` plan).

    Raises:
        UnsupportedModelError: a weight is missing or has the wrong shape (names it).
    """

    def __init__(
        self, config: ArchConfig, weights: dict[str, torch.Tensor], plan: WeightPlan | None = None
    ) -> None:
        super().__init__()
        check_weights(config, weights)
        self.config = config
        norm = weights["model.norm.weight"]
        if plan is None:
            plan = WeightPlan("float32", norm.device, None, norm.dtype)
        self.plan = plan
        embed = weights["model.embed_tokens.weight"]
        self.embed = plan.build_embedding(
            embed
        )  # a tensor [vocab, hidden], or a module decoding rows on lookup
        self.layers = nn.ModuleList(
            DecoderLayer(config, weights, f"model.layers.{i}.", plan) for i in range(config.num_layers)
        )
        self.norm = nn.Parameter(norm, requires_grad=False)
        head = embed if config.tie_word_embeddings else weights["lm_head.weight"]
        # logits rows are few: no dense copy. Where bf16 GEMMs are slow (AVX2 CPUs) torch's int4 kernel is too:
        # a Q8_0 head on its two 4-bit planes took 14.5 ms per row against 7 ms for the exact fp32 weight
        # (SmolLM2, one thread, AVX2 EPYC), so the head runs dense fp32 there, unless the native kernel serves
        # it (its AVX2 build reads the head's own 8-bit codes: a quarter of the fp32 weight's bytes).
        native_head = plan.linear_kernel is not None and plan.kind_for([head], "lm_head") in ("int4", "int8")
        head_kind = "float32" if plan.dense_dtype == torch.float32 and not native_head else plan.weights
        head_plan = WeightPlan(head_kind, plan.device, None, plan.dtype, linear_kernel=plan.linear_kernel)
        self.lm_head: LinearWeight = head_plan.build_linear([head], None, "lm_head")
        # torch's int4 kernel returns bf16 logits (resolution 1/8 at |logit| ~ 20): the top candidates are
        # rescored from the exact fp32 rows of the head (``compute_logits``); the native kernel's are fp32
        self.head_rows: nn.Module | None = None
        if isinstance(self.lm_head, Int4Weight | Int8Weight) and not self.lm_head.fp32_kernel:
            self.head_rows = self.embed if config.tie_word_embeddings else plan.build_embedding(head)
            if not isinstance(self.head_rows, GroupedEmbedding):
                self.head_rows = None
        self.register_buffer("inv_freq", rope_inv_freq(config).to(norm.device), persistent=False)
        self.rope = RopeTable(self.inv_freq)

    @property
    def dtype(self) -> torch.dtype:
        """Dtype of activations between layers (and of the KV cache by default)."""
        return self.norm.dtype

    @property
    def device(self) -> torch.device:
        return self.norm.device

    @property
    def weight_formats(self) -> str:
        """The classes holding the embedding and linear weights, e.g. ``"GroupedEmbedding,Int4Weight,Int8Weight"``
        (``"DenseWeight,Tensor"`` for the fp32 reference)."""
        linears = [
            lin for layer in self.layers for lin in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)
        ]
        return ",".join(sorted({type(m).__name__ for m in [self.embed, self.lm_head, *linears]}))

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        """Embedding rows ``[T, hidden]`` of int64 ``ids`` ``[T]`` in the model dtype."""
        if isinstance(self.embed, torch.Tensor):
            return F.embedding(ids, self.embed)
        return self.embed(ids).to(self.dtype)

    @property
    def weight_nbytes(self) -> int:
        """Bytes of linear-layer weights one decode step reads (every layer and the LM head; one copy each)."""
        n = sum(
            layer.qkv.nbytes + layer.o_proj.nbytes + layer.gate_up.nbytes + layer.down.nbytes
            for layer in self.layers
        )
        return n + self.lm_head.nbytes

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        shared_prefix: bool = True,
        row_kernels: RowKernels | None = None,
        glue: NativeGlueKernel | None = None,
        decode_step: NativeDecodeStep | None = None,
        output_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One step over a flat batch of ``T`` tokens.

        Args:
            input_ids: int64 ``[T]`` token ids, sequences laid out as ``meta.query_start_loc`` says.
            positions: int64 ``[T]`` position of each token in its sequence.
            kv_cache: from ``allocate_kv_cache``; this step's K/V are written at ``meta.slot_mapping``.
            meta: the step's attention metadata.
            shared_prefix: allow cascade attention over blocks shared by decode sequences
                (``engine.decode_attention.SharedPrefix``).
            row_kernels: which rows the quantized linears run on their dense copy and which on the int4 kernel
                (``engine.row_kernels``); None = by the step's row count (``dense_min_rows``).
            glue: the native layer-glue kernel (``engine.native_glue``; a float32 model on CPU) for every row's
                norms, RoPE, K/V store, residual adds and SiLU * up, or None for torch's ops.
            decode_step: with ``glue``, the one-call layer step (``engine.native_step``): a decode-only step it
                can take runs every layer in one C call, and a step of prompt rows on the AMX dense copies
                every layer but a last one that runs for the output rows alone; the same bits as the layer
                loop.
            output_rows: int64 ``[N]`` the rows whose hidden states are returned (the LM head's rows), or None
                (all). With the glue kernel and a fp32 / bf16 cache the last layer runs only for them after
                storing every row's K/V (``engine.output_rows``); their results are the same bits either way.

        Returns:
            ``[T, hidden_size]`` (``[N, hidden_size]`` with ``output_rows``) final-normed hidden states in the
            model dtype.

        Raises:
            ValueError: inconsistent metadata (see ``engine.attention.plan_attention``).
        """
        if input_ids.shape != positions.shape or input_ids.dim() != 1:
            raise ValueError(
                f"input_ids {tuple(input_ids.shape)} and positions {tuple(positions.shape)} must be [T]"
            )
        dev = self.device
        plan = plan_attention(meta, dev, kv_cache.shape[2], shared_prefix, kv_cache.dtype)
        if self.rope.inv_freq is not self.inv_freq:  # the module was moved: a table on the new device
            self.rope = RopeTable(self.inv_freq)
        rotation = self.rope.rotations(positions)
        h = self.embed_tokens(input_ids.to(dev))
        if glue is not None:
            eps = self.config.rms_norm_eps
            cos_sin = torch.view_as_real(rotation).view(h.shape[0], -1, 2)
            x = glue.rmsnorm(h, self.layers[0].input_norm, eps)
            if decode_step is not None:
                out = decode_step.run(self, h, x, cos_sin, plan, kv_cache, row_kernels, glue)
                if out is not None:
                    return out if output_rows is None else out[output_rows]
            tail = None  # the last layer's step for the output rows alone (engine.output_rows), if it can run
            if output_rows is not None and kv_cache.dtype in (torch.float32, torch.bfloat16):
                step = output_step(meta, row_kernels, output_rows)
                if step is not None:
                    tail = (
                        step,
                        plan_attention(step.meta, dev, kv_cache.shape[2], shared_prefix, kv_cache.dtype),
                    )
            first = 0  # layers before it ran in one call (prompt chunks on the AMX dense copies)
            if decode_step is not None:
                n = len(self.layers) - (tail is not None)
                done = decode_step.run_prompt(self, h, x, cos_sin, plan, kv_cache, row_kernels, glue, n)
                if done is not None:
                    x, first = done, n
            for i in range(first, len(self.layers)):
                layer, last = self.layers[i], i + 1 == len(self.layers)
                nxt = self.norm if last else self.layers[i + 1].input_norm
                x = layer.forward_glued(
                    h, x, cos_sin, kv_cache[i], plan, row_kernels, glue, nxt, tail if last else None
                )
            return x if output_rows is None or tail is not None else x[output_rows]
        for i, layer in enumerate(self.layers):
            h = layer(h, rotation, kv_cache[i], plan, row_kernels)
        h = h if output_rows is None else h[output_rows]
        return rms_norm(h, self.norm, self.config.rms_norm_eps)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits ``[N, vocab_size]`` float32 of hidden rows ``[N, hidden_size]`` (pass only the rows needed).

        With a quantized head (``Int4Weight`` / ``Int8Weight``) on the native kernel (``engine.native_linear``) the
        logits are fp32 of fp32 activations and exact scales: an fp32 product of the dequantized head up to
        summation order, nothing to rescore. On torch's int4 kernel it takes bf16 activations and
        returns bf16 logits: rounded to 8 significant bits, two candidates 0.1 apart at a logit of 20 can swap.
        The ``RESCORE_TOP_K`` largest logits of each row are therefore recomputed in fp32 from the head's exact
        rows (``GroupedEmbedding``, decoded from the same blocks, bit-exact) against the fp32 hidden state, so
        greedy decoding picks the token the fp32 reference of the same weights would pick unless the true
        maximum lies outside the kernel's top ``RESCORE_TOP_K`` (its logit would have to be off by more than
        the gap to the 32nd candidate). The other logits keep the kernel's bf16 values.
        """
        logits = self.lm_head.forward(hidden).float()
        if self.head_rows is None or hidden.shape[0] == 0:
            return logits
        k = min(RESCORE_TOP_K, logits.shape[1])
        top = logits.topk(k, dim=-1).indices  # [N, k]
        rows = self.head_rows(top.reshape(-1)).view(top.shape[0], k, -1)  # [N, k, hidden] fp32, exact
        # a product and a sum per row, not ``bmm``: its GEMV for one row rounds otherwise than its batched GEMM
        exact = rows.mul_(hidden.float().unsqueeze(1)).sum(-1)  # [N, k]
        return logits.scatter_(1, top, exact)


def check_weights(config: ArchConfig, w: dict[str, torch.Tensor]) -> None:
    """Raise ``UnsupportedModelError`` naming the first missing or mis-shaped weight."""
    c = config
    expect: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (c.vocab_size, c.hidden_size),
        "model.norm.weight": (c.hidden_size,),
    }
    if not c.tie_word_embeddings:
        expect["lm_head.weight"] = (c.vocab_size, c.hidden_size)
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        expect |= {
            p + "input_layernorm.weight": (c.hidden_size,),
            p + "post_attention_layernorm.weight": (c.hidden_size,),
            p + "self_attn.q_proj.weight": (c.q_size, c.hidden_size),
            p + "self_attn.k_proj.weight": (c.kv_size, c.hidden_size),
            p + "self_attn.v_proj.weight": (c.kv_size, c.hidden_size),
            p + "self_attn.o_proj.weight": (c.hidden_size, c.q_size),
            p + "mlp.gate_proj.weight": (c.intermediate_size, c.hidden_size),
            p + "mlp.up_proj.weight": (c.intermediate_size, c.hidden_size),
            p + "mlp.down_proj.weight": (c.hidden_size, c.intermediate_size),
        }
        if c.attention_bias:
            expect |= {
                p + "self_attn.q_proj.bias": (c.q_size,),
                p + "self_attn.k_proj.bias": (c.kv_size,),
                p + "self_attn.v_proj.bias": (c.kv_size,),
            }
    for name, shape in expect.items():
        if name not in w:
            raise UnsupportedModelError(f"checkpoint has no tensor {name!r} (architecture {c.architecture})")
        if tuple(w[name].shape) != shape:
            raise UnsupportedModelError(f"tensor {name!r} has shape {tuple(w[name].shape)}, expected {shape}")
