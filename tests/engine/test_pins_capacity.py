"""Pins and the pool's capacity: a request is measured against what the pins leave of the pool (plus the pinned
blocks its own prompt reuses), at submit and while it waits. Before (a burst trial), a request past that
passed the check (which measured the whole pool), then waited for blocks no request would free, and every
request behind it waited too; one that fitted was cut short with a ``length`` finish."""

from __future__ import annotations

import pytest

from engine.api import SamplingParams
from engine.errors import PromptTooLongError
from tests.engine.engine_helpers import greedy, make_engine, random_tokens

BS = 16
NUM_BLOCKS = 40  # 640 tokens; the pin cap is a quarter: 10 blocks
PINNED = random_tokens(8 * BS, seed=1)  # 8 whole blocks, pinned


def pinned_engine():
    eng = make_engine(num_blocks=NUM_BLOCKS)
    warm = eng.warm(PINNED, pin=True)
    assert warm.pinned_blocks == 8
    return eng


def test_a_prompt_past_what_the_pins_leave_is_refused_at_submit():
    eng = pinned_engine()
    usable = (NUM_BLOCKS - 8) * BS  # 512
    with pytest.raises(PromptTooLongError) as err:
        eng.add_request(
            random_tokens(usable, seed=2), greedy(1)
        )  # fits the whole pool (640), not beside pins
    assert (err.value.what, err.value.limit, err.value.pinned_blocks) == ("pool", usable, 8)
    assert "8 blocks pinned by warmed prefixes" in str(err.value)
    with pytest.raises(PromptTooLongError) as err:
        eng.add_request(random_tokens(400, seed=3), greedy(200))  # an explicit max_tokens past it
    assert err.value.completion_tokens == 200
    assert not eng.has_unfinished()
    eng.kv.check_invariants()


def test_a_prompt_reusing_the_pinned_blocks_counts_them_as_its_own():
    eng = pinned_engine()
    prompt = PINNED + random_tokens(560 - len(PINNED), seed=4)  # 560 > 512, but 8 of its blocks are the pins'
    req = eng.add_request(prompt, greedy(50))
    eng.run_to_completion()
    assert req.num_output_tokens == 50 and req.num_cached_tokens == len(PINNED)
    eng.kv.check_invariants()


def test_the_default_max_tokens_stops_where_the_pins_leave_off():
    eng = pinned_engine()
    req = eng.add_request(
        random_tokens(300, seed=5), SamplingParams(max_tokens=None, temperature=0.0, ignore_eos=True)
    )
    assert req.max_tokens == (NUM_BLOCKS - 8) * BS - 300
    eng.run_to_completion()
    assert req.num_output_tokens == req.max_tokens and req.finish_reason == "length"
    eng.kv.check_invariants()


def test_a_request_that_pins_made_too_big_while_it_waited_ends_and_the_queue_goes_on():
    eng = make_engine(num_blocks=NUM_BLOCKS)
    eng.warm(PINNED)  # cached, not pinned yet
    big = eng.add_request(random_tokens(520, seed=6), greedy(1))  # fits the pool now
    hashes = eng.kv.block_hashes(PINNED, big.extra_keys)
    assert eng.kv.pins.pin("late", eng.kv.find_cached_prefix(PINNED, hashes, big.extra_keys)) == 8
    small = eng.add_request(random_tokens(20, seed=7), greedy(3))
    outs = eng.run_to_completion(max_steps=50)
    assert outs[big.request_id].finish_reason == "error"
    error = outs[big.request_id].error
    assert isinstance(error, PromptTooLongError) and error.pinned_blocks == 8
    assert outs[small.request_id].finish_reason == "length" and small.num_output_tokens == 3
    assert not eng.has_unfinished()
    eng.kv.check_invariants()


def test_a_prefix_warmed_with_pin_again_keeps_one_pin_and_one_drop_releases_it():
    """A trial: each re-warm of a pinned prefix added a pin, ``DELETE ?prefix_key=`` released only the last, and
    the others held their blocks, unlisted, against the pin cap until a restart."""
    eng = pinned_engine()  # 8 of the cap's 10 blocks
    first = eng.list_cached()[0]
    for _ in range(3):  # a re-warm at the cap is no new pin: the prefix's own pin is counted as released
        again = eng.warm(PINNED, pin=True, prefix_key=first.prefix_key)
        assert (again.pinned_blocks, eng.kv.pins.blocks_held) == (8, 8)
    unpinned = eng.warm(PINNED, prefix_key=first.prefix_key)  # without pin: the pin stays
    assert (unpinned.pin_id, eng.kv.pins.blocks_held) == (again.pin_id, 8)
    assert eng.drop_cached(prefix_key=first.prefix_key)["prefixes"] == 1
    assert eng.kv.pins.blocks_held == 0 and eng.list_cached() == []
    eng.kv.check_invariants()


def test_a_prefix_key_warmed_with_another_prompt_replaces_its_pin():
    eng = pinned_engine()
    key = eng.list_cached()[0].prefix_key
    other = random_tokens(
        9 * BS, seed=7
    )  # 9 blocks: over the cap beside the 8 pinned, within it in their place
    warm = eng.warm(other, pin=True, prefix_key=key)
    assert (warm.pinned_blocks, eng.kv.pins.blocks_held) == (9, 9)
    assert len(list(eng.kv.pins.tables())) == 1
    third = eng.warm(random_tokens(2 * BS, seed=8), prefix_key=key)  # without pin: the old pin is released
    assert (third.pin_id, eng.kv.pins.blocks_held) == (None, 0)
    eng.kv.check_invariants()


def test_a_request_under_a_pinned_prefix_key_keeps_the_pin_listed_and_droppable():
    """The gateway's warm runs as a request under the prefix key, and so does every request after it: each listed
    the prefix again without its pin, so a re-warm pinned anew and ``DELETE ?prefix_key=`` left the pin held."""
    eng = make_engine(num_blocks=NUM_BLOCKS)
    first = eng.warm(PINNED, pin=True, prefix_key="sys")
    eng.add_request(
        PINNED + random_tokens(20, seed=4), greedy(1), prefix_key="sys"
    )  # as the gateway's requests
    eng.run_to_completion()
    assert [(p.prefix_key, p.pinned) for p in eng.list_cached()] == [("sys", True)]
    again = eng.warm(PINNED, pin=True, prefix_key="sys")
    assert (again.pin_id, eng.kv.pins.blocks_held) == (first.pin_id, 8)
    eng.drop_cached(prefix_key="sys")
    assert eng.kv.pins.blocks_held == 0
    eng.kv.check_invariants()
