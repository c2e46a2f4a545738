"""Every miss explained: each cause with its exact segment, offset and header."""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from gateway.service.miss_explain import MissExplainer
from gateway.service.miss_explanation import (
    MissExplainError,
    MissExplanation,
    PromptSegment,
    VolatileSpan,
)


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def build(
    tools: list[int], system: list[int], history: list[int], tail: list[int]
) -> tuple[list[int], list[PromptSegment], int]:
    """(tokens, segments, stable_end) of a prompt made of the four parts."""
    segments, pos = [], 0
    for name, part in (("tools", tools), ("system", system), ("history", history), ("tail", tail)):
        segments.append(PromptSegment(name, pos, pos + len(part)))
        pos += len(part)
    return tools + system + history + tail, segments, pos - len(tail)


TOOLS = list(range(1000, 1020))  # 20 tokens: [0, 20)
SYSTEM = list(range(2000, 2060))  # 60 tokens: [20, 80)
HISTORY = list(range(3000, 3040))  # 40 tokens: [80, 120)
TAIL = list(range(4000, 4010))  # 10 tokens: [120, 130)


def served(ex: MissExplainer, tokens: list[int], segments: list[PromptSegment]) -> None:
    """What the gateway does after serving a request from the embedded engine."""
    ex.record("m", "t", tokens, segments)
    ex.mark_cached("m", "t", tokens)


def test_hit_is_not_a_miss() -> None:
    ex = MissExplainer()
    tokens, segments, stable = build(TOOLS, SYSTEM, HISTORY, TAIL)
    served(ex, tokens, segments)
    e = ex.explain("m", "t", tokens, segments, stable, 112)
    assert e == MissExplanation(cached=112, stable=112, miss=False)
    assert e.header_value() == "cached=112; miss=none"
    assert e.missed_tokens == 0


def test_cold_when_nothing_was_seen() -> None:
    ex = MissExplainer()
    tokens, segments, stable = build(TOOLS, SYSTEM, HISTORY, TAIL)
    e = ex.explain("m", "t", tokens, segments, stable, 0)
    assert (e.miss, e.cause, e.segment, e.offset, e.source) == (True, "cold", "tools", 0, "local")
    assert e.header_value() == "cached=0; miss=cold; at=tools:0"
    assert e.missed_tokens == 112


def test_cold_when_seen_but_never_cached() -> None:
    ex = MissExplainer()
    tokens, segments, stable = build(TOOLS, SYSTEM, HISTORY, TAIL)
    ex.record("m", "t", tokens, segments)  # e.g. still in flight, or an upstream that cached nothing
    e = ex.explain("m", "t", tokens, segments, stable, 16)
    assert (e.cause, e.segment, e.offset) == ("cold", "tools", 16)


def test_cold_when_the_prompt_extends_an_earlier_one() -> None:
    ex = MissExplainer()
    first, first_segments, _ = build(TOOLS, SYSTEM, HISTORY, TAIL)  # 130 tokens
    served(ex, first, first_segments)
    reply = list(range(5000, 5030))
    tokens, segments, stable = build(TOOLS, SYSTEM, HISTORY + TAIL + reply, [4100, 4101])
    e = ex.explain("m", "t", tokens, segments, stable, 128)
    assert (e.cause, e.segment, e.offset) == ("cold", "history", 130)
    assert e.header_value() == "cached=128; miss=cold; at=history:130"


def test_below_minimum() -> None:
    ex = MissExplainer()
    tokens, segments, stable = build(TOOLS, SYSTEM, HISTORY, TAIL)
    e = ex.explain("m", "t", tokens, segments, stable, 0, min_cacheable=1024, granularity=128)
    # 120 stable tokens round down to 0 steps of 128: the target is the whole prompt's 128, below 1,024
    assert (e.stable, e.miss, e.cause, e.segment, e.offset) == (128, True, "below_minimum", "tail", 130)
    e = ex.explain("m", "t", tokens, segments, stable, 0, min_cacheable=1024)
    assert (e.cause, e.segment, e.offset) == ("below_minimum", "history", 120)
    assert e.header_value() == "cached=0; miss=below_minimum; at=history:120"


def test_evicted_says_when() -> None:
    clock = Clock(1000.0)
    ex = MissExplainer(clock=clock)
    tokens, segments, stable = build(TOOLS, SYSTEM, HISTORY, TAIL)
    served(ex, tokens, segments)
    clock.now = 1312.5
    e = ex.explain("m", "t", tokens, segments, stable, 32)
    assert (e.cause, e.segment, e.offset, e.cached_ago) == ("evicted", "system", 32, 312.5)
    assert e.header_value() == "cached=32; miss=evicted; at=system:32; cached_ago=312"


def test_tools_changed() -> None:
    ex = MissExplainer()
    served(ex, *build(TOOLS, SYSTEM, HISTORY, TAIL)[:2])
    tools = TOOLS[:5] + [1999] + TOOLS[6:]
    tokens, segments, stable = build(tools, SYSTEM, HISTORY, TAIL)
    e = ex.explain("m", "t", tokens, segments, stable, 0)
    assert (e.cause, e.segment, e.offset) == ("tools_changed", "tools", 5)
    # tools removed altogether: the template's wrapper stays, the divergence is where the tools were
    ex = MissExplainer()
    served(ex, *build([1, 2] + TOOLS, SYSTEM, HISTORY, TAIL)[:2])
    tokens, segments, stable = build([1, 2], SYSTEM, HISTORY, TAIL)
    e = ex.explain("m", "t", tokens, segments, stable, 0)
    assert (e.cause, e.segment, e.offset) == ("tools_changed", "system", 2)
    # nothing at all in common with the earlier prompt: cold
    tokens, segments, stable = build([], SYSTEM, HISTORY, TAIL)
    assert ex.explain("m", "t", tokens, segments, stable, 0).cause == "cold"


def test_system_text_added_after_tools_only_system_message_is_system_changed_with_tools_digests() -> None:
    # the engine's template writes the tools first in the system message: a tools-only system message ends
    # with its closing token (labelled system), and a system text added later is separated from the tools by
    # a separator the with/without-tools diff labels tools. The tools are the same (equal digests): the
    # system prompt is what changed.
    close, sep, text = [9000], [9001], list(range(6000, 6030))
    old, old_segments, old_stable = build(TOOLS, close + SYSTEM, HISTORY, TAIL)
    new = TOOLS + sep + text + close + SYSTEM + HISTORY + TAIL
    t, s = len(TOOLS), len(TOOLS) + 1 + len(text) + 1 + len(SYSTEM)
    new_segments = [
        PromptSegment("tools", 0, t + 1),
        PromptSegment("system", t + 1, s),
        PromptSegment("history", s, s + len(HISTORY)),
        PromptSegment("tail", s + len(HISTORY), len(new)),
    ]
    stable = s + len(HISTORY)
    for digests, cause, segment in (
        ((b"T", b"T"), "system_changed", "tools"),  # the same tools
        ((b"T", b"U"), "tools_changed", "tools"),  # other tools
        ((None, None), "tools_changed", "tools"),  # unknown: as before
        ((b"T", None), "tools_changed", "tools"),
    ):
        ex = MissExplainer()
        ex.record("m", "t", old, old_segments, tools_digest=digests[0])
        ex.mark_cached("m", "t", old)
        e = ex.explain("m", "t", new, new_segments, stable, 16, tools_digest=digests[1])
        assert (e.cause, e.segment, e.offset) == (cause, segment, t), digests
    # the digest is kept through ``record_answer``
    ex = MissExplainer()
    ex.record_answer("m", "t", old, old_segments, [5, 6, 7], tools_digest=b"T")
    ex.mark_cached("m", "t", old)
    e = ex.explain("m", "t", new, new_segments, stable, 16, tools_digest=b"T")
    assert e.cause == "system_changed"
    assert old_stable < len(old)


@pytest.mark.parametrize("bad", ["T", 3, bytearray(b"T")])
def test_tools_digest_must_be_bytes(bad) -> None:
    ex = MissExplainer()
    tokens, segments, stable = build(TOOLS, SYSTEM, HISTORY, TAIL)
    with pytest.raises(MissExplainError, match="tools_digest"):
        ex.explain("m", "t", tokens, segments, stable, 0, tools_digest=bad)
    with pytest.raises(MissExplainError, match="tools_digest"):
        ex.record("m", "t", tokens, segments, tools_digest=bad)


def test_system_changed() -> None:
    ex = MissExplainer()
    served(ex, *build(TOOLS, SYSTEM, HISTORY, TAIL)[:2])
    system = SYSTEM[:20] + list(range(7000, 7040))  # the second half of the system prompt is rewritten
    tokens, segments, stable = build(TOOLS, system, HISTORY, TAIL)
    e = ex.explain("m", "t", tokens, segments, stable, 32)
    assert (e.cause, e.segment, e.offset, e.slot) == ("system_changed", "system", 40, None)
    assert e.header_value() == "cached=32; miss=system_changed; at=system:40"


def test_volatile_only_where_a_known_volatile_span_is_what_differs() -> None:
    ex = MissExplainer()
    served(ex, *build(TOOLS, SYSTEM, HISTORY, TAIL)[:2])
    system = SYSTEM[:20] + [8001, 8002, 8003] + SYSTEM[22:]  # two tokens of a date became three
    tokens, segments, stable = build(TOOLS, system, HISTORY, TAIL)
    # a short edit with identical text after it, and no known volatile span there: an edit of the system
    # prompt (before: "volatile" with no slot, guessed from the edit's shape)
    e = ex.explain("m", "t", tokens, segments, stable, 32)
    assert (e.cause, e.segment, e.offset, e.slot) == ("system_changed", "system", 40, None)
    # a known volatile span elsewhere does not make it volatile either
    e = ex.explain("m", "t", tokens, segments, stable, 32, volatile_spans=[VolatileSpan(60, 63, "learned.x")])
    assert (e.cause, e.slot) == ("system_changed", None)
    e = ex.explain(
        "m", "t", tokens, segments, stable, 32, volatile_spans=[VolatileSpan(40, 43, "learned.0a1b2c3d4e5f")]
    )
    assert (e.cause, e.slot) == ("volatile", "learned.0a1b2c3d4e5f")
    assert e.header_value() == "cached=32; miss=volatile; at=system:40; slot=learned.0a1b2c3d4e5f"


def test_history_rewritten() -> None:
    ex = MissExplainer()
    served(ex, *build(TOOLS, SYSTEM, HISTORY, TAIL)[:2])
    history = HISTORY[:10] + [9000] + HISTORY[11:]  # a client compacted or re-rendered an earlier turn
    tokens, segments, stable = build(TOOLS, SYSTEM, history, TAIL)
    e = ex.explain("m", "t", tokens, segments, stable, 80)
    assert (e.cause, e.segment, e.offset) == ("history_rewritten", "history", 90)
    assert e.header_value() == "cached=80; miss=history_rewritten; at=history:90"


def test_a_new_or_edited_document_is_cold_and_a_known_volatile_value_in_it_volatile() -> None:
    ex = MissExplainer()
    doc = list(range(6000, 6040))

    def with_doc(document: list[int]) -> tuple[list[int], list[PromptSegment], int]:
        tokens = TOOLS + SYSTEM + document + TAIL
        segments = [
            PromptSegment("tools", 0, 20),
            PromptSegment("system", 20, 80),
            PromptSegment("documents", 80, 80 + len(document)),
            PromptSegment("tail", 80 + len(document), len(tokens)),
        ]
        return tokens, segments, 80 + len(document)

    served(ex, *with_doc(doc)[:2])
    e = ex.explain("m", "t", *with_doc(list(range(6500, 6540))), 80)
    assert (e.cause, e.segment, e.offset) == ("cold", "documents", 80)
    e = ex.explain("m", "t", *with_doc(doc[:5] + [6999] + doc[6:]), 80)
    assert (e.cause, e.segment, e.offset) == ("cold", "documents", 85)
    edited = with_doc(doc[:5] + [6999] + doc[6:])
    e = ex.explain("m", "t", *edited, 80, volatile_spans=[VolatileSpan(85, 86, "learned.0a1b2c3d4e5f")])
    assert (e.cause, e.segment, e.offset, e.slot) == ("volatile", "documents", 85, "learned.0a1b2c3d4e5f")


def test_other_tenant_and_model_are_separate() -> None:
    ex = MissExplainer()
    tokens, segments, stable = build(TOOLS, SYSTEM, HISTORY, TAIL)
    served(ex, tokens, segments)
    assert ex.explain("m", "other", tokens, segments, stable, 0).cause == "cold"
    assert ex.explain("m2", "t", tokens, segments, stable, 0).cause == "cold"


def test_provider_diagnostic_takes_precedence_and_keeps_the_place() -> None:
    ex = MissExplainer()
    served(ex, *build(TOOLS, SYSTEM, HISTORY, TAIL)[:2])
    system = SYSTEM[:20] + list(range(7000, 7040))
    tokens, segments, stable = build(TOOLS, system, HISTORY, TAIL)
    e = ex.explain("m", "t", tokens, segments, stable, 32, provider_cause="Cache entry expired (TTL)")
    assert (e.cause, e.segment, e.offset, e.source) == ("evicted", "system", 40, "provider")
    e = ex.explain("m", "t", tokens, segments, stable, 32, provider_cause="something new we do not know")
    assert (e.cause, e.source) == ("system_changed", "local")


def test_granularity_and_the_last_token() -> None:
    ex = MissExplainer()
    tokens = list(range(1100))
    segments = [PromptSegment("system", 0, 1100)]
    e = ex.explain("m", "t", tokens, segments, 1100, 1024, granularity=128)
    assert (e.stable, e.miss) == (1024, False)  # 1,099 computable tokens round down to 8 steps of 128
    e = ex.explain("m", "t", tokens, segments, 1100, 1024)
    assert (e.stable, e.miss, e.cause) == (1088, True, "cold")


def test_explain_is_read_only() -> None:
    ex = MissExplainer()
    tokens, segments, stable = build(TOOLS, SYSTEM, HISTORY, TAIL)
    ex.explain("m", "t", tokens, segments, stable, 0)
    assert ex.footprint() == {"keys": 0, "prompts": 0, "bytes": 0, "cached_chains": 0}
    served(ex, tokens, segments)
    assert ex.footprint() == {"keys": 1, "prompts": 1, "bytes": 256 + 4 * 130, "cached_chains": 8}
    served(ex, tokens, segments)  # the same prompt again is refreshed, not added
    assert ex.footprint()["prompts"] == 1


def test_bad_input_is_a_named_error() -> None:
    ex = MissExplainer()
    tokens, segments, stable = build(TOOLS, SYSTEM, HISTORY, TAIL)
    with pytest.raises(MissExplainError, match="tokens"):
        ex.explain("m", "t", [1, -2, 3], [], 0, 0)
    with pytest.raises(MissExplainError, match="tokens"):
        ex.record("m", "t", ["a"], [])
    with pytest.raises(MissExplainError, match=r"segments\[1\]"):
        ex.explain(
            "m", "t", tokens, [PromptSegment("tools", 0, 20), PromptSegment("system", 25, 130)], 120, 0
        )
    with pytest.raises(MissExplainError, match="cover"):
        ex.explain("m", "t", tokens, [PromptSegment("tools", 0, 20)], 120, 0)
    with pytest.raises(MissExplainError, match=r"segments\[0\]"):
        ex.explain("m", "t", tokens, [PromptSegment("prologue", 0, 130)], 120, 0)
    with pytest.raises(MissExplainError, match="cached_tokens"):
        ex.explain("m", "t", tokens, segments, stable, -1)
    with pytest.raises(MissExplainError, match="model and tenant"):
        ex.explain(None, "t", tokens, segments, stable, 0)
    with pytest.raises(MissExplainError, match="block_size"):
        MissExplainer(block_size=0)
    # a report of more cached tokens than the prompt holds is clamped, not an error
    assert ex.explain("m", "t", tokens, segments, stable, 10_000).cached == 130


def test_memory_is_bounded_under_a_flood() -> None:
    ex = MissExplainer(max_keys=10, max_prompts_per_key=5, max_bytes=40_000, max_cached_chains=300)
    for i in range(3000):
        tenant = f"tenant-{i % 37}"
        tokens = [i] * (16 + i % 300)
        served_segments = [PromptSegment("system", 0, len(tokens))]
        ex.explain("m", tenant, tokens, served_segments, len(tokens), 0)
        ex.record("m", tenant, tokens, served_segments)
        ex.mark_cached("m", tenant, tokens)
        fp = ex.footprint()
        assert (
            fp["keys"] <= 10 and fp["prompts"] <= 50 and fp["bytes"] <= 40_000 and fp["cached_chains"] <= 300
        )
        assert len(ex._seqs) == fp["prompts"]  # the digest index holds the stored prompts, no more


# ---- a miss never lies inside the span the cache served (x-prefixgate-cache vs the engine's cached_tokens) ----


def test_a_divergence_inside_the_served_span_is_not_the_cause():
    # The engine served 64 tokens of a system prompt the index never saw (warmed with /admin/cache/warm);
    # the nearest recorded prompt leaves it at token 30. Before: "cached=64; miss=system_changed; at=system:30",
    # a miss inside the 64 tokens the engine reported cached.
    ex = MissExplainer()
    served(ex, *build(TOOLS, SYSTEM, HISTORY, TAIL)[:2])
    system = SYSTEM[:10] + list(range(7000, 7050))
    tokens, segments, stable = build(TOOLS, system, HISTORY, TAIL)
    e = ex.explain("m", "t", tokens, segments, stable, 64)
    assert (e.miss, e.cause, e.segment, e.offset) == (True, "cold", "system", 64)
    assert e.header_value() == "cached=64; miss=cold; at=system:64"
    # a divergence at or after the served span still names its cause
    assert ex.explain("m", "t", tokens, segments, stable, 16).cause in ("system_changed", "volatile")
    assert ex.explain("m", "t", tokens, segments, stable, 16).offset == 30


def test_generated_blocks_the_engine_cached_are_not_a_miss_inside_them():
    # Turn 2 resends turn 1's prompt plus the reply; the engine cached the reply's blocks it generated, which
    # the index (prompts only) never saw: cached 144 > the 130 tokens of the earlier prompt.
    ex = MissExplainer()
    first, first_segments, _ = build(TOOLS, SYSTEM, HISTORY, TAIL)
    served(ex, first, first_segments)
    reply = list(range(5000, 5030))
    tokens, segments, stable = build(TOOLS, SYSTEM, HISTORY + TAIL + reply, [4100, 4101])
    e = ex.explain("m", "t", tokens, segments, stable, 144)
    assert (e.cause, e.segment, e.offset) == ("cold", "history", 144)


def test_an_edit_of_the_newest_reply_is_history_rewritten_where_it_differs():
    # The tryout: the client edits the reply it got ("." -> "!") before sending its next turn. The prompts
    # alone never held that reply: before, it was "cold" (at the cached count), whatever the edit. With the
    # served answer recorded as the engine cached it, the divergence lies in the reply, in the new history.
    ex = MissExplainer()
    first, first_segments, _ = build(TOOLS, SYSTEM, HISTORY, TAIL)
    served(ex, first, first_segments)
    reply = list(range(5000, 5030))  # 30 tokens: [130, 160)
    ex.record_answer("m", "t", first, first_segments, reply)
    edited = reply[:17] + [5999] + reply[18:]  # token 147 edited
    tokens, segments, stable = build(TOOLS, SYSTEM, HISTORY + TAIL + edited, [4100, 4101])
    e = ex.explain("m", "t", tokens, segments, stable, 144)  # the engine served its blocks up to the edit
    assert e.header_value() == "cached=144; miss=history_rewritten; at=history:147"
    # the reply resent as served: the earlier prompt and its answer are all shared, the next turn is new
    # (the block of the reply's last token, never computed, is not cached: cold where the cache stopped)
    tokens, segments, stable = build(TOOLS, SYSTEM, HISTORY + TAIL + reply, [4100, 4101])
    e = ex.explain("m", "t", tokens, segments, stable, 144)
    assert e.header_value() == "cached=144; miss=cold; at=history:144"
    assert not ex.explain("m", "t", tokens, segments, stable, 160).miss
    # an edit of an older turn is found as before, at its place
    history = HISTORY[:10] + [9000] + HISTORY[11:]
    tokens, segments, stable = build(TOOLS, SYSTEM, history + TAIL + reply, [4100, 4101])
    e = ex.explain("m", "t", tokens, segments, stable, 80)
    assert e.header_value() == "cached=80; miss=history_rewritten; at=history:90"


def test_an_edit_of_a_short_reply_ending_in_the_edits_block_is_history_rewritten():
    """The trial: a system prompt with a hoisted time (71-token prompt) and an 8-token answer: the recorded
    prompt and answer end at 79, in the block [64, 80) that the edit at 71 is in, and the edit was taken for
    "the earlier prompt all shared, what follows is new": ``cold``. An answer the request leaves before its
    end was edited."""
    ex = MissExplainer()
    first, first_segments, _ = build(TOOLS, SYSTEM, HISTORY, TAIL)  # 130 tokens
    reply = list(range(5000, 5006))  # [130, 136): the prompt and answer end inside the block [128, 144)
    ex.record_answer("m", "t", first, first_segments, reply)
    rewritten = [5999] * 20  # the client's own reply: [130, 150), so the stable target reaches 144
    tokens, segments, stable = build(TOOLS, SYSTEM, HISTORY + TAIL + rewritten, [4100, 4101])
    e = ex.explain("m", "t", tokens, segments, stable, 130)
    assert e.header_value() == "cached=130; miss=history_rewritten; at=history:130"


def test_an_edit_of_the_replys_first_token_is_history_rewritten_whatever_was_recorded_last():
    """The trial: with a hoisted block in the first turn, an edited newest reply said ``miss=cold``. The gateway
    records the answer before the prompt (the prompt's recording waits for the answer to be sent); an edit of
    the reply's first token shares the whole prompt with both entries, and the tie went to the newest, the
    prompt alone ("all shared: what follows is new"). The entry that goes on past the shared tokens (the
    answer) explains it: the client rewrote the reply."""
    ex = MissExplainer()
    first, first_segments, _ = build(TOOLS, SYSTEM, HISTORY, TAIL)
    reply = list(range(5000, 5030))  # [130, 160)
    ex.record_answer("m", "t", first, first_segments, reply)
    served(ex, first, first_segments)  # recorded after the answer, as the pipeline does
    edited = [5999] + reply[1:]
    tokens, segments, stable = build(TOOLS, SYSTEM, HISTORY + TAIL + edited, [4100, 4101])
    e = ex.explain("m", "t", tokens, segments, stable, 128)
    assert e.header_value() == "cached=128; miss=history_rewritten; at=history:130"


END_OF_TURN = [7000, 7001]  # the template's end of the reply's turn (``<|im_end|>``, ``\n``)


def next_turn(reply: list[int]) -> tuple[list[int], list[PromptSegment], int]:
    """The client's next request after ``first`` was answered ``reply``: the reply, the end of its turn, a new
    question."""
    return build(TOOLS, SYSTEM, HISTORY + TAIL + reply + END_OF_TURN, [4100, 4101])


@pytest.mark.parametrize("cut", [True, False])
def test_the_next_turn_is_a_hit_once_all_the_engine_computed_of_the_reply_is_cached(cut: bool) -> None:
    # The trial: after a reply cut by max_tokens the next turn said "cached=4734; miss=cold; at=history:4735"
    # about half the time. The engine never feeds the last token it sampled, so its cache holds the prompt and
    # the reply less that token (4734), while the target, the stable prefix rounded down to a block, reached
    # past it whenever the reply's end and the end of its turn crossed a block boundary. A reply ended by EOS
    # has all of its tokens computed (EOS, never fed, is not in the answer), and the same crossing made the end
    # of its turn (2 tokens never computed) a miss too. The cache holds all it ever could: a hit.
    ex = MissExplainer()
    first, first_segments, _ = build(TOOLS, SYSTEM, HISTORY, TAIL)  # 130 tokens
    served(ex, first, first_segments)
    reply = list(range(5000, 5029))  # 29 tokens: [130, 159); the next prompt's stable prefix ends at 161
    ex.record_answer("m", "t", first, first_segments, reply, uncomputed=1 if cut else 0, cut=cut)
    tokens, segments, stable = next_turn(reply)
    computed = 158 if cut else 159  # the reply's last sampled token has no KV when it is in the answer
    e = ex.explain("m", "t", tokens, segments, stable, computed)
    assert e.header_value() == f"cached={computed}; miss=none"
    assert not e.miss and e.missed_tokens == 0
    # partial hits off: the engine serves whole blocks only, and 144 is all it holds in whole blocks
    assert not ex.explain("m", "t", tokens, segments, stable, 144).miss
    # less than that is lost for real: the cache held the block of [128, 144) and served less
    e = ex.explain("m", "t", tokens, segments, stable, 128)
    assert (e.miss, e.cause, e.offset, e.stable) == (True, "cold", 128, 144)
    # an upstream's prompt-only history is unchanged: the reply was never cached there (a new turn, cold)
    upstream = MissExplainer()
    served(upstream, first, first_segments)
    e = upstream.explain("m", "t", tokens, segments, stable, 128)
    assert e.header_value() == "cached=128; miss=cold; at=history:130"


def test_a_cut_reply_resent_with_its_cut_end_spelled_otherwise_is_reply_cut() -> None:
    # A reply cut inside a UTF-8 character reaches the client with U+FFFD in place of the character's bytes,
    # which tokenizes otherwise: where the resent reply leaves the served ids before the last computed token,
    # the KV the engine computed from there is lost for real, and the cause names it.
    ex = MissExplainer()
    first, first_segments, _ = build(TOOLS, SYSTEM, HISTORY, TAIL)
    served(ex, first, first_segments)
    reply = list(range(5000, 5029))  # [130, 159); computed: [0, 158)
    ex.record_answer("m", "t", first, first_segments, reply, uncomputed=1, cut=True)
    resent = reply[:-2] + [6000, 6001, 6002]  # the character's first byte was in token 157
    tokens, segments, stable = next_turn(resent)
    e = ex.explain("m", "t", tokens, segments, stable, 157)
    assert e.header_value() == "cached=157; miss=reply_cut; at=history:157"
    # only the last sampled token spelled otherwise: nothing computed was lost
    tokens, segments, stable = next_turn(reply[:-1] + [6000, 6001])
    assert ex.explain("m", "t", tokens, segments, stable, 158).header_value() == "cached=158; miss=none"
    # an edit before the cut end is the client's: history_rewritten, as for any edited reply
    tokens, segments, stable = next_turn(reply[:10] + [6000] + reply[11:])
    e = ex.explain("m", "t", tokens, segments, stable, 140)
    assert e.header_value() == "cached=140; miss=history_rewritten; at=history:140"
    # the same divergence after a reply that ended by itself (its text is whole) is not reply_cut
    other = MissExplainer()
    served(other, first, first_segments)
    other.record_answer("m", "t", first, first_segments, reply)
    tokens, segments, stable = next_turn(reply[:-2] + [6000, 6001, 6002])
    assert other.explain("m", "t", tokens, segments, stable, 157).cause != "reply_cut"


def test_uncomputed_is_checked() -> None:
    ex = MissExplainer()
    tokens, segments, _ = build(TOOLS, SYSTEM, HISTORY, TAIL)
    for bad in (-1, 2, True, 1.0):
        with pytest.raises(MissExplainError, match="uncomputed"):
            ex.record_answer("m", "t", tokens, segments, [5000], uncomputed=bad)


def test_a_recorded_answer_is_checked_and_bounded_like_a_prompt():
    ex = MissExplainer(max_prompts_per_key=2)
    tokens, segments, _ = build(TOOLS, SYSTEM, HISTORY, TAIL)
    with pytest.raises(MissExplainError):
        ex.record_answer("m", "t", tokens, segments, [-1])
    with pytest.raises(MissExplainError):
        ex.record_answer("m", "t", tokens, segments[:-1], [5000])  # segments short of the prompt
    for k in range(3):
        ex.record_answer("m", "t", tokens, segments, [5000 + k])
    ex.record_answer("m", "t", tokens, segments, [5002])  # identical: refreshed, not stored twice
    assert ex.footprint()["prompts"] == 2
    ex.record_answer("m", "t", [1, 2, 3], [], [4])  # a prompt without segments: the answer still its history
    assert ex.footprint()["prompts"] == 2


def test_a_recorded_answer_extends_its_prompt_in_place():
    # Each answered request is one entry (prompt + answer), not two: the answer replaces its prompt's entry,
    # keeping its place, so a request that began after the prompt was recorded still sees it as evidence.
    ex = MissExplainer()
    first, first_segments, _ = build(TOOLS, SYSTEM, HISTORY, TAIL)
    served(ex, first, first_segments)
    before = ex.footprint()
    started = ex.epoch()  # a request begins after the prompt is recorded, before its answer
    reply = list(range(5000, 5030))
    ex.record_answer("m", "t", first, first_segments, reply)
    after = ex.footprint()
    assert after["prompts"] == before["prompts"] == 1
    assert after["bytes"] == before["bytes"] + 4 * len(reply)
    edited = reply[:17] + [5999] + reply[18:]
    tokens, segments, stable = build(TOOLS, SYSTEM, HISTORY + TAIL + edited, [4100, 4101])
    e = ex.explain("m", "t", tokens, segments, stable, 144, epoch=started)
    assert e.header_value() == "cached=144; miss=history_rewritten; at=history:147"
    # the same answer again is a refresh; another answer to the same prompt (its entry is gone) a new entry
    ex.record_answer("m", "t", first, first_segments, reply)
    assert ex.footprint()["prompts"] == 1
    ex.record_answer("m", "t", first, first_segments, reply[:5])
    assert ex.footprint()["prompts"] == 2
    # the prompt recorded again, then answered as before: that answer is recorded already and holds the prompt
    served(ex, first, first_segments)
    assert ex.footprint()["prompts"] == 3
    ex.record_answer("m", "t", first, first_segments, reply)
    assert ex.footprint()["prompts"] == 2


def test_token_granular_hits_keep_the_cause_and_the_place():
    # A prefix cache that serves up to the divergence token by token (not a multiple of 16)
    ex = MissExplainer()
    served(ex, *build(TOOLS, SYSTEM, HISTORY, TAIL)[:2])
    system = SYSTEM[:17] + list(range(7000, 7043))
    tokens, segments, stable = build(TOOLS, system, HISTORY, TAIL)
    e = ex.explain("m", "t", tokens, segments, stable, 37)
    assert (e.cached, e.cause, e.segment, e.offset) == (37, "system_changed", "system", 37)
    assert e.header_value() == "cached=37; miss=system_changed; at=system:37"


@given(
    recorded=st.lists(st.lists(st.integers(0, 3), min_size=0, max_size=80), max_size=4),
    prompt=st.lists(st.integers(0, 3), min_size=1, max_size=80),
    cached=st.integers(0, 90),
    stable_cut=st.integers(0, 80),
    marked=st.booleans(),
    granularity=st.sampled_from([None, 1, 16]),
)
@settings(max_examples=300, deadline=None)
def test_a_miss_always_starts_at_or_after_the_reported_cached_tokens(
    recorded, prompt, cached, stable_cut, marked, granularity
):
    ex = MissExplainer()
    for old in recorded:
        ex.record("m", "t", old, [PromptSegment("system", 0, len(old))])
        if marked:
            ex.mark_cached("m", "t", old)
    half = len(prompt) // 2
    segments = [PromptSegment("system", 0, half), PromptSegment("history", half, len(prompt))]
    e = ex.explain("m", "t", prompt, segments, min(stable_cut, len(prompt)), cached, granularity=granularity)
    assert e.cached == min(cached, len(prompt))
    if e.miss:
        assert e.offset is not None and e.offset >= e.cached
        assert f"cached={e.cached}; " in e.header_value()


# ---- the tryout's three inconsistencies (A1 concurrency, A2 volatile for edits, A3 miss=none at cached=0) ----

TEMPLATE_HEAD = [1, 2, 3]  # "<|im_start|>system\n": what any two system prompts share


def test_a_concurrent_first_request_is_cold_not_evicted() -> None:
    # 10 requests share a never-seen system prompt; the one that computed it (cached=0) is explained after
    # peers that finished first recorded the same prompt and marked its blocks. Before: "miss=evicted;
    # cached_ago=0" (by_cause.evicted grew while the engine evicted nothing).
    ex = MissExplainer()
    tokens, segments, stable = build([], TEMPLATE_HEAD + SYSTEM, HISTORY, TAIL)
    started = ex.epoch()  # the computing request begins
    for _ in range(9):  # its peers finish first, served from the blocks it computed
        served(ex, tokens, segments)
    e = ex.explain("m", "t", tokens, segments, stable, 0, epoch=started)
    assert (e.cause, e.segment, e.offset, e.cached_ago) == ("cold", "system", 0, None)
    assert e.header_value() == "cached=0; miss=cold; at=system:0"
    # without the epoch the peers' records are taken as evidence: the tryout's wrong answer
    assert ex.explain("m", "t", tokens, segments, stable, 0).cause == "evicted"
    # a later request that really lost those blocks is evicted
    e = ex.explain("m", "t", tokens, segments, stable, 0, epoch=ex.epoch())
    assert (e.cause, e.offset) == ("evicted", 0)


def test_a_concurrent_first_request_is_cold_whatever_an_unrelated_earlier_prompt_was() -> None:
    # A never-seen system prompt after an unrelated one of the same tenant (sharing only the template's header)
    ex = MissExplainer()
    served(ex, *build([], TEMPLATE_HEAD + list(range(7000, 7060)), HISTORY, TAIL)[:2])
    tokens, segments, stable = build([], TEMPLATE_HEAD + SYSTEM, HISTORY, TAIL)
    started = ex.epoch()
    answers = set()
    for peers in range(4):  # however many peers finished before its explanation
        for _ in range(peers):
            served(ex, tokens, segments)
        answers.add(ex.explain("m", "t", tokens, segments, stable, 0, epoch=started).header_value())
    assert answers == {"cached=0; miss=cold; at=system:0"}


def test_an_ordinary_edit_of_the_system_prompt_is_system_changed() -> None:
    # "Alpha helper. ..." then "Beta helper. ...": they differ at system:3, inside the first block. Before:
    # "cached=0; miss=volatile; at=system:3" with no slot.
    ex = MissExplainer()
    served(ex, *build([], TEMPLATE_HEAD + [500] + SYSTEM, HISTORY, TAIL)[:2])
    tokens, segments, stable = build([], TEMPLATE_HEAD + [501] + SYSTEM, HISTORY, TAIL)
    e = ex.explain("m", "t", tokens, segments, stable, 0)
    assert e.header_value() == "cached=0; miss=system_changed; at=system:3"
    # a sentence inserted before an unchanged value: system_changed too
    inserted = TEMPLATE_HEAD + [500] + SYSTEM[:20] + [8800, 8801, 8802, 8803, 8804] + SYSTEM[20:]
    tokens, segments, stable = build([], inserted, HISTORY, TAIL)
    e = ex.explain("m", "t", tokens, segments, stable, 16)
    assert e.header_value() == "cached=16; miss=system_changed; at=system:24"


def test_cached_zero_is_never_a_hit_of_a_cacheable_prompt() -> None:
    # system "You are terse." (stable prefix shorter than a block) + a question: before, "cached=0; miss=none"
    ex = MissExplainer()
    tokens, segments, stable = build([], list(range(2000, 2010)), [], list(range(4000, 4030)))
    e = ex.explain("m", "t", tokens, segments, stable, 0)
    assert (e.miss, e.stable, e.cause, e.segment, e.offset) == (True, 32, "cold", "system", 0)
    assert e.header_value() == "cached=0; miss=cold; at=system:0"
    served(ex, tokens, segments)
    assert ex.explain("m", "t", tokens, segments, stable, 32).header_value() == "cached=32; miss=none"
    # a user message only
    tokens, segments, stable = build([], [], [], list(range(4100, 4140)))
    e = ex.explain("m", "t", tokens, segments, stable, 0)
    assert (e.miss, e.stable, e.cause, e.offset) == (True, 32, "cold", 0)
    # a prompt shorter than a block and its last token: nothing of it can be cached
    tokens, segments, stable = build([], [2000, 2001, 2002], [], [4000, 4001])
    e = ex.explain("m", "t", tokens, segments, stable, 0)
    assert e.header_value() == "cached=0; miss=below_minimum; at=tail:5"
    # the empty prompt is nothing to miss
    assert not ex.explain("m", "t", [], [], 0, 0).miss


# ---- the definition (docs/cache-explanations.md) as properties ----

SEGMENTS_OF = ("tools", "system", "documents", "history")


@st.composite
def prompts(draw):
    """A prompt of up to four stable segments and a tail over a small alphabet (so prompts share prefixes)."""
    parts = [draw(st.lists(st.integers(0, 3), max_size=40)) for _ in SEGMENTS_OF]
    tail = draw(st.lists(st.integers(0, 3), min_size=1, max_size=20))
    segments, pos = [], 0
    for name, part in zip((*SEGMENTS_OF, "tail"), (*parts, tail), strict=True):
        segments.append(PromptSegment(name, pos, pos + len(part)))
        pos += len(part)
    return sum(parts, []) + tail, segments, pos - len(tail)


def _tail_only(n: int) -> list[PromptSegment]:
    """The segments of a prompt that is all tail (``prompts()``'s shape)."""
    return [PromptSegment(name, 0, 0) for name in SEGMENTS_OF] + [PromptSegment("tail", 0, n)]


_P14 = [0, 1, 1, 0, 1, 1, 1, 0, 0, 0, 0, 1, 0, 0]
_P10 = [0, 0, 0, 0, 1, 0, 1, 0, 0, 0]


@given(
    history=st.lists(
        st.tuples(
            prompts(), st.booleans(), st.none() | st.lists(st.integers(0, 3), max_size=40), st.booleans()
        ),
        max_size=4,
    ),
    concurrent=st.lists(prompts(), max_size=3),
    prompt=prompts(),
    cached=st.integers(0, 200),
    granularity=st.sampled_from([None, 1, 16]),
    min_cacheable=st.sampled_from([None, 32]),
    spans=st.lists(st.tuples(st.integers(0, 180), st.integers(1, 5)), max_size=2),
    extends=st.none() | st.tuples(st.integers(0, 3), st.integers(0, 2)),
)
@example(  # found by Hypothesis: a prompt answered with nothing, then recorded again as a plain prompt, keeps
    # its answer (the engine computed all 14 of its tokens: no full block), and the next turn extends it
    history=[
        ((_P14, _tail_only(14), 0), False, [], False),
        (([0], _tail_only(1), 0), False, None, False),
        ((_P14, _tail_only(14), 0), False, None, False),
    ],
    concurrent=[],
    prompt=([0, 0, 0], _tail_only(3), 0),
    cached=0,
    granularity=None,
    min_cacheable=None,
    spans=[],
    extends=(0, 0),
)
@example(  # found by Hypothesis: two answers of one prompt ([0, 0], then [0]) tie on the shared tokens; the
    # next turn extends the first with its last token spelled otherwise: the one that goes on past the shared
    # tokens (the first) explains it, not the most recent (which the model took before the tie rule)
    history=[
        ((_P10, _tail_only(10), 0), False, [0, 0], False),
        (([0], _tail_only(1), 0), False, None, False),
        ((_P10, _tail_only(10), 0), False, [0], False),
    ],
    concurrent=[],
    prompt=([0, 0, 0, 0, 0], _tail_only(5), 0),
    cached=0,
    granularity=None,
    min_cacheable=None,
    spans=[],
    extends=(0, 1),
)
@settings(max_examples=400, deadline=None)
def test_the_classifier_follows_the_definition(
    history, concurrent, prompt, cached, granularity, min_cacheable, spans, extends
):
    def replay(explainer: MissExplainer) -> None:  # earlier requests, some with their served answer
        for (old, old_segments, _), marked, answer, cut in history:
            explainer.record("m", "t", old, old_segments)
            if marked:
                explainer.mark_cached("m", "t", old)
            if answer is not None:
                uncomputed = 1 if cut and answer else 0
                explainer.record_answer("m", "t", old, old_segments, answer, uncomputed=uncomputed, cut=cut)

    ex = MissExplainer(clock=Clock())
    replay(ex)
    before = ex.epoch()
    for tokens, segments, _ in concurrent:  # requests finishing while this one is in flight
        served(ex, tokens, segments)
    tokens, segments, stable = prompt
    if extends is not None and history:  # the next turn of an earlier request: its prompt, its answer (less a
        # few tokens: a cut end spelled otherwise), then this prompt
        (old, _, _), _, answer, _ = history[extends[0] % len(history)]
        lead = old + (answer or [])
        lead = lead[: len(lead) - extends[1]] + [9] * extends[1]
        segments = [PromptSegment("history", 0, len(lead))] + [
            PromptSegment(s.name, s.start + len(lead), s.end + len(lead)) for s in segments
        ]
        tokens, stable = lead + tokens, stable + len(lead)
        cached = max(0, len(lead) - cached % 20)  # around what the engine computed of it
    volatile = [VolatileSpan(a, a + k, f"learned.{a}") for a, k in spans]
    e = ex.explain(
        "m",
        "t",
        tokens,
        segments,
        stable,
        cached,
        granularity=granularity,
        min_cacheable=min_cacheable,
        volatile_spans=volatile,
        epoch=before,
    )
    n, unit = len(tokens), granularity or 16
    # the concurrent requests change nothing: the same answer as before they finished
    fresh = MissExplainer(clock=Clock())
    replay(fresh)
    again = fresh.explain(
        "m",
        "t",
        tokens,
        segments,
        stable,
        cached,
        granularity=granularity,
        min_cacheable=min_cacheable,
        volatile_spans=volatile,
    )
    assert e == again
    assert e.cached == min(cached, n)
    # a miss exactly when fewer tokens were served than the target, or nothing at all
    target = min(stable, n - 1) - min(stable, n - 1) % unit or (n - 1) - (n - 1) % unit
    # ... at most what the engine computed of the nearest earlier prompt, when that is a prompt followed by its
    # served answer and this prompt shares all of that computed part (the index: one entry per prompt, an
    # answer replacing its prompt's entry; the most recently recorded first among equals)
    index: dict[tuple[int, ...], int | None] = {}
    for (old, _, _), _, answer, cut in history:
        index[tuple(old)] = index.pop(tuple(old), None)  # a prompt recorded again keeps its entry's answer
        if answer is not None:
            del index[tuple(old)]
            full = tuple(old) + tuple(answer)
            index.pop(full, None)
            index[full] = len(full) - (1 if cut and answer else 0)
    nearest = None  # (shared tokens, computed, its length); ties: one going on past the shared tokens, then
    # the most recent (an answer the client edited says what came there before: miss_entries.nearest_entry)
    for old, computed in reversed(index.items()):
        d = next((i for i, (a, b) in enumerate(zip(tokens, old, strict=False)) if a != b), min(n, len(old)))
        if nearest is None or d > nearest[0] or (d == nearest[0] and nearest[2] <= d < len(old)):
            nearest = (d, computed, len(old))
    if (
        min(cached, n) < target
        and nearest is not None
        and nearest[1] is not None
        and nearest[0] >= nearest[1]
    ):
        target = min(target, nearest[1] - nearest[1] % unit)
    assert e.stable == target
    assert e.miss == (e.cached < target or e.cached == 0)
    if not e.miss:
        assert e.header_value() == f"cached={e.cached}; miss=none"
        return
    assert e.offset >= e.cached and e.segment in ("tools", "system", "documents", "history", "tail")
    assert (e.cause == "below_minimum") == (
        target == 0 or (min_cacheable is not None and target < min_cacheable)
    )
    # volatile only where a known volatile span covers the divergence, and it names the slot
    if e.cause == "volatile":
        covering = [s for s in volatile if s.start - 1 <= e.offset < s.end]
        assert covering and e.slot == covering[0].slot
    else:
        assert e.slot is None
    # evicted only when the first uncached block was marked cached before the request began
    first = e.cached // 16
    known_before = any(
        marked and len(old) >= 16 * (first + 1) and old[: 16 * (first + 1)] == tokens[: 16 * (first + 1)]
        for (old, _, _), marked, _, _ in history
    )
    if e.cause == "evicted":
        assert known_before and e.cached_ago is not None
    elif e.cause != "below_minimum" and first * 16 < target:
        assert not known_before
    # a divergence cause needs an earlier prompt (or one followed by its served answer) that shares the
    # tokens up to the offset
    if e.cause in ("tools_changed", "system_changed", "history_rewritten", "volatile", "reply_cut"):
        assert any(
            old[: e.offset] == tokens[: e.offset]
            and old[e.offset : e.offset + 1] != tokens[e.offset : e.offset + 1]
            for (prompt_tokens, _, _), _, answer, _ in history
            for old in (prompt_tokens, prompt_tokens + (answer or []))
        )


def test_an_identical_prompt_among_many_is_refreshed_and_the_index_follows_evictions() -> None:
    """``record`` finds an identical earlier prompt through its digest index: refreshed (moved to the most
    recent place), never stored twice; evicted prompts leave the index, and one recorded again is stored anew."""
    clock = Clock()
    ex = MissExplainer(max_prompts_per_key=4, clock=clock)
    prompts = [[7, 7, i] * 20 for i in range(6)]
    segments = [PromptSegment("system", 0, 60)]
    for tokens in prompts[:4]:
        ex.record("m", "t", tokens, segments)
    clock.now += 5
    ex.record("m", "t", prompts[0], segments)  # identical to the oldest: refreshed, not added
    assert ex.footprint()["prompts"] == 4
    ex.record("m", "t", prompts[4], segments)  # evicts the least recent: prompts[1], not the refreshed [0]
    stored = [list(entry.tokens) for entry in ex._keys[("m", "t")].values()]
    assert stored == [prompts[2], prompts[3], prompts[0], prompts[4]]
    ex.record("m", "t", prompts[1], segments)  # evicted before: stored anew (evicting prompts[2])
    stored = [list(entry.tokens) for entry in ex._keys[("m", "t")].values()]
    assert stored == [prompts[3], prompts[0], prompts[4], prompts[1]]
    index = {seq for (key, _), seq in ex._seqs.items()}
    assert index == set(ex._keys[("m", "t")]) and len(ex._seqs) == 4


def test_a_prompt_recorded_again_keeps_the_answer_an_earlier_request_saw() -> None:
    """Before: a concurrent request serving the same tokens as an answered entry (its answer empty) erased that
    entry's answer record, so a request whose epoch predated it was explained otherwise (found by Hypothesis in
    ``test_the_classifier_follows_the_definition``)."""
    old = [0, 1, 0, 1, 0, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0, 0, 0]
    old_segments = [PromptSegment("tail", 0, 18)]
    prompt = old + [0] * 15
    segments = [PromptSegment("history", 0, 32), PromptSegment("tail", 32, 33)]

    def explained(concurrent: bool) -> MissExplanation:
        ex = MissExplainer(clock=Clock())
        ex.record("m", "t", old, old_segments)
        ex.record_answer("m", "t", old, old_segments, [])
        before = ex.epoch()
        if concurrent:
            served(ex, [0], [PromptSegment("tail", 0, 1)])
            served(ex, old, old_segments)
        return ex.explain("m", "t", prompt, segments, 32, 0, epoch=before)

    assert explained(concurrent=True) == explained(concurrent=False)


# ---- replicas: a prefix cached on another replica than the one that served the turn ----------------------


def test_a_prefix_cached_only_on_another_replica_is_other_replica_not_evicted() -> None:
    """A trial: a router sent a conversation's turn to another replica, which had never held its prefix, and
    the explanation said ``evicted`` (the explainer knew what was cached per model, not per replica)."""
    clock = Clock(1000.0)
    ex = MissExplainer(clock=clock)
    tokens, segments, stable = build(TOOLS, SYSTEM, HISTORY, TAIL)
    ex.record("m", "t", tokens, segments)
    ex.mark_cached("m", "t", tokens, replica="http://a")
    clock.now = 1007.0
    e = ex.explain("m", "t", tokens, segments, stable, 0, replica="http://b")
    assert (e.cause, e.segment, e.offset, e.cached_ago) == ("other_replica", "tools", 0, 7.0)
    assert e.header_value() == "cached=0; miss=other_replica; at=tools:0; cached_ago=7"
    # served where it was cached, and less came back: the replica evicted it
    assert ex.explain("m", "t", tokens, segments, stable, 16, replica="http://a").cause == "evicted"
    # no replica known (an embedded engine): what was cached and is not is evicted, as before
    assert ex.explain("m", "t", tokens, segments, stable, 0).cause == "evicted"
    # once the other replica has served it too, a loss there is an eviction by it
    ex.mark_cached("m", "t", tokens, replica="http://b")
    assert ex.explain("m", "t", tokens, segments, stable, 0, replica="http://b").cause == "evicted"


def test_a_replica_that_cached_the_prefix_after_the_request_began_is_no_evidence() -> None:
    ex = MissExplainer()
    tokens, segments, stable = build(TOOLS, SYSTEM, HISTORY, TAIL)
    ex.record("m", "t", tokens, segments)
    ex.mark_cached("m", "t", tokens, replica="http://a")
    started = ex.epoch()  # a request begins, routed to b
    ex.mark_cached("m", "t", tokens, replica="http://b")  # a peer served on b finishes first
    e = ex.explain("m", "t", tokens, segments, stable, 0, epoch=started, replica="http://b")
    assert e.cause == "other_replica"  # when it began, only a held the prefix


def test_a_chain_remembers_its_newest_replicas_only() -> None:
    from gateway.service.miss_explain import MAX_PLACES

    ex = MissExplainer()
    tokens, segments, stable = build(TOOLS, SYSTEM, HISTORY, TAIL)
    ex.record("m", "t", tokens, segments)
    for i in range(MAX_PLACES + 1):
        ex.mark_cached("m", "t", tokens, replica=f"http://r{i}")
    newest = ex.explain("m", "t", tokens, segments, stable, 0, replica=f"http://r{MAX_PLACES}")
    oldest = ex.explain("m", "t", tokens, segments, stable, 0, replica="http://r0")
    assert (newest.cause, oldest.cause) == ("evicted", "other_replica")
