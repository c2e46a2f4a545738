"""Load a Llama-family decoder from a Hugging Face folder: ``config.json`` + ``*.safetensors``.

Reads a single ``model.safetensors`` or the shards listed in ``model.safetensors.index.json`` (format:
https://huggingface.co/docs/safetensors) with the ``safetensors`` package. Supported architectures:
``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM``; weights are already in the layout
``engine.model.LlamaModel`` expects.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from engine.arch_config import ArchConfig
from engine.errors import UnsupportedModelError

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


@dataclass
class HFCheckpoint:
    """What a Hugging Face folder holds: config, HF-named tensors, and the raw ``config.json``."""

    config: ArchConfig
    weights: dict[str, torch.Tensor]
    raw_config: dict


def read_json(path: Path) -> dict:
    """Parse a JSON file, turning any failure into ``UnsupportedModelError`` naming the file."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise UnsupportedModelError(f"cannot read {path}: {e}") from e


def eos_ids(*values) -> tuple[int, ...]:
    """Union (in order) of ``eos_token_id`` values, each an int, a list of ints, or None."""
    out: list[int] = []
    for v in values:
        for e in v if isinstance(v, list) else [v]:
            if e is not None and int(e) not in out:
                out.append(int(e))
    return tuple(out)


def config_from_hf(raw: dict, generation: dict | None = None) -> ArchConfig:
    """``ArchConfig`` from a ``config.json`` dict (and ``generation_config.json`` for extra EOS ids).

    Raises:
        UnsupportedModelError: unsupported architecture, rope scaling type, or a missing key (named).
    """
    archs = raw.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise UnsupportedModelError(
            f"architecture {archs or raw.get('model_type')!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    scaling = raw.get("rope_scaling")
    rope_params = raw.get("rope_parameters") or {}
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type")) or rope_params.get("rope_type")
    if kind not in (None, "default"):
        raise UnsupportedModelError(f"rope scaling type {kind!r} is not supported")
    max_len = int(raw.get("max_position_embeddings", 2048))
    window = raw.get("sliding_window")
    if window is not None and raw.get("use_sliding_window", arch == "MistralForCausalLM"):
        # Full attention equals sliding-window attention while the context fits the window: cap the context.
        max_len = min(max_len, int(window))
    try:
        hidden, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
        theta = raw.get("rope_theta", rope_params.get("rope_theta", 10000.0))
        bias = raw.get("attention_bias", arch == "Qwen2ForCausalLM")
        return ArchConfig(
            architecture=arch,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            rope_theta=float(theta),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=max_len,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(bias),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids(raw.get("eos_token_id"), (generation or {}).get("eos_token_id")),
        )
    except KeyError as e:
        raise UnsupportedModelError(f"config.json has no {e.args[0]!r}") from e


def safetensors_files(folder: Path) -> list[Path]:
    """The weight files of ``folder``: the shards of ``model.safetensors.index.json``, else every ``*.safetensors``.

    Raises:
        UnsupportedModelError: no safetensors file (e.g. a ``pytorch_model.bin``-only folder).
    """
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted({folder / f for f in read_json(index).get("weight_map", {}).values()})
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        found = sorted(p.name for p in folder.iterdir())[:10]
        raise UnsupportedModelError(f"{folder} has no *.safetensors weights (found: {found})")
    for f in files:
        if not f.is_file():
            raise UnsupportedModelError(f"shard {f.name} listed in {index.name} is missing")
    return files


def load_hf(
    folder: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> HFCheckpoint:
    """Read config and weights of a Hugging Face folder, cast to ``dtype`` on ``device``.

    Raises:
        UnsupportedModelError: missing/garbage config.json or weights, unsupported architecture.
    """
    from safetensors import safe_open

    folder = Path(folder)
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise UnsupportedModelError(f"{folder} has no config.json")
    raw = read_json(cfg_path)
    gen_path = folder / "generation_config.json"
    config = config_from_hf(raw, read_json(gen_path) if gen_path.is_file() else None)
    weights: dict[str, torch.Tensor] = {}
    files = safetensors_files(folder)
    try:
        handles = [safe_open(str(f), framework="pt", device="cpu") for f in files]
    except Exception as e:  # safetensors raises SafetensorError on garbage
        raise UnsupportedModelError(f"cannot read safetensors weights in {folder}: {e}") from e
    total = sum(len(h.keys()) for h in handles)
    with tqdm(total=total, desc=f"loading {folder.name}", unit="tensor", leave=False, disable=None) as bar:
        for h in handles:
            for name in h.keys():
                if name.startswith("model.layers.") and ".rotary_emb." in name:
                    bar.update(1)
                    continue
                weights[name] = h.get_tensor(name).to(device=device, dtype=dtype)
                bar.update(1)
    if config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    return HFCheckpoint(config, weights, raw)
