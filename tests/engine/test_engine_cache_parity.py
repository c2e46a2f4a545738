"""Cache on == cache off: a request's greedy tokens and logits do not depend on whether its prefix was cached, on
the batch it ran in, on chunked prefill, or on what ran before it (DESIGN.md, "Engine core").

Reference: each prompt alone on a fresh engine with prefix caching off and no chunking. Every case also asserts how
many tokens were served from the cache, so a test that silently stopped caching would fail."""

from __future__ import annotations

import pytest
import torch

from tests.engine.engine_helpers import (
    greedy,
    make_engine,
    random_tokens,
    smollm2_checkpoint,
    tiny_checkpoint,
)

N_NEW = 12
ATOL = 1e-5


def run_alone_uncached(ckpt, prompt: list[int], n_new: int = N_NEW) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens and per-token logits ``[n_new, vocab]`` (row 0: the last prompt position)."""
    eng = make_engine(ckpt, enable_prefix_caching=False, record_logits=True, max_num_batched_tokens=4096)
    req = eng.add_request(prompt, greedy(n_new))
    eng.run_to_completion()
    return req.output_token_ids, torch.stack(eng.logits_log[req.request_id])


def assert_same(ckpt, eng, req, prompt, n_new: int = N_NEW) -> None:
    """Same greedy tokens; logits within ``ATOL * max |logit|`` of the reference. fp32 GEMMs round differently
    with the number of rows on some CPUs (seen on AMD EPYC with MKL: 1.1e-5 absolute on logits of magnitude ~46
    for the tiny checkpoints), so a flat absolute bound is machine-dependent; a relative one is not."""
    ref_tokens, ref_logits = run_alone_uncached(ckpt, prompt, n_new)
    assert req.output_token_ids == ref_tokens
    logits = torch.stack(eng.logits_log[req.request_id])
    tol = ATOL * float(ref_logits.abs().max())
    torch.testing.assert_close(logits[0], ref_logits[0], atol=tol, rtol=0)  # the last prompt position
    torch.testing.assert_close(logits, ref_logits, atol=tol, rtol=0)


def cases(base: list[int]) -> dict[str, tuple[list[int], int]]:
    """prompt and the tokens it must get from the cache once ``base`` (300 tokens) has run."""
    return {
        "shares 0 blocks": (random_tokens(90, 2), 0),
        "shares 1 block": (base[:20] + random_tokens(30, 3), 20),  # a block and 4 copied slots
        "shares many blocks": (base[:170] + random_tokens(25, 4), 170),
        "wholly cached": (base[:250], 249),  # 15 full blocks and 9 copied slots; the last token is recomputed
        "ends on a block boundary": (base[:240], 239),  # 14 blocks and 15 slots; the last token is recomputed
    }


@pytest.mark.parametrize("kind", ["hf", "qwen2", "gguf"])
def test_cached_prefix_gives_the_same_tokens_and_logits(kind):
    ckpt = tiny_checkpoint(kind)
    base = random_tokens(300 if kind != "gguf" else 260, 1)
    eng = make_engine(ckpt, record_logits=True)
    eng.add_request(base, greedy(2))
    eng.run_to_completion()
    for name, (prompt, cached) in cases(base).items():
        req = eng.add_request(prompt, greedy(N_NEW))
        eng.run_to_completion()
        assert req.num_cached_tokens == cached, name
        assert_same(ckpt, eng, req, prompt)


def test_wholly_cached_prompt_run_twice_is_identical():
    ckpt = tiny_checkpoint()
    prompt = random_tokens(64, 11)  # exactly 4 blocks
    eng = make_engine(ckpt, record_logits=True)
    first = eng.add_request(prompt, greedy(N_NEW))
    eng.run_to_completion()
    second = eng.add_request(prompt, greedy(N_NEW))
    eng.run_to_completion()
    assert (first.num_cached_tokens, second.num_cached_tokens) == (0, 63)
    assert first.output_token_ids == second.output_token_ids
    torch.testing.assert_close(
        torch.stack(eng.logits_log[first.request_id]),
        torch.stack(eng.logits_log[second.request_id]),
        atol=ATOL,
        rtol=0,
    )


def test_batched_chunked_and_cached_together_equals_alone():
    """All cases at once in one engine with a small token budget (chunked prefill, decodes mixed with prefill
    chunks, several sequences per step) give what each gives alone with no cache."""
    ckpt = tiny_checkpoint()
    base = random_tokens(300, 1)
    eng = make_engine(ckpt, record_logits=True, max_num_batched_tokens=40, max_batch=4)
    eng.add_request(base, greedy(2))
    eng.run_to_completion()
    reqs = [(eng.add_request(p, greedy(N_NEW)), p) for p, _ in cases(base).values()]
    reqs += [(eng.add_request(p, greedy(N_NEW)), p) for p in (random_tokens(33, 20), random_tokens(7, 21))]
    mixed_steps = 0
    while eng.has_unfinished():
        plan = eng.schedule_step()
        kinds = {s.num_new_tokens > 1 for s in plan.sched.scheduled}
        mixed_steps += kinds == {True, False}
        eng.finish_step(plan, eng.run_step(plan))
    assert mixed_steps > 0  # prefill chunks really ran beside decodes
    assert eng.stats().prefix_hit_tokens == 20 + 170 + 249 + 239
    for req, prompt in reqs:
        assert_same(ckpt, eng, req, prompt)


def test_what_ran_before_does_not_matter():
    ckpt = tiny_checkpoint()
    prompt = random_tokens(70, 30)
    eng = make_engine(ckpt, record_logits=True, num_blocks=12)  # a small pool: blocks are reused and evicted
    for i in range(4):
        eng.add_request(random_tokens(100, 40 + i), greedy(3))
        eng.run_to_completion()
    assert eng.stats().evictions > 0
    req = eng.add_request(prompt, greedy(N_NEW))
    eng.run_to_completion()
    assert_same(ckpt, eng, req, prompt)


@pytest.mark.slow
def test_smollm2_cached_system_prompt_matches_uncached():
    ckpt = smollm2_checkpoint()
    tok = ckpt.tokenizer
    system = "You are a helpful assistant for a train company. " * 12
    first = tok.render_chat(
        [{"role": "system", "content": system}, {"role": "user", "content": "When is the first train?"}]
    )
    second = tok.render_chat(
        [{"role": "system", "content": system}, {"role": "user", "content": "How much is a ticket?"}]
    )
    eng = make_engine(ckpt, record_logits=True)
    eng.add_request(first, greedy(2))
    eng.run_to_completion()
    req = eng.add_request(second, greedy(N_NEW))
    eng.run_to_completion()
    assert req.num_cached_tokens >= 96
    assert_same(ckpt, eng, req, second)
