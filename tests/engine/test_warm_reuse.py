"""What a warm reports against what the next request reuses, on the tiny checkpoint (ChatML-like template,
blocks of 16): ``cached_tokens`` counts whole blocks (what a pin holds), ``reusable_tokens`` the tokens the
conversation's next request copies too (token-granular hits, docs/prefix-cache.md), and the next request's
``cached_tokens`` equals it exactly."""

from __future__ import annotations

import pytest

from engine.api import GenerationRequest
from engine.async_engine import AsyncEngine
from tests.engine.engine_helpers import greedy, make_engine, random_tokens, tiny_checkpoint

SYSTEM = [{"role": "system", "content": "You are the warm test. Answer in one short line, please. " * 3}]


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


async def cached_by(eng: AsyncEngine, messages: list[dict], salt: str = "") -> int:
    req = GenerationRequest(messages=messages, params=greedy(2), cache_salt=salt)
    events = [e async for e in eng.generate(req)]
    return events[-1].usage.cached_tokens


@pytest.mark.parametrize("pin", [True, False])
async def test_a_system_warm_reports_what_the_next_user_turn_reuses(pin):
    """Before: the warm reported 128 (its whole blocks) and the request then reused 130, up to where the user
    turn leaves the warmed generation prompt (``<|im_start|>`` shared, ``assistant`` not)."""
    eng = AsyncEngine(make_engine(), tiny_checkpoint().tokenizer)
    try:
        warm = await eng.warm(GenerationRequest(messages=SYSTEM, cache_salt="t"), pin=pin)
        prompt = eng.render_chat(SYSTEM)
        following = SYSTEM + [{"role": "user", "content": "What is a block table?"}]
        shared = common_prefix(prompt, eng.render_chat(following))
        assert warm.prompt_tokens == len(prompt)
        assert warm.cached_tokens == len(prompt) // 16 * 16
        assert warm.pinned_blocks == (warm.cached_tokens // 16 if pin else 0)
        assert warm.reusable_tokens == shared  # every shared token: whole blocks and the partial one
        assert (warm.prompt_tokens, warm.cached_tokens, warm.reusable_tokens) == (138, 128, 130)
        assert await cached_by(eng, following, "t") == warm.reusable_tokens
        assert await cached_by(eng, following, "other tenant") == 0
    finally:
        await eng.shutdown()


async def test_a_warm_with_a_declared_public_prefix_pins_and_reports_the_blocks_it_cached():
    """Before: with ``shared_prefix_messages`` (the gateway's ``shared_prefixes``) the warm looked its blocks up
    under the tenant's keys, found none (the public blocks are keyed by the shared salt): ``cached_tokens`` 0,
    ``pin: true`` pinned nothing, no error. Now the lookup takes the keys the blocks were cached under."""
    eng = AsyncEngine(make_engine(), tiny_checkpoint().tokenizer)
    try:
        public = GenerationRequest(
            messages=SYSTEM + [{"role": "user", "content": "Hello there."}],
            cache_salt="acme",
            shared_prefix_messages=1,
            shared_salt="public",
        )
        warm = await eng.warm(public, pin=True)
        prompt = eng.render_chat(public.messages)
        assert warm.cached_tokens == len(prompt) // 16 * 16 > 0
        assert warm.pinned_blocks == warm.cached_tokens // 16 and warm.pin_id is not None
        assert eng.stats().pinned_blocks == warm.pinned_blocks
        assert warm.reusable_tokens == warm.prompt_tokens
        # the public part serves another tenant; the tenant's own blocks do not
        other = GenerationRequest(
            messages=SYSTEM + [{"role": "user", "content": "Hello there, again."}],
            params=greedy(2),
            cache_salt="bob",
            shared_prefix_messages=1,
            shared_salt="public",
        )
        events = [e async for e in eng.generate(other)]
        assert 0 < events[-1].usage.cached_tokens < warm.cached_tokens
        assert eng.unpin(warm.pin_id)
    finally:
        await eng.shutdown()


async def test_a_conversation_warm_is_reused_whole_by_its_next_turn():
    """A warm ending with a user message: the next request carries the assistant's reply after it, and its
    rendering starts with the whole warmed prompt (generation prompt included)."""
    eng = AsyncEngine(make_engine(), tiny_checkpoint().tokenizer)
    try:
        conversation = SYSTEM + [{"role": "user", "content": "Name the capital of france."}]
        warm = await eng.warm(GenerationRequest(messages=conversation))
        assert warm.reusable_tokens == warm.prompt_tokens > warm.cached_tokens
        following = conversation + [
            {"role": "assistant", "content": "Paris."},
            {"role": "user", "content": "And of italy?"},
        ]
        assert await cached_by(eng, following) == warm.reusable_tokens
        # the very same prompt again computes its last token, as any request does
        assert await cached_by(eng, conversation) == warm.prompt_tokens - 1
    finally:
        await eng.shutdown()


async def test_without_partial_hits_only_whole_blocks_are_reusable():
    eng = AsyncEngine(make_engine(enable_partial_prefix_hits=False), tiny_checkpoint().tokenizer)
    try:
        warm = await eng.warm(GenerationRequest(messages=SYSTEM))
        following = SYSTEM + [{"role": "user", "content": "What is a block table?"}]
        assert (warm.cached_tokens, warm.reusable_tokens) == (128, 128)
        assert await cached_by(eng, following) == warm.reusable_tokens
    finally:
        await eng.shutdown()


def test_a_token_warm_is_reusable_whole_by_a_longer_prompt():
    eng = make_engine()
    prompt = random_tokens(53, 7)
    warm = eng.warm(prompt, pin=True)
    assert (warm.cached_tokens, warm.pinned_blocks, warm.reusable_tokens) == (48, 3, 53)
    req = eng.add_request(prompt + random_tokens(5, 8), greedy(1))
    eng.run_to_completion()
    assert req.num_cached_tokens == 53
    eng.kv.check_invariants()


async def test_a_warm_says_how_much_it_prefilled():
    """Before: a warm of new text and a repeat warm answered the same fields (``cached_tokens`` is what is cached
    after it), so a caller could not tell whether it computed anything (found by a user trial)."""
    eng = AsyncEngine(make_engine(), tiny_checkpoint().tokenizer)
    try:
        first = await eng.warm(GenerationRequest(messages=SYSTEM, cache_salt="t"))
        again = await eng.warm(GenerationRequest(messages=SYSTEM, cache_salt="t"))
        other = await eng.warm(GenerationRequest(messages=SYSTEM, cache_salt="another tenant"))
        assert first.computed_tokens == first.prompt_tokens == 138  # nothing of it was cached
        # all but the last token is found again (the last is always computed for its logits)
        assert again.computed_tokens == 1 and again.cached_tokens == first.cached_tokens
        assert other.computed_tokens == 138  # another tenant's salt shares nothing
    finally:
        await eng.shutdown()


def test_the_synchronous_warm_counts_the_same_way():
    eng = make_engine()
    prompt = random_tokens(40, 3)
    assert eng.warm(prompt).computed_tokens == 40
    assert eng.warm(prompt).computed_tokens == 1
    assert eng.warm(prompt + random_tokens(20, 4)).computed_tokens == 20
