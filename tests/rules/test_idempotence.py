"""Property tests: canonicalizing a canonical request changes nothing, and every hoisted value stays in the
prompt, for system prompts composed at random from the corpora, volatile lines and whitespace noise."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench.corpora import load_prompts, load_stable_lines
from rules import load_ruleset
from rules.actions import normalize_text
from rules.model import NormalizeOptions
from tests.rules.helpers import all_text

DEFAULT = load_ruleset(["default"])
STABLE = [entry.text for entry in load_stable_lines()]
VOLATILE = sorted(
    {
        line
        for case in load_prompts()
        for variant in case.variants
        for line in variant.messages[0]["content"].split("\n")
        if any(span in line for span in variant.spans)
    }
)
FENCES = ["```", "```python", "~~~", "    ```", "````markdown"]
NOISE = ["", "  ", "\t", "   \t"]

piece = st.one_of(
    st.sampled_from(STABLE),
    st.sampled_from(VOLATILE),
    st.sampled_from(FENCES),
    st.just(""),
    st.text(alphabet=" \t\r\nab:.-`#*", max_size=12),
)


@st.composite
def system_prompts(draw: st.DrawFn) -> str:
    lines = draw(st.lists(piece, min_size=1, max_size=14))
    noisy = [line + draw(st.sampled_from(NOISE)) for line in lines]
    separator = draw(st.sampled_from(["\n", "\r\n", "\n\n"]))
    return separator.join(noisy)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(system=system_prompts(), question=st.sampled_from(["Hi", "What now?", "  spaced  \n"]))
def test_canonicalization_is_idempotent_and_keeps_every_hoisted_value(system: str, question: str) -> None:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    once = DEFAULT.apply(messages)
    twice = DEFAULT.apply(once.messages)
    assert twice.messages == once.messages
    assert twice.hoisted == once.hoisted
    assert twice.applied == {}
    text = all_text(once.messages)
    for value in once.hoisted:
        assert value in text


@settings(max_examples=200, deadline=None)
@given(
    text=st.text(alphabet=" \t\r\nab`~-#*:", max_size=60),
    options=st.builds(
        NormalizeOptions,
        skip_code=st.booleans(),
        hard_breaks=st.booleans(),
        blank_lines=st.sampled_from([None, 1, 2]),
    ),
)
def test_whitespace_normalization_is_a_fixed_point(text: str, options: NormalizeOptions) -> None:
    once = normalize_text(text, options)
    assert normalize_text(once, options) == once


def test_a_block_in_an_empty_user_message_is_not_taken_for_a_created_message(tmp_path) -> None:
    """A value hoisted into an empty user message (``user_prefix``) must come back out of that message, not as a
    ``new_user`` message the rules created: the second run removed the emptied message, merged two turns and moved
    the block to the end (a hypothesis example from ``test_canonical``)."""
    rules = tmp_path / "hoist_any.yaml"
    rules.write_text(
        "rules:\n  - id: t.hoist-any\n    match: {role: any, pattern: 'NONCE-[0-9]+'}\n    action: hoist\n"
    )
    ruleset = load_ruleset(["default", str(rules)], placement="last_user_prefix")
    messages = [
        {"role": "assistant", "content": [{"type": "text", "text": "NONCE-123 here"}]},
        {"role": "user", "content": ""},
        {"role": "assistant", "content": [{"type": "text", "text": ""}]},
        {"role": "user", "content": "Question: who?"},
    ]
    once = ruleset.apply(messages, None)
    assert "NONCE-123" in once.messages[1]["content"] and once.messages[1]["role"] == "user"
    twice = ruleset.apply(once.messages, once.tools)
    assert twice.messages == once.messages
    assert [m["role"] for m in twice.messages] == ["assistant", "user", "assistant", "user"]
