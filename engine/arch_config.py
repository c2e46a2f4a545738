"""The architecture of a Llama-family decoder (``ArchConfig``): its shape hyperparameters, read from a GGUF
file's metadata or a Hugging Face ``config.json`` by ``engine.gguf_loader`` / ``engine.hf_loader``.

Invariants: frozen; ``num_heads`` is a positive multiple of ``num_kv_heads`` and ``head_dim`` is even (RoPE),
checked at construction (``UnsupportedModelError``). Serving settings are ``engine.api.EngineConfig``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ArchConfig:
    """Hyperparameters of a Llama-family decoder (Llama, SmolLM, Mistral, Qwen2).

    Attributes:
        architecture: the checkpoint's own name for it (``"llama"``/``"qwen2"`` in GGUF,
            ``"LlamaForCausalLM"``/``"MistralForCausalLM"``/``"Qwen2ForCausalLM"`` in HF folders).
        vocab_size: rows of the embedding matrix (tokens).
        hidden_size: model width.
        intermediate_size: width of the SiLU-gated MLP.
        num_layers: decoder layers.
        num_heads: query heads.
        num_kv_heads: key/value heads (grouped-query attention: ``num_heads % num_kv_heads == 0``).
        head_dim: dimension of one head (usually ``hidden_size // num_heads``).
        rope_theta: RoPE base (``freq_base``); rotate-half convention of Hugging Face.
        rms_norm_eps: epsilon of every RMSNorm.
        max_position_embeddings: context window in tokens.
        tie_word_embeddings: the LM head reuses the embedding matrix.
        attention_bias: q/k/v projections carry a bias (Qwen2).
        bos_token_id: beginning-of-sequence token id, or None.
        eos_token_ids: every token id that ends generation.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        from engine.errors import UnsupportedModelError

        if self.num_heads <= 0 or self.num_kv_heads <= 0 or self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"num_heads={self.num_heads} is not a positive multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise UnsupportedModelError(f"head_dim={self.head_dim} is odd; RoPE needs an even head dimension")

    @property
    def q_size(self) -> int:
        """Width of the query projection output (``num_heads * head_dim``)."""
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Width of the key (or value) projection output (``num_kv_heads * head_dim``)."""
        return self.num_kv_heads * self.head_dim

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Bytes of KV cache one token takes over all layers (K and V) at ``dtype_bytes`` per element."""
        return self.num_layers * 2 * self.kv_size * dtype_bytes
