"""Tiny random checkpoints the tests write themselves (nothing can be downloaded).

- ``make_tiny_hf_llama(dir)``: a Hugging Face folder (``LlamaForCausalLM``, or ``Qwen2ForCausalLM`` with q/k/v
  bias) saved by ``transformers``' ``save_pretrained`` as safetensors, with a byte-level BPE ``tokenizer.json``
  trained in-process by the ``tokenizers`` library and a ChatML-like ``chat_template`` that writes BOS, uses
  ``tools`` (``tojson``) and rejects unknown roles with ``raise_exception``.
- ``make_tiny_gguf_llama(path)``: the same weights and tokenizer as a llama.cpp GGUF written with
  ``gguf.GGUFWriter``: Q/K rows permuted as llama.cpp's ``convert_hf_to_gguf.py`` does, 2-D tensors stored as
  F32/F16/BF16 or quantized with ``gguf.quants.quantize`` (Q8_0, Q4_0, Q4_1, or any type the tests want to
  see rejected).

Weights are drawn with scales that keep activations O(1) and logits well spread (default 0.02-std init would
make near-ties, and greedy parity on ties is meaningless). Same ``seed`` -> same weights and tokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

BOS, EOS, IM_START = "<|endoftext|>", "<|im_end|>", "<|im_start|>"
SPECIALS = [BOS, IM_START, EOS]

CHAT_TEMPLATE = (
    "{{- bos_token }}\n"
    "{%- if tools %}\n"
    "{{- '<|im_start|>system\\n' }}\n"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}\n"
    "{{- 'You may call these tools:\\n' }}\n"
    "{%- for tool in tools %}{{- tool | tojson + '\\n' }}{%- endfor %}\n"
    "{{- '<|im_end|>\\n' }}\n"
    "{%- elif messages[0]['role'] == 'system' %}\n"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
    "{%- else %}\n"
    "{{- '<|im_start|>system\\nYou are a tiny test model.<|im_end|>\\n' }}\n"
    "{%- endif %}\n"
    "{% for message in messages %}\n"
    "    {% if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}\n"
    "        {{ raise_exception('Unknown role: ' + message['role']) }}\n"
    "    {% endif %}\n"
    "    {% if not (message['role'] == 'system' and loop.first) %}\n"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}\n"
    "    {%- endif %}\n"
    "{% endfor %}\n"
    "{% if add_generation_prompt %}\n"
    "{{ '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)

_WORDS = (
    "the quick brown fox jumps over the lazy dog while a cache of prefix blocks keeps every shared prompt "
    "system user assistant tool question answer document paris france capital model token block table slot "
    "attention key value query head layer norm rotary position embedding hello world what is how many "
).split()


def training_text(seed: int = 0, lines: int = 400) -> list[str]:
    """Deterministic English-ish lines with numbers, punctuation, code and non-ASCII, to train the tiny BPE."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(lines):
        words = [str(w) for w in rng.choice(_WORDS, size=int(rng.integers(4, 14)))]
        out.append(
            f"{' '.join(words).capitalize()}, {i * 37 % 1000} items at 12:{i % 60:02d}! café déjà vu? x = f(y) + 42;"
        )
    return out


def train_tokenizer(vocab_size: int = 384, seed: int = 0):
    """A byte-level BPE ``tokenizers.Tokenizer`` trained on ``training_text`` with the ChatML special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(training_text(seed), trainer=trainer)
    # Llama-style: raw prompts get BOS from the post-processor; chat templates write it themselves.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tok.token_to_id(BOS))]
    )
    return tok


def hf_config(
    vocab: int,
    *,
    qkv_bias: bool,
    tie: bool,
    bos: int,
    eos: int,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 16,
):
    """A tiny ``LlamaConfig`` (or ``Qwen2Config`` with q/k/v bias): 2 layers, by default hidden 64 = 4 heads of
    16 over 2 KV heads; ``heads`` x ``head_dim`` is the hidden size, intermediate twice that."""
    from transformers import LlamaConfig, Qwen2Config

    common = dict(
        vocab_size=vocab,
        hidden_size=heads * head_dim,
        intermediate_size=2 * heads * head_dim,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        rope_theta=5000.0,
        tie_word_embeddings=tie,
        bos_token_id=bos,
        eos_token_id=eos,
    )
    if qkv_bias:
        return Qwen2Config(**common, use_sliding_window=False)
    return LlamaConfig(**common)


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Redraw every parameter: embeddings N(0,1), matrices N(0, 1/fan_in), norms 1+N(0,0.1^2), biases N(0,0.1^2)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            elif p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5)
            elif "norm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))


def tiny_hf_model(tok, *, seed: int, qkv_bias: bool, tie: bool, **shape):
    """A randomized tiny ``transformers`` model whose vocabulary is ``tok``'s (``shape``: ``hf_config``'s heads,
    kv_heads, head_dim)."""
    from transformers import LlamaForCausalLM, Qwen2ForCausalLM

    cfg = hf_config(
        tok.get_vocab_size(),
        qkv_bias=qkv_bias,
        tie=tie,
        bos=tok.token_to_id(BOS),
        eos=tok.token_to_id(EOS),
        **shape,
    )
    torch.manual_seed(seed)
    model = (Qwen2ForCausalLM if qkv_bias else LlamaForCausalLM)(cfg)
    randomize(model, seed)
    if tie:
        model.tie_weights()
    return model.eval()


def make_tiny_hf_llama(
    dir: str | Path,
    *,
    seed: int = 0,
    qkv_bias: bool = False,
    tie_word_embeddings: bool = False,
    vocab: int = 384,
    **shape,
) -> Path:
    """Write a tiny Hugging Face folder (config.json, model.safetensors, tokenizer.json, tokenizer_config.json).

    Args:
        dir: folder to create (parents too).
        seed: weights and tokenizer seed.
        qkv_bias: ``Qwen2ForCausalLM`` with q/k/v bias instead of ``LlamaForCausalLM``.
        tie_word_embeddings: share the embedding with the LM head.
        vocab: BPE vocabulary size to train (byte alphabet 256 + 3 specials + merges).
        shape: ``hf_config``'s heads, kv_heads, head_dim (default 4 heads of 16 over 2 KV heads).
    """
    out = Path(dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(vocab, seed)
    model = tiny_hf_model(tok, seed=seed, qkv_bias=qkv_bias, tie=tie_word_embeddings, **shape)
    model.save_pretrained(out, safe_serialization=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": BOS,
                "eos_token": EOS,
                "unk_token": BOS,
                "pad_token": EOS,
                "clean_up_tokenization_spaces": False,
                "model_max_length": 512,
                "chat_template": CHAT_TEMPLATE,
            },
            indent=2,
        )
    )
    return out


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp ``convert_hf_to_gguf.py``'s ``LlamaModel.permute`` of Q/K rows (HF rotate-half -> interleaved)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_GGUF_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def gguf_name(hf: str) -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    _, _, layer, rest = hf.split(".", 3)
    return f"blk.{layer}.{_GGUF_NAMES[rest]}"


def encode_tensor(arr: np.ndarray, tensor_type: str) -> tuple[np.ndarray, object]:
    """(data, raw_dtype) for ``GGUFWriter.add_tensor``: 1-D tensors stay F32, 2-D become ``tensor_type``."""
    import gguf

    arr = np.ascontiguousarray(arr, dtype=np.float32)
    if arr.ndim == 1 or tensor_type == "F32":
        return arr, gguf.GGMLQuantizationType.F32
    qtype = gguf.GGMLQuantizationType[tensor_type]
    if tensor_type == "F16":
        return arr.astype(np.float16), qtype
    return gguf.quants.quantize(arr, qtype), qtype


def make_tiny_gguf_llama(
    path: str | Path,
    *,
    tensor_type: str = "F32",
    seed: int = 0,
    qkv_bias: bool = False,
    tie_word_embeddings: bool = True,
    vocab: int = 384,
    pre: str = "gpt-2",
    add_bos_token: bool = True,
) -> Path:
    """Write a tiny llama (or qwen2 when ``qkv_bias``) GGUF with the weights/tokenizer ``make_tiny_hf_llama`` uses.

    Args:
        path: the ``.gguf`` file to write.
        tensor_type: storage of 2-D tensors: ``F32``, ``F16``, ``BF16``, ``Q8_0``, ``Q4_0``, ``Q4_1`` (or any other
            ``gguf.GGMLQuantizationType`` name ``gguf.quants.quantize`` supports, to test rejection).
        seed, qkv_bias, tie_word_embeddings, vocab: as in ``make_tiny_hf_llama``.
        pre: ``tokenizer.ggml.pre`` value (the BPE split rule).
        add_bos_token: ``tokenizer.ggml.add_bos_token`` (raw prompts get BOS).
    """
    import gguf

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(vocab, seed)
    model = tiny_hf_model(tok, seed=seed, qkv_bias=qkv_bias, tie=tie_word_embeddings)
    cfg = model.config
    arch = "qwen2" if qkv_bias else "llama"
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{arch}-{tensor_type}")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(5000.0)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    w.add_vocab_size(cfg.vocab_size)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    tokens = [tok.id_to_token(i) for i in range(tok.get_vocab_size())]
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if t in SPECIALS else gguf.TokenType.NORMAL for t in tokens])
    merges = json.loads(tok.to_str())["model"]["merges"]
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    w.add_bos_token_id(tok.token_to_id(BOS))
    w.add_eos_token_id(tok.token_to_id(EOS))
    w.add_unk_token_id(tok.token_to_id(BOS))
    w.add_pad_token_id(tok.token_to_id(EOS))
    w.add_add_bos_token(add_bos_token)
    w.add_chat_template(CHAT_TEMPLATE)
    for name, t in model.state_dict().items():
        if tie_word_embeddings and name == "lm_head.weight":
            continue
        arr = t.detach().float().numpy()
        if arch == "llama" and ".q_proj." in name:
            arr = llama_cpp_permute(arr, cfg.num_attention_heads)
        elif arch == "llama" and ".k_proj." in name:
            arr = llama_cpp_permute(arr, cfg.num_key_value_heads)
        data, qtype = encode_tensor(arr, tensor_type)
        w.add_tensor(gguf_name(name), data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
