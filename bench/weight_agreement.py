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

The attention of the model under test: ``--kv-dtype`` (its cache, default float32) and ``--prefill-kernel``
(``none`` = torch's chunked prefill, the default; ``native`` | ``amx`` | ``avx512-bf16`` = that build of
``engine.native_decode``'s prefill, every fed row a prompt row); ``--system-words N`` puts a system prompt of
about ``N`` words (the peers bench's ``system_text``) before each question, for long contexts; ``--chunk``: rows
per forward (default 8).

Run: ``python -m bench.weight_agreement [--prompts 20 --positions 100]`` (the issue's >= 2,000 positions over
>= 20 prompts; a few minutes on 2 cores). Prints each prompt's agreement, the total, the positions that
disagree, and one JSON line (last) with ``agree``, ``total``, ``agreement``.
"""

from __future__ import annotations

import argparse
import json

import torch

from bench.peers import system_text
from engine import native_decode
from engine.api import EngineConfig, SamplingParams
from engine.attention import AttentionMetadata
from engine.checkpoint import LoadedCheckpoint, default_model_path, load_checkpoint
from engine.llm_engine import LLMEngine
from engine.model import allocate_kv_cache
from engine.native_decode import NativeDecodeKernel

TOPICS = (
    "trains", "the moon", "bread", "a cat", "rivers", "chess", "python lists", "rain", "music", "paris",
    "volcanoes", "bicycles", "the ocean", "honey bees", "winter", "coffee", "libraries", "mountains",
    "electricity", "gardens", "glaciers", "tea", "owls", "bridges",
)  # fmt: skip


@torch.inference_mode()
def all_logits(
    model: torch.nn.Module,
    tokens: list[int],
    chunk: int,
    block_size: int = 16,
    kv_dtype: torch.dtype = torch.float32,
    prefill_kernel: NativeDecodeKernel | None = None,
) -> torch.Tensor:
    """fp32 logits ``[len(tokens), vocab]`` at every position of ``tokens``, fed ``chunk`` tokens per forward
    through a fresh paged KV cache of ``kv_dtype`` (one sequence, blocks in order). ``prefill_kernel``: attend
    every row with it as a prompt row (``AttentionMetadata.prefill_kernel``); None: torch's chunked prefill."""
    kv = allocate_kv_cache(model.config, -(-len(tokens) // block_size), block_size, kv_dtype, "cpu")
    table = torch.arange(kv.shape[2])[None, :]
    out = []
    for start in range(0, len(tokens), chunk):
        ids = tokens[start : start + chunk]
        pos = torch.arange(start, start + len(ids))
        meta = AttentionMetadata(
            pos.clone(),
            [0, len(ids)],
            [start + len(ids)],
            table,
            block_size,
            prompt_lens=[len(tokens)] if prefill_kernel is not None else None,
            prefill_kernel=prefill_kernel,
        )
        out.append(model.compute_logits(model(torch.tensor(ids), pos, kv, meta)))
    return torch.cat(out)


def reference_continuation(ref: LoadedCheckpoint, prompt: list[int], n: int) -> list[int]:
    """``n`` greedy tokens of the reference checkpoint after ``prompt`` (EOS ignored, so exactly ``n``)."""
    blocks = max(64, -(-(len(prompt) + n) // 16) + 1)
    config = EngineConfig(num_blocks=blocks, kv_dtype="float32")  # the reference's own cache
    engine = LLMEngine(ref.model, config, ref.model_id, ref.tokenizer)
    try:
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        return engine.generate([prompt], params)[0]
    finally:
        engine.close()


def teacher_forced_agreement(
    ck: LoadedCheckpoint,
    ref: LoadedCheckpoint,
    prompts: list[list[int]],
    n: int,
    chunk: int = 8,
    kv_dtype: torch.dtype = torch.float32,
    prefill_kernel: NativeDecodeKernel | None = None,
) -> tuple[int, int, list[tuple[int, int]]]:
    """(agreeing, total, [(prompt index, position) of each disagreement]) of ``ck``'s top-1 against ``ref``'s
    greedy continuation of each prompt, ``n`` positions per prompt, fed ``chunk`` reference tokens at a time
    (``all_logits``: ``kv_dtype``, ``prefill_kernel``)."""
    agree = total = 0
    misses: list[tuple[int, int]] = []
    for i, p in enumerate(prompts):
        ref_tokens = reference_continuation(ref, p, n)
        logits = all_logits(ck.model, p + ref_tokens, chunk, kv_dtype=kv_dtype, prefill_kernel=prefill_kernel)
        got = logits[len(p) - 1 : -1].argmax(-1).tolist()
        for j, (a, b) in enumerate(zip(got, ref_tokens, strict=True)):
            agree += a == b
            if a != b:
                misses.append((i, j))
        total += n
    return agree, total, misses


def chat_prompts(ck: LoadedCheckpoint, count: int, system: str | None = None) -> list[list[int]]:
    """``count`` short chat prompts ("Tell me about <topic>.") rendered with the checkpoint's own template, after
    the system message ``system`` where given."""
    if count > len(TOPICS):
        raise ValueError(f"at most {len(TOPICS)} prompts")
    tok = ck.tokenizer
    head = [{"role": "system", "content": system}] if system else []
    return [
        tok.render_chat([*head, {"role": "user", "content": f"Tell me about {t}."}]) for t in TOPICS[:count]
    ]


def prefill_kernel_named(name: str, ck: LoadedCheckpoint) -> NativeDecodeKernel | None:
    """``--prefill-kernel``'s kernel for ``ck``'s attention shape: None for ``none``, else that build.

    Raises:
        NativeKernelError: the build is not available on this machine (the message says why).
    """
    if name == "none":
        return None
    c = ck.model.config
    isa = native_decode.build_isa() if name == "native" else name
    return NativeDecodeKernel.build(group=c.num_heads // c.num_kv_heads, head_dim=c.head_dim, isa=isa)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default", help="a .gguf file or 'default' (SmolLM2 Q4_1)")
    ap.add_argument("--weights", default="auto", help="engine.weights of the model under test")
    ap.add_argument(
        "--linear-kernel",
        default="auto",
        help="engine.linear_kernel of the model under test (auto | native | int8-activations | torch)",
    )
    ap.add_argument("--kv-dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--prefill-kernel", default="none", choices=("none", "native", "amx", "avx512-bf16"))
    ap.add_argument("--system-words", type=int, default=0, help="a system prompt of about this many words")
    ap.add_argument("--chunk", type=int, default=8, help="rows per forward of the model under test")
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--positions", type=int, default=100)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    path = default_model_path() if args.model == "default" else args.model
    ck = load_checkpoint(path, weights=args.weights, linear_kernel=args.linear_kernel)
    ref = load_checkpoint(path, weights="float32")
    system = system_text(args.system_words, None) if args.system_words else None
    prompts = chat_prompts(ref, args.prompts, system)
    kv_dtype = getattr(torch, args.kv_dtype)
    kernel = prefill_kernel_named(args.prefill_kernel, ck)
    agree, total, misses = teacher_forced_agreement(
        ck, ref, prompts, args.positions, args.chunk, kv_dtype, kernel
    )
    print(
        f"weights {args.weights} ({ck.model.weight_formats}, linear kernel {args.linear_kernel}, {args.kv_dtype} "
        f"cache, prefill kernel {args.prefill_kernel}, prompts of {len(prompts[0])}-{len(prompts[-1])} tokens) vs "
        "float32 reference of the same weights"
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
                "kv_dtype": args.kv_dtype,
                "prefill_kernel": args.prefill_kernel,
                "system_words": args.system_words,
                "formats": ck.model.weight_formats,
            }
        )
    )


if __name__ == "__main__":
    main()
