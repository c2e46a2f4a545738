"""transformers as the reference of ``bench.engine``, in a process of its own.

Two engines in one process share its heap (glibc malloc): what one frees and what the allocator gives back to
the system decide whether the other's next multi-megabyte activation comes from the heap or from a fresh,
page-faulting ``mmap``. On the 2-core reference machine that moved our cold TTFT from 1.15 s to 1.45-1.65 s when
transformers ran between our runs, and transformers' own from ~1.3 s to ~1.15 s when it ran after ours. So the
benchmark runs transformers in this worker, each system in its own process as each would be deployed, while
the parent still interleaves the two run by run so load from other processes hits both alike.

Protocol: JSON lines. The parent starts ``python -m bench.hf_reference MODEL.gguf --threads N`` and writes
``{"op": "ttft", "prompt": [ids]}`` or ``{"op": "decode", "prompt": [ids], "new": 64}``; the worker answers
one line ``{"seconds": s}`` / ``{"tps": t}``, or ``{"error": "..."}``. The first line it writes is
``{"ready": true}`` once the model is loaded.
"""

from __future__ import annotations

import argparse
import inspect
import json
import subprocess
import sys
import time
from pathlib import Path

import torch


def load_transformers(path: str):
    """transformers' ``LlamaForCausalLM`` on the GGUF at ``path`` (dequantized to fp32) and its cache keyword."""
    from transformers import AutoModelForCausalLM

    p = Path(path)
    hf = AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=torch.float32).eval()
    key = "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"
    return hf, key


@torch.inference_mode()
def hf_ttft(hf, prompt: list[int]) -> float:
    """Seconds for transformers to produce the first token: one forward (KV cache on, last logits only)."""
    t0 = time.perf_counter()
    out = hf(torch.tensor([prompt]), use_cache=True, logits_to_keep=1)
    int(out.logits[0, -1].argmax())
    return time.perf_counter() - t0


@torch.inference_mode()
def hf_decode_tps(hf, key: str, prompt: list[int], new_tokens: int) -> float:
    """transformers greedy decode tokens/s at batch 1 after the first token (a bare loop over its KV cache)."""
    out = hf(torch.tensor([prompt]), use_cache=True, logits_to_keep=1)
    cache, tok = out[key], out.logits[:, -1:].argmax(-1)
    t0 = time.perf_counter()
    for _ in range(new_tokens - 1):
        out = hf(tok, use_cache=True, **{key: cache})
        cache, tok = out[key], out.logits[:, -1:].argmax(-1)
    return (new_tokens - 1) / (time.perf_counter() - t0)


class Reference:
    """The parent's handle on the worker process.

    Args:
        path: the ``.gguf`` file both engines load.
        threads: torch intra-op threads of the worker (the parent's count).

    Raises:
        RuntimeError: the worker exited or answered with an error (its message is included).
    """

    def __init__(self, path: str, threads: int) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.hf_reference", path, "--threads", str(threads)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self._read()  # {"ready": true}

    def _read(self) -> dict:
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        if not line:
            raise RuntimeError(f"transformers worker exited with status {self.proc.wait()}")
        msg = json.loads(line)
        if "error" in msg:
            raise RuntimeError(f"transformers worker: {msg['error']}")
        return msg

    def _ask(self, **request) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def ttft(self, prompt: list[int]) -> float:
        """``hf_ttft`` in the worker (seconds)."""
        return float(self._ask(op="ttft", prompt=prompt)["seconds"])

    def decode_tps(self, prompt: list[int], new_tokens: int) -> float:
        """``hf_decode_tps`` in the worker (tokens/s)."""
        return float(self._ask(op="decode", prompt=prompt, new=new_tokens)["tps"])

    def close(self) -> None:
        """End the worker (closing its stdin ends its loop)."""
        if self.proc.stdin:
            self.proc.stdin.close()
        self.proc.wait(timeout=60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--threads", type=int, required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    hf, key = load_transformers(args.model)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        try:
            if req["op"] == "ttft":
                reply = {"seconds": hf_ttft(hf, req["prompt"])}
            elif req["op"] == "decode":
                reply = {"tps": hf_decode_tps(hf, key, req["prompt"], int(req["new"]))}
            else:
                reply = {"error": f"unknown op {req['op']!r}"}
        except Exception as exc:  # reported to the parent, which raises it
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    main()
