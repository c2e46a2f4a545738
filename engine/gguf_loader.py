"""Load a Llama-family decoder from a GGUF file (llama.cpp's format, read with the ``gguf`` package).

Format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md. The config comes from the
``{arch}.*`` metadata keys, the tensors are dequantized to float (F32, F16, BF16, Q8_0, Q4_0, Q4_1 via
``gguf.quants.dequantize``) and renamed to Hugging Face names, and llama.cpp's Q/K row permutation is undone
so the weights are in the Hugging Face rotate-half layout.

llama.cpp's ``convert_hf_to_gguf.py`` permutes the rows of ``q_proj``/``k_proj`` of the ``llama``
architecture (its RoPE rotates adjacent pairs, HF's rotates halves)::

    w.reshape(n_head, 2, rows // n_head // 2, cols).swapaxes(1, 2).reshape(rows, cols)

with ``n_head = head_count`` for Q and ``head_count_kv`` for K; ``unpermute`` is its inverse. ``qwen2`` uses
NEOX-style RoPE in llama.cpp and is stored unpermuted.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from engine.arch_config import ArchConfig
from engine.errors import UnsupportedModelError
from engine.quantized import BLOCK_BYTES, GGUFBlocks

SUPPORTED_ARCHITECTURES = ("llama", "qwen2")
SUPPORTED_TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(.+)$")


@dataclass
class GGUFCheckpoint:
    """What a GGUF file holds: config, HF-named float tensors, and its metadata (for the tokenizer)."""

    config: ArchConfig
    weights: dict[str, torch.Tensor]
    metadata: dict[str, object]


def open_gguf(path: str | Path):
    """A ``gguf.GGUFReader`` over ``path``.

    Raises:
        UnsupportedModelError: the file is missing or is not a GGUF file the reader can parse.
    """
    import gguf

    path = Path(path)
    if not path.is_file():
        raise UnsupportedModelError(f"no such GGUF file: {path}")
    try:
        return gguf.GGUFReader(str(path))
    except Exception as e:  # the reader raises ValueError/KeyError/struct errors on garbage
        raise UnsupportedModelError(f"{path} is not a readable GGUF file: {type(e).__name__}: {e}") from e


def read_metadata(reader, skip_arrays: bool = False) -> dict[str, object]:
    """Every metadata key -> Python value (strings, numbers, lists). ``skip_arrays`` leaves big arrays out."""
    import gguf

    out: dict[str, object] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        if skip_arrays and field.types and field.types[0] == gguf.GGUFValueType.ARRAY:
            continue
        out[key] = field.contents()
    return out


def config_from_metadata(meta: dict[str, object], tensor_names: set[str]) -> ArchConfig:
    """``ArchConfig`` from GGUF metadata (``{arch}.block_count`` ...) and the tensor names present.

    Raises:
        UnsupportedModelError: an architecture other than llama/qwen2, rope scaling, partial rotary, or a
            missing key (each named).
    """
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"GGUF architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )

    def key(name: str, default=None):
        value = meta.get(f"{arch}.{name}", default)
        if value is None:
            raise UnsupportedModelError(f"GGUF metadata has no {arch}.{name}")
        return value

    scaling = meta.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        raise UnsupportedModelError(f"GGUF rope scaling type {scaling!r} is not supported")
    if "rope_freqs.weight" in tensor_names:
        raise UnsupportedModelError(
            "GGUF tensor 'rope_freqs.weight' (llama3-style rope scaling) is not supported"
        )
    hidden = int(key("embedding_length"))
    heads = int(key("attention.head_count"))
    head_dim = int(meta.get(f"{arch}.attention.key_length", hidden // heads))
    rot = int(meta.get(f"{arch}.rope.dimension_count", head_dim))
    if rot != head_dim:
        raise UnsupportedModelError(
            f"partial rotary embeddings (rope.dimension_count={rot}, head_dim={head_dim})"
        )
    vocab = meta.get(f"{arch}.vocab_size")
    if vocab is None:
        vocab = len(meta.get("tokenizer.ggml.tokens") or [])
    eos = [
        meta.get(k)
        for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
    ]
    bos = meta.get("tokenizer.ggml.bos_token_id")
    return ArchConfig(
        architecture=str(arch),
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_layers=int(key("block_count")),
        num_heads=heads,
        num_kv_heads=int(meta.get(f"{arch}.attention.head_count_kv", heads)),
        head_dim=head_dim,
        rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
        max_position_embeddings=int(key("context_length")),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos if e is not None)),
    )


def hf_name(gguf_name: str) -> str:
    """Hugging Face name of a GGUF tensor name (``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``).

    Raises:
        UnsupportedModelError: a tensor this loader does not know.
    """
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.match(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
    raise UnsupportedModelError(f"GGUF tensor {gguf_name!r} is not part of a supported Llama-family model")


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's Q/K permutation (module docstring): rows back to Hugging Face order."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def dequantize_tensor(t) -> np.ndarray:
    """float32 array in numpy (row-major, HF) shape of one ``gguf.ReaderTensor``.

    Raises:
        UnsupportedModelError: a tensor type other than ``SUPPORTED_TENSOR_TYPES`` (named).
    """
    from gguf.quants import dequantize

    qtype = t.tensor_type
    if qtype.name not in SUPPORTED_TENSOR_TYPES:
        raise UnsupportedModelError(
            f"GGUF tensor {t.name!r} has type {qtype.name}; supported: {', '.join(SUPPORTED_TENSOR_TYPES)}"
        )
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))
    return np.asarray(dequantize(t.data, qtype), dtype=np.float32).reshape(shape)


def load_gguf(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    keep_blocks: bool = False,
) -> GGUFCheckpoint:
    """Read config, metadata and all weights of a GGUF file, dequantized to ``dtype`` on ``device``.

    Args:
        keep_blocks: keep Q4_0/Q4_1/Q8_0 tensors as ``engine.quantized.GGUFBlocks`` (the file's bytes, rows
            unpermuted like the float tensors) instead of dequantizing them, for the int4/int8 weight formats;
            BF16 tensors then stay bf16.

    Returns:
        ``GGUFCheckpoint`` with Hugging Face-named tensors (Q/K unpermuted for ``llama``).

    Raises:
        UnsupportedModelError: unreadable file, unsupported architecture, tensor type or tensor name.
    """
    reader = open_gguf(path)
    meta = read_metadata(reader)
    names = {t.name for t in reader.tensors}
    config = config_from_metadata(meta, names)
    for t in reader.tensors:  # fail fast, before the slow part, on anything we cannot load
        hf_name(t.name)
        if t.tensor_type.name not in SUPPORTED_TENSOR_TYPES:
            dequantize_tensor(t)
    weights: dict[str, torch.Tensor] = {}
    # disable=None: no bar where stderr is not a terminal (a log file would get its \r glued to the next record)
    for t in tqdm(
        reader.tensors, desc=f"loading {Path(path).name}", unit="tensor", leave=False, disable=None
    ):
        name = hf_name(t.name)
        qname = t.tensor_type.name
        if keep_blocks and qname in BLOCK_BYTES and len(t.shape) == 2:
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))
            raw = np.asarray(t.data, dtype=np.uint8).reshape(shape[0], -1)
            if config.architecture == "llama" and t.name.endswith("attn_q.weight"):
                raw = unpermute(raw, config.num_heads)
            elif config.architecture == "llama" and t.name.endswith("attn_k.weight"):
                raw = unpermute(raw, config.num_kv_heads)
            weights[name] = GGUFBlocks(qname, np.array(raw, order="C", copy=True), shape[1])
            continue
        arr = dequantize_tensor(t)
        if config.architecture == "llama":
            if t.name.endswith(("attn_q.weight", "attn_q.bias")):
                arr = unpermute(arr, config.num_heads)
            elif t.name.endswith(("attn_k.weight", "attn_k.bias")):
                arr = unpermute(arr, config.num_kv_heads)
        if not (arr.flags.writeable and arr.flags.c_contiguous):  # F32 comes back as a view of the file
            arr = np.array(arr, order="C", copy=True)
        keep_bf16 = keep_blocks and qname == "BF16" and dtype == torch.float32
        weights[name] = torch.from_numpy(arr).to(device=device, dtype=torch.bfloat16 if keep_bf16 else dtype)
    return GGUFCheckpoint(config, weights, meta)
