"""Our paged forward pass vs ``transformers`` on the same weights: logits within 1e-4 relative, greedy equal.

Checkpoints: tiny random Llama / Qwen2 (q/k/v bias) Hugging Face folders, tiny GGUF files (F32 and quantized;
transformers reads them with ``gguf_file=`` and dequantizes with its own code, so this also checks our Q/K
unpermutation and dequantization), and the real SmolLM2-135M-Instruct GGUF (slow). Each with torch's layer glue
and with the native glue kernel (``engine.native_glue``; ``glue`` parameter).
"""

from __future__ import annotations

import pytest
import torch

from engine.checkpoint import LoadedCheckpoint, load_checkpoint
from engine.model import allocate_kv_cache
from engine.native_glue import resolve_glue_kernel
from tests.engine.checkpoints import make_tiny_gguf_llama
from tests.engine.model_driver import Seq, greedy, step

BLOCK = 16
GLUE = ["torch", "native"]
"""``glue`` parameter values: torch's ops, or the native layer-glue kernel (``engine.native_glue``)."""
PROMPT = "What is the capital of France? The quick brown fox jumps over the lazy dog, 42 times at 12:30."


def hf_model(path):
    """``transformers`` model on the same checkpoint (a folder, or a ``.gguf`` file via ``gguf_file=``)."""
    from transformers import AutoModelForCausalLM

    path = str(path)
    if path.endswith(".gguf"):
        folder, name = path.rsplit("/", 1)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.eval()


def glue_kernel(setting: str):
    """The native layer-glue kernel for ``native``, None for ``torch`` (``engine.native_glue``)."""
    return resolve_glue_kernel(setting, "cpu")


def our_logits_all(ck: LoadedCheckpoint, ids: list[int], glue=None) -> torch.Tensor:
    """Logits ``[len(ids), vocab]`` of every position, one prefill through the paged cache."""
    kv = allocate_kv_cache(ck.config, -(-len(ids) // BLOCK) + 1, BLOCK, torch.float32, "cpu")
    seq = Seq(ids, list(range(-(-len(ids) // BLOCK))))
    from engine.attention import AttentionMetadata

    meta = AttentionMetadata(
        torch.tensor([seq.blocks[p // BLOCK] * BLOCK + p % BLOCK for p in range(len(ids))]),
        [0, len(ids)],
        [len(ids)],
        torch.tensor([seq.blocks]),
        BLOCK,
    )
    hidden = ck.model(torch.tensor(ids), torch.arange(len(ids)), kv, meta, glue=glue)
    return ck.model.compute_logits(hidden)


def hf_logits_all(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0].float()


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    """Greedy continuation with transformers' own KV cache (no EOS stop)."""
    import inspect

    new_api = "cache" in inspect.signature(model.forward).parameters  # transformers >= 5.x renamed it
    out: list[int] = []
    with torch.inference_mode():
        res = model(torch.tensor([ids]), use_cache=True)
        for _ in range(n):
            tok = int(res.logits[0, -1].argmax())
            out.append(tok)
            past = res["cache"] if new_api else res["past_key_values"]
            kwargs = {"cache": past} if new_api else {"past_key_values": past}
            res = model(torch.tensor([[tok]]), use_cache=True, **kwargs)
    return out


def assert_close_rel(ours: torch.Tensor, ref: torch.Tensor, rel: float = 1e-4) -> None:
    scale = ref.abs().max().item()
    err = (ours - ref).abs().max().item()
    assert err <= rel * scale, f"max |diff| {err:.3g} > {rel} x max |ref| {scale:.3g}"


def check_parity(path, prompt_ids: list[int], n_greedy: int = 32, glue: str = "torch") -> None:
    ck = load_checkpoint(str(path))
    ref_model = hf_model(path)
    kernel = glue_kernel(glue)
    ours = our_logits_all(ck, prompt_ids, kernel)
    ref = hf_logits_all(ref_model, prompt_ids)
    assert ours.shape == ref.shape == (len(prompt_ids), ck.config.vocab_size)
    assert_close_rel(ours[-1], ref[-1])
    assert_close_rel(ours, ref)
    kv = allocate_kv_cache(ck.config, 32, BLOCK, torch.float32, "cpu")
    assert greedy(ck.model, kv, prompt_ids, n_greedy, BLOCK, glue=kernel) == hf_greedy(
        ref_model, prompt_ids, n_greedy
    )


@pytest.fixture(scope="module")
def tiny_prompt_ids(tiny_hf_dir) -> list[int]:
    ids = load_checkpoint(str(tiny_hf_dir)).tokenizer.encode(PROMPT, add_special_tokens=True)
    assert len(ids) > 20
    return ids


@pytest.mark.parametrize("glue", GLUE)
def test_tiny_hf_llama_matches_transformers(tiny_hf_dir, tiny_prompt_ids, glue):
    check_parity(tiny_hf_dir, tiny_prompt_ids, glue=glue)


@pytest.mark.parametrize("glue", GLUE)
def test_tiny_hf_qwen2_with_qkv_bias_matches_transformers(tiny_qwen2_dir, tiny_prompt_ids, glue):
    ck = load_checkpoint(str(tiny_qwen2_dir))
    assert ck.config.attention_bias and ck.config.tie_word_embeddings
    check_parity(tiny_qwen2_dir, tiny_prompt_ids, glue=glue)


@pytest.mark.parametrize("glue", GLUE)
@pytest.mark.parametrize("tensor_type", ["F32", "Q8_0", "Q4_1"])
def test_tiny_gguf_llama_matches_transformers(tmp_path, tensor_type, tiny_prompt_ids, glue):
    path = make_tiny_gguf_llama(tmp_path / f"tiny-{tensor_type}.gguf", tensor_type=tensor_type)
    check_parity(path, tiny_prompt_ids, glue=glue)


@pytest.mark.parametrize("glue", GLUE)
def test_tiny_gguf_qwen2_matches_transformers(tmp_path, tiny_prompt_ids, glue):
    path = make_tiny_gguf_llama(tmp_path / "tiny-qwen2.gguf", tensor_type="Q8_0", qkv_bias=True)
    assert load_checkpoint(str(path)).config.architecture == "qwen2"
    check_parity(path, tiny_prompt_ids, glue=glue)


def test_gguf_f32_logits_equal_hf_folder_logits(tmp_path, tiny_prompt_ids):
    """Same weights stored two ways (GGUF with llama.cpp's Q/K permutation, HF folder): same logits."""
    from tests.engine.checkpoints import make_tiny_hf_llama

    folder = make_tiny_hf_llama(tmp_path / "hf", seed=3, tie_word_embeddings=True)
    gguf = make_tiny_gguf_llama(tmp_path / "t.gguf", seed=3, tie_word_embeddings=True)
    a = our_logits_all(load_checkpoint(str(folder)), tiny_prompt_ids)
    b = our_logits_all(load_checkpoint(str(gguf)), tiny_prompt_ids)
    assert torch.equal(a, b)


def test_bf16_close_to_fp32(tiny_hf_dir, tiny_prompt_ids):
    ck32 = load_checkpoint(str(tiny_hf_dir))
    ck16 = load_checkpoint(str(tiny_hf_dir), dtype=torch.bfloat16)
    assert ck16.model.embed.dtype == torch.bfloat16
    a = our_logits_all(ck32, tiny_prompt_ids)[-1]
    b = our_logits_all(ck16, tiny_prompt_ids)[-1]
    assert b.dtype == torch.float32
    assert (a - b).abs().max() <= 0.05 * a.abs().max()


@pytest.fixture(scope="module")
def smollm2_pair(smollm2_path):
    return load_checkpoint(str(smollm2_path)), hf_model(smollm2_path)


@pytest.mark.slow
@pytest.mark.parametrize("glue", GLUE)
def test_smollm2_matches_transformers(smollm2_pair, glue):
    ck, ref_model = smollm2_pair
    kernel = glue_kernel(glue)
    ids = ck.tokenizer.render_chat([{"role": "user", "content": "What is the capital of France?"}])
    ours = our_logits_all(ck, ids, kernel)
    ref = hf_logits_all(ref_model, ids)
    assert_close_rel(ours[-1], ref[-1])
    assert_close_rel(ours, ref)
    kv = allocate_kv_cache(ck.config, 16, BLOCK, torch.float32, "cpu")
    ours_tokens = greedy(ck.model, kv, ids, 32, BLOCK, glue=kernel)
    assert ours_tokens == hf_greedy(ref_model, ids, 32)
    assert ck.tokenizer.decode(ours_tokens).startswith("The capital of France is Paris")


@pytest.mark.slow
@pytest.mark.parametrize("glue", GLUE)
def test_smollm2_batched_decode_matches_transformers(smollm2_pair, glue):
    """Three prompts prefilled and decoded together in mixed batches give transformers' tokens for each."""
    ck, ref_model = smollm2_pair
    g = glue_kernel(glue)
    questions = ["What is 2+2?", "Name a colour.", "Write a haiku about the sea."]
    prompts = [ck.tokenizer.render_chat([{"role": "user", "content": q}]) for q in questions]
    kv = allocate_kv_cache(ck.config, 64, BLOCK, torch.float32, "cpu")
    seqs = [Seq(p, list(range(i * 16, i * 16 + 16))) for i, p in enumerate(prompts)]
    out: list[list[int]] = [[] for _ in seqs]
    # step 1: seq 0 whole prompt, seq 1 part of its prompt; step 2: seq 0 decodes, seq 1 finishes, seq 2 all
    hidden = step(ck.model, kv, seqs[:2], [len(prompts[0]), 10], BLOCK, g)
    out[0].append(int(ck.model.compute_logits(hidden[:1]).argmax()))
    seqs[0].tokens.append(out[0][-1])
    hidden = step(ck.model, kv, seqs, [1, len(prompts[1]) - 10, len(prompts[2])], BLOCK, g)
    logits = ck.model.compute_logits(hidden)
    for i in range(3):
        out[i].append(int(logits[i].argmax()))
        if i:
            seqs[i].tokens.append(out[i][-1])
    seqs[0].tokens.append(out[0][-1])
    for _ in range(8):
        logits = ck.model.compute_logits(step(ck.model, kv, seqs, [1, 1, 1], BLOCK, g))
        for i in range(3):
            out[i].append(int(logits[i].argmax()))
            seqs[i].tokens.append(out[i][-1])
    for i, p in enumerate(prompts):
        n = len(out[i])
        assert out[i] == hf_greedy(ref_model, p, n), questions[i]
