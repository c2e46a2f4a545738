"""Responses ``truncation: "auto"``: which input items may be dropped, in what units, and how many per try."""

from __future__ import annotations

from gateway.protocols.openai.responses import responses_to_chat_body
from gateway.protocols.openai.responses_truncation import droppable_groups, groups_to_drop, without_oldest

AGENT = [
    {"role": "developer", "content": "Use the tools."},
    {"role": "user", "content": "Find the order."},
    {"type": "function_call", "call_id": "c1", "name": "search", "arguments": "{}"},
    {"type": "function_call", "call_id": "c2", "name": "lookup", "arguments": "{}"},
    {"type": "function_call_output", "call_id": "c1", "output": "x" * 400},
    {"type": "function_call_output", "call_id": "c2", "output": "y" * 400},
    {"role": "assistant", "content": "Found two."},
    {"role": "user", "content": "Which is newer?"},
]


def test_a_call_goes_with_its_outputs_and_instructions_and_the_newest_item_stay():
    assert droppable_groups(AGENT) == [[1], [2, 4], [3, 5], [6]]
    assert droppable_groups([{"role": "user", "content": "only one"}]) == []
    assert droppable_groups([{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]) == []


def test_every_truncation_is_a_body_the_chat_translation_takes():
    """No output is ever left without its call, nor a call without its output: each cut translates."""
    body = {"model": "m", "input": AGENT, "truncation": "auto"}
    groups = droppable_groups(AGENT)
    for count in range(len(groups) + 1):
        cut = without_oldest(body, groups, count)
        chat = responses_to_chat_body(cut)
        assert chat["messages"][0]["content"] == "Use the tools."  # instructions stay first
        assert cut["input"][-1] == AGENT[-1] and len(cut["input"]) == len(AGENT) - sum(
            map(len, groups[:count])
        )
    assert body["input"] is AGENT and len(AGENT) == 8  # the client's body is left as it was


def test_the_drop_count_covers_the_overflow_share_of_the_input():
    items = [{"role": "user", "content": "a" * 1000}, {"role": "assistant", "content": "b" * 1000}] * 3 + [
        {"role": "user", "content": "now"}
    ]
    groups = droppable_groups(items)
    assert len(groups) == 6
    assert groups_to_drop(items, groups, prompt_tokens=1000, excess=100) == 1  # 10 %: one of six items
    assert groups_to_drop(items, groups, prompt_tokens=1000, excess=400) == 3  # 40 %: three
    assert groups_to_drop(items, groups, prompt_tokens=1000, excess=2000) == 6  # all that may go
    assert (
        groups_to_drop(items, groups, prompt_tokens=None, excess=None) == 1
    )  # counts unknown: one at a time
    assert groups_to_drop(items, [], prompt_tokens=1000, excess=100) == 0


def test_an_upstreams_overflow_wording_gives_the_counts():
    from gateway.transport.failures import overflow_counts

    prompt_only = (
        "This model's maximum context length is 8192 tokens. However, your messages resulted in 13942 tokens "
        "(including room for at least one completion token)."
    )
    with_completion = (
        "This model's maximum context length is 8192 tokens. However, you requested 9000 tokens (8000 in the "
        "messages, 1000 in the completion). Please reduce the length of the messages or completion."
    )
    assert overflow_counts(prompt_only) == (13942, 13942 + 1 - 8192)
    assert overflow_counts(with_completion) == (8000, 808)
    assert overflow_counts("rate limited") is None
