"""Served turns (``engine.served_turns``): a reply whose generated ids are not the canonical encoding of its text
comes back in the next prompt with the ids that were served, so the prefix cache serves it whole.

Through the embedded engine: an agent loop of constrained tool calls on the tiny checkpoint (seeded sampling; seed 0
spells the first call with other ids than the tokenizer gives its text), then
each turn's cached tokens against the KV the previous turn computed, with and without the memo; cache on == cache
off for a conversation that holds a served turn. Then the memo alone: what it stores, scopes, bounds, offsets.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from tokenizers import normalizers

from engine.api import Constraint, EngineConfig, SamplingParams
from engine.llm_engine import LLMEngine
from engine.served_turns import ServedTurns
from engine.tokenizer import Tokenizer
from tests.engine.checkpoints import EOS, IM_START, train_tokenizer
from tests.engine.engine_helpers import tiny_checkpoint

LOOKUP = {
    "type": "function",
    "function": {
        "name": "lookup",
        "parameters": {
            "type": "object",
            "properties": {
                "query": {"enum": ["paris france", "lisbon", "the lazy dog"]},
                "n": {"type": "integer", "minimum": 0, "maximum": 99},
            },
            "required": ["query", "n"],
            "additionalProperties": False,
        },
    },
}
CALL = Constraint("tool_calls", tools=(LOOKUP,), tool_choice="required", parallel_tool_calls=False)
QUESTION = [
    {"role": "system", "content": "the quick brown fox"},
    {"role": "user", "content": "what is the capital of france"},
]
TURNS = 5


def fresh_tokenizer(served: bool = True) -> Tokenizer:
    """The tiny checkpoint's tokenizer, with its own (empty) memos; ``served=False`` turns served turns off."""
    tok = tiny_checkpoint().tokenizer
    own = Tokenizer(tok.backend, tok.chat_template, tok.special_tokens, tok.eos_token_ids)
    own.served.enabled = served
    return own


def engine_on(tok: Tokenizer, **config) -> LLMEngine:
    """An engine on the tiny checkpoint's weights with ``tok`` (it records into, and prompts come from, it),
    caching generated tokens' KV (served turns run only then: ``EngineConfig.cache_generated_kv``)."""
    ck = tiny_checkpoint()
    cfg = replace(EngineConfig(num_blocks=512, cache_generated_kv=True), **config)
    return LLMEngine(ck.model, cfg, ck.model_id, tok)


def test_without_cached_generated_kv_no_turn_is_served():
    """By default the reply's KV is not cached, so its served ids would save nothing and would make the next
    prompt's ids depend on this process's history (a cold gateway spells the reply canonically)."""
    tok = fresh_tokenizer()
    eng = engine_on(tok, cache_generated_kv=False)
    req = eng.add_request(
        tok.render_chat(QUESTION, [LOOKUP]), SamplingParams(max_tokens=40, temperature=0.0, constraint=CALL)
    )
    eng.run_to_completion()
    assert req.finish_reason in ("stop", "length") and req.output_token_ids
    assert (tok.served.recorded, tok.served.canonical, tok.served.entries) == (0, 0, 0)
    on = fresh_tokenizer()
    eng = engine_on(on)
    eng.add_request(
        on.render_chat(QUESTION, [LOOKUP]), SamplingParams(max_tokens=40, temperature=0.0, constraint=CALL)
    )
    eng.run_to_completion()
    assert on.served.recorded + on.served.canonical == 1  # the same reply is offered with the opt-in


def agent_loop(tok: Tokenizer) -> list[tuple[int, int, int, bool]]:
    """``TURNS`` tool-call turns resent whole (each call answered by a tool result as a user turn). Per turn:
    (prompt tokens, cached tokens, KV tokens the turn computed = prompt + reply - 1, reply canonical)."""
    eng = engine_on(tok)
    messages = list(QUESTION)
    turns = []
    for turn in range(TURNS):
        prompt = tok.render_chat(messages, scope="tenant")
        assert tok.decode(prompt, skip_special_tokens=False) == tok.apply_chat_template(messages)
        params = SamplingParams(max_tokens=200, temperature=1.0, seed=turn, constraint=CALL)
        req = eng.add_request(prompt, params, cache_salt="tenant")
        out = eng.run_to_completion()[req.request_id]
        assert out.finish_reason == "stop" and out.full_text.endswith("</tool_call>")
        reply = req.output_token_ids
        canonical = tok.encode(out.full_text) == reply
        turns.append((len(prompt), out.usage.cached_tokens, len(prompt) + len(reply) - 1, canonical))
        messages += [
            {"role": "assistant", "content": out.full_text},
            {"role": "user", "content": "<tool_response>\nparis france\n</tool_response>"},
        ]
    return turns


def test_every_tool_call_turn_is_served_whole_from_the_cache():
    tok = fresh_tokenizer()
    turns = agent_loop(tok)
    assert not all(canonical for *_, canonical in turns)  # the case this is about happens
    for (_, _, computed, _), (_, cached, _, _) in zip(turns, turns[1:], strict=False):
        assert cached == computed  # all the KV the previous turn computed, the reply included
    assert tok.served.recorded == sum(not c for *_, c in turns) and tok.served.hits > 0


def test_without_served_turns_a_non_canonical_reply_is_recomputed():
    turns = agent_loop(fresh_tokenizer(served=False))
    lost = [
        computed - cached for (_, _, computed, _), (_, cached, _, _) in zip(turns, turns[1:], strict=False)
    ]
    after_non_canonical = [loss for loss, (*_, canonical) in zip(lost, turns, strict=False) if not canonical]
    assert after_non_canonical and all(loss > 0 for loss in after_non_canonical)  # the defect, reproduced


def test_cache_on_equals_cache_off_with_a_served_turn():
    outputs = []
    for caching in (True, False):
        tok = fresh_tokenizer()
        eng = engine_on(tok, enable_prefix_caching=caching)
        prompt = tok.render_chat(QUESTION, scope="t")
        req = eng.add_request(
            prompt, SamplingParams(max_tokens=200, temperature=1.0, seed=0, constraint=CALL), cache_salt="t"
        )
        first = eng.run_to_completion()[req.request_id]
        assert tok.served.recorded == 1  # seed 0 spells the call non-canonically (see the loop test)
        messages = [
            *QUESTION,
            {"role": "assistant", "content": first.full_text},
            {"role": "user", "content": "ok"},
        ]
        second = tok.render_chat(messages, scope="t")
        assert second[: len(prompt) + len(req.output_token_ids)] == prompt + req.output_token_ids
        req2 = eng.add_request(
            second, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True), cache_salt="t"
        )
        eng.run_to_completion()
        outputs.append((second, req2.output_token_ids))
    assert outputs[0] == outputs[1]


def test_a_reply_cut_by_a_stop_string_is_not_remembered():
    tok = fresh_tokenizer()
    eng = engine_on(tok)
    prompt = tok.render_chat(QUESTION, scope="t")
    answer = Constraint("json_schema", json_schema=LOOKUP["function"]["parameters"])
    for seed in range(4):
        params = SamplingParams(max_tokens=200, temperature=1.0, seed=seed, constraint=answer, stop=['"n"'])
        req = eng.add_request(prompt, params, cache_salt="t")
        out = eng.run_to_completion()[req.request_id]
        assert out.stop_string == '"n"'
    assert tok.served.entries == 0 and tok.served.recorded == 0 and tok.served.canonical == 0


# ---- the memo alone -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained():
    return train_tokenizer()


def spelled_apart(backend, ids: list[int]) -> list[int]:
    """``ids`` with every multi-byte token replaced by its single-character tokens (same text, other ids)."""
    out = []
    for token_id in ids:
        spelling = backend.id_to_token(token_id)
        parts = [backend.token_to_id(ch) for ch in spelling]
        out.extend(parts if len(spelling) > 1 and None not in parts else [token_id])
    return out


def turn(backend, prompt_text: str, reply: str, apart: bool = True) -> tuple[list[int], list[int]]:
    prompt = backend.encode(prompt_text, add_special_tokens=False).ids
    ids = backend.encode(reply, add_special_tokens=False).ids
    return prompt, spelled_apart(backend, ids) if apart else ids


def test_a_non_canonical_reply_is_stored_with_its_turn_piece_and_given_back_in_its_scope(trained):
    served = ServedTurns(trained)
    assert served.enabled
    prompt, reply = turn(trained, f"{IM_START}user\nhi{EOS}\n{IM_START}assistant\n", "hello world")
    assert reply != trained.encode("hello world", add_special_tokens=False).ids
    assert served.record("a", prompt, reply)
    lead = trained.encode("assistant\n", add_special_tokens=False).ids
    ids, starts = served.lookup("a", "assistant\nhello world")
    assert list(ids) == lead + reply
    assert trained.decode(list(ids)) == "assistant\nhello world"
    assert list(starts) == sorted(starts) and starts[0] == 0
    assert served.lookup("b", "assistant\nhello world") is None  # another tenant's turn is never seen
    assert served.lookup("a", "assistant\nhello world!") is None


def test_a_canonical_reply_is_not_stored_and_replaces_an_older_split(trained):
    served = ServedTurns(trained)
    prompt, reply = turn(trained, f"{IM_START}assistant\n", "hello world")
    assert served.record("a", prompt, reply) and served.entries == 1
    prompt, canonical = turn(trained, f"{IM_START}assistant\n", "hello world", apart=False)
    assert not served.record("a", prompt, canonical)
    assert served.entries == 0 and served.canonical == 1 and not served.holds("a")


def test_a_reply_repeating_an_earlier_turn_keeps_that_turns_spelling(trained):
    """A fresh-user trial: an agent made the same tool call on turns 1 and 3. Turn 1's reply was resent
    canonically spelled (prefilled and cached so), turn 3's ids were stored by text, and from turn 4 on the
    earlier call took turn 3's ids: the prompt parted from the cache at the first call and the whole history
    after it was prefilled again (``miss=evicted; cached_ago=0``). A text the conversation already holds keeps
    its spelling: a repeat is not stored, nor does a canonical repeat forget an older split."""
    served = ServedTurns(trained)
    turn_1 = f"{IM_START}user\nhi{EOS}\n{IM_START}assistant\n"
    history = f"{turn_1}hello world{EOS}\n{IM_START}user\nagain{EOS}\n{IM_START}assistant\n"
    prompt, reply = turn(trained, history, "hello world")
    assert not served.record("a", prompt, reply)  # non-canonical, but turn 1 already spells the text
    assert (served.entries, served.repeated) == (0, 1)
    assert served.lookup("a", "assistant\nhello world") is None
    # a first reply stored split, then the same text again, canonical: the split stays (turn 1 was cached so)
    prompt, reply = turn(trained, turn_1, "hello world")
    assert served.record("a", prompt, reply)
    prompt, canonical = turn(trained, history, "hello world", apart=False)
    assert not served.record("a", prompt, canonical)
    assert served.lookup("a", "assistant\nhello world") is not None
    # another conversation's first such reply still replaces an older split of the same text
    prompt, canonical = turn(trained, turn_1, "hello world", apart=False)
    assert not served.record("a", prompt, canonical) and served.entries == 0


def test_a_reply_cut_short_of_its_ids_is_stored_as_the_client_got_it(trained):
    """A fresh-user trial: an answer that went on into a repeat of its tool call (dropped) was offered with all
    its ids, whose text never comes back; its next turn lost most of the call. The ids that spell the text the
    client got are stored; a cut that falls inside a token stores nothing."""
    served = ServedTurns(trained)
    prompt, reply = turn(trained, f"{IM_START}assistant\n", "hello world hello")
    returned = "hello world"
    assert served.record("a", prompt, reply, returned=returned)
    ids, _ = served.lookup("a", "assistant\nhello world")
    assert (
        trained.decode(list(ids)) == "assistant\nhello world"
        and served.lookup("a", "assistant\nhello world hello") is None
    )
    other = ServedTurns(trained)
    assert not other.record("a", prompt, reply, returned="hellX world")  # not what the ids spell
    long_ids = trained.encode("hello world hello", add_special_tokens=False).ids
    assert not other.record("a", prompt, long_ids, returned="hello wor")  # no token ends there
    assert other.entries == 0


@pytest.mark.parametrize(
    "reply",
    [
        [2],  # an added token (EOS) inside the reply
        "bytes",  # half a character
        f"x{EOS}y",  # the text of an added token, spelled with ordinary tokens
    ],
)
def test_replies_that_cannot_come_back_whole_are_skipped(trained, reply):
    served = ServedTurns(trained)
    prompt = trained.encode(f"{IM_START}assistant\n", add_special_tokens=False).ids
    if reply == "bytes":
        ids = trained.encode("café", add_special_tokens=False).ids
        reply = spelled_apart(trained, ids)[:-1]
    elif isinstance(reply, str):
        reply = [trained.token_to_id(ch) for ch in reply]  # printable ASCII: its own byte-level spelling
    assert not served.record("a", prompt, reply)
    assert served.entries == 0


def test_bounds_evict_least_recently_used(trained):
    served = ServedTurns(trained, max_entries=2)
    prompt = trained.encode(f"{IM_START}assistant\n", add_special_tokens=False).ids
    texts = ["hello world", "the lazy dog", "quick brown fox"]
    for text in texts[:2]:
        served.record("a", prompt, turn(trained, "", text)[1])
    assert served.lookup("a", "assistant\n" + texts[0]) is not None  # now the most recently used
    served.record("a", prompt, turn(trained, "", texts[2])[1])
    assert served.entries == 2 and served.lookup("a", "assistant\n" + texts[1]) is None
    small = ServedTurns(trained, max_chars=30)
    for text in texts:
        small.record("a", prompt, turn(trained, "", text)[1])
    assert small.chars <= 30
    assert not ServedTurns(trained, max_turn_chars=5).record("a", prompt, turn(trained, "", texts[0])[1])
    small.clear()
    assert small.entries == 0 and small.chars == 0 and not small.holds("a")


def test_a_tokenizer_whose_pieces_cannot_be_cut_never_stores(trained):
    tok = train_tokenizer()
    tok.normalizer = normalizers.NFKC()
    served = ServedTurns(tok)
    assert not served.enabled
    prompt, reply = turn(tok, f"{IM_START}assistant\n", "hello world")
    assert not served.record("a", prompt, reply) and served.entries == 0


def test_prompts_and_offsets_take_the_served_ids_in_their_scope_only():
    tok = fresh_tokenizer()
    prompt = tok.render_chat(QUESTION, scope="a")
    reply = spelled_apart(tok.backend, tok.encode("hello world"))
    assert tok.served.record("a", prompt, reply)
    messages = [
        *QUESTION,
        {"role": "assistant", "content": "hello world"},
        {"role": "user", "content": "and?"},
    ]
    text = tok.apply_chat_template(messages)
    ids = tok.render_chat(messages, scope="a")
    assert ids[: len(prompt) + len(reply)] == prompt + reply
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert ids[len(prompt) + len(reply) :] == tok.encode(text[len(tok.decode(prompt + reply, False)) :])
    offset_ids, starts = tok.encode_with_offsets(text, "a")
    assert offset_ids == ids and len(starts) == len(ids) and starts == sorted(starts)
    assert tok.render_chat(messages, scope="b") == tok.encode(text)  # another tenant: the canonical ids
    assert tok.encode_with_offsets(text, "b")[0] == tok.encode(text)
