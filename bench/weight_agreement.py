"""Top-1 agreement of a weight format with the fp32 reference of the same dequantized weights (issue 12, item 5).

For each prompt the fp32 reference model (``--reference``, default: the default GGUF loaded with
``weights=float32``) generates ``--positions`` greedy tokens; the model under test (``--weights``, default
``auto``: the GGUF's own int4/int8 planes) is then fed prompt + reference tokens ``chunk`` at a time through the
paged KV cache (fewer rows than ``dense_min_rows``, so the weight-only kernels run as in decode) and its argmax at
every generated position is compared with the reference token (teacher forcing: one disagreement does not
derail the rest).

``--linear-kernel`` (``engine.linear_kernel``): ``torch`` = torch's int4 kernel (bf16 activations, scales and
outputs), ``native`` = ``engine.native_linear`` (fp32, exact scales), ``int8-activations`` = its int8-activation
build (two int8 planes per group of 32); ``auto`` = native where it builds.

Run: ``python -m bench.weight_agreement [--prompts 20 --positions 100]`` (the issue's >= 2,000 positions over
>= 20 prompts; a few minutes on 2 cores). Prints each prompt's agreement, the total, the positions that
disagree, and one JSON line (last) with ``agree``, ``total``, ``agreement``.
"""

from __future__ import annotations

import argparse
import json

import torch

from engine.api import EngineConfig, SamplingParams
from engine.attention import AttentionMetadata
from engine.checkpoint import LoadedCheckpoint, default_model_path, load_checkpoint
from engine.llm_engine import LLMEngine
from engine.model import allocate_kv_cache

TOPICS = (
    "trains", "the moon", "bread", "a cat", "rivers", "chess", "python lists", "rain", "music", "paris",
    "volcanoes", "bicycles", "the ocean", "honey bees", "winter", "coffee", "libraries", "mountains",
    "electricity", "gardens", "glaciers", "tea", "owls", "bridges",
)  # fmt: skip


@torch.inference_mode()
def all_logits(model: torch.nn.Module, tokens: list[int], chunk: int, block_size: int = 16) -> torch.Tensor:
    """fp32 logits ``[len(tokens), vocab]`` at every position of ``tokens``, fed ``chunk`` tokens per forward
    through a fresh paged KV cache (one sequence, blocks in order)."""
    kv = allocate_kv_cache(model.config, -(-len(tokens) // block_size), block_size, torch.float32, "cpu")
    table = torch.arange(kv.shape[2])[None, :]
    out = []
    for start in range(0, len(tokens), chunk):
        ids = tokens[start : start + chunk]
        pos = torch.arange(start, start + len(ids))
        meta = AttentionMetadata(pos.clone(), [0, len(ids)], [start + len(ids)], table, block_size)
        out.append(model.compute_logits(model(torch.tensor(ids), pos, kv, meta)))
    return torch.cat(out)


def reference_continuation(ref: LoadedCheckpoint, prompt: list[int], n: int) -> list[int]:
    """``n`` greedy tokens of the reference checkpoint after ``prompt`` (EOS ignored, so exactly ``n``)."""
    engine = LLMEngine(ref.model, EngineConfig(num_blocks=64), ref.model_id, ref.tokenizer)
    try:
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        return engine.generate([prompt], params)[0]
    finally:
        engine.close()


def teacher_forced_agreement(
    ck: LoadedCheckpoint, ref: LoadedCheckpoint, prompts: list[list[int]], n: int, chunk: int = 8
) -> tuple[int, int, list[tuple[int, int]]]:
    """(agreeing, total, [(prompt index, position) of each disagreement]) of ``ck``'s top-1 against ``ref``'s
    greedy continuation of each prompt, ``n`` positions per prompt, fed ``chunk`` reference tokens at a time."""
    agree = total = 0
    misses: list[tuple[int, int]] = []
    for i, p in enumerate(prompts):
        ref_tokens = reference_continuation(ref, p, n)
        got = all_logits(ck.model, p + ref_tokens, chunk)[len(p) - 1 : -1].argmax(-1).tolist()
        for j, (a, b) in enumerate(zip(got, ref_tokens, strict=True)):
            agree += a == b
            if a != b:
                misses.append((i, j))
        total += n
    return agree, total, misses


def chat_prompts(ck: LoadedCheckpoint, count: int) -> list[list[int]]:
    """``count`` short chat prompts ("Tell me about <topic>.") rendered with the checkpoint's own template."""
    if count > len(TOPICS):
        raise ValueError(f"at most {len(TOPICS)} prompts")
    tok = ck.tokenizer
    return [tok.render_chat([{"role": "user", "content": f"Tell me about {t}."}]) for t in TOPICS[:count]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default", help="a .gguf file or 'default' (SmolLM2 Q4_1)")
    ap.add_argument("--weights", default="auto", help="engine.weights of the model under test")
    ap.add_argument(
        "--linear-kernel",
        default="auto",
        help="engine.linear_kernel of the model under test (auto | native | int8-activations | torch)",
    )
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--positions", type=int, default=100)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    path = default_model_path() if args.model == "default" else args.model
    ck = load_checkpoint(path, weights=args.weights, linear_kernel=args.linear_kernel)
    ref = load_checkpoint(path, weights="float32")
    prompts = chat_prompts(ref, args.prompts)
    agree, total, misses = teacher_forced_agreement(ck, ref, prompts, args.positions)
    print(
        f"weights {args.weights} ({ck.model.weight_formats}, linear kernel {args.linear_kernel}) vs float32 "
        "reference of the same weights"
    )
    print(f"top-1 agreement: {agree} / {total} = {agree / total:.4f} over {len(prompts)} prompts")
    print(f"disagreeing (prompt, position): {misses}")
    result = {"agree": agree, "total": total, "agreement": round(agree / total, 5), "prompts": len(prompts)}
    print(
        json.dumps(
            result
            | {
                "weights": args.weights,
                "linear_kernel": args.linear_kernel,
                "formats": ck.model.weight_formats,
            }
        )
    )


if __name__ == "__main__":
    main()
