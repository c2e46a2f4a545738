"""Documents an app puts in its system prompt (retrieved chunks, tagged documents, Markdown tables) keep their
structure: a ``Date:`` or ``Order ID:`` line inside one belongs to its document, and a table row is never
split (keep pack: ``keep.documents``, ``keep.retrieved-chunk``, ``keep.table-row``). The app's own volatile
lines around them are still hoisted."""

from __future__ import annotations

import pytest

from rules import load_ruleset

DEFAULT = load_ruleset(["default"])
UUID = "3f9c2b1e-7d4a-4c1b-9a0e-2b7f6d8c1e55"

KEPT = {
    "untagged-chunks": (
        "Answer from the retrieved documents.\n\n[doc 1, score 0.82]\nInvoice INV-001\nDate: 2026-11-30\n"
        "Amount: $40.00\n\n[doc 2, score 0.79]\nInvoice INV-002\nDate: 2026-10-02\nAmount: $75.00"
    ),
    "numbered-sources": f"Use these sources.\nSource 1: order record\nOrder ID: {UUID}\nDate: 2026-11-30",
    "dashed-passages": "--- Passage 3 ---\nTimestamp: 1764946948\nRequest ID: req-42abc\nThe job failed.",
    "document-tags": (
        f'<documents>\n<document index="1">\nSession ID: {UUID}\nCurrent date: 2026-11-30\n</document>\n'
        "</documents>\nAnswer briefly."
    ),
    "search-results": "<search_results>\nDate: 2026-11-30\nTrace: req-3abc3def\n</search_results>",
    "table": "| Field | Value |\n|---|---|\n| Current date | 2026-12-01 |\n| Plan | pro |",
}


@pytest.mark.parametrize("name", sorted(KEPT))
def test_documents_and_tables_keep_their_lines(name: str) -> None:
    messages = [{"role": "system", "content": KEPT[name]}, {"role": "user", "content": "When was INV-002?"}]
    canon = DEFAULT.apply(messages)
    assert canon.hoisted == []
    assert canon.messages == messages


def test_the_apps_own_lines_around_documents_are_still_hoisted() -> None:
    system = (
        "Answer from the documents.\nCurrent date: 2026-12-05\n<documents>\n<document>\nDate: 2026-11-30\n"
        "</document>\n</documents>\n\n[doc 2, score 0.5]\nDate: 2026-10-02\n\nRequest ID: req-7f3a9c21"
    )
    canon = DEFAULT.apply([{"role": "system", "content": system}, {"role": "user", "content": "Q?"}])
    assert canon.hoisted == ["Current date: 2026-12-05", "Request ID: req-7f3a9c21"]
    assert "Date: 2026-11-30" in canon.messages[0]["content"]
    assert "Date: 2026-10-02" in canon.messages[0]["content"]


def test_a_table_row_is_never_split() -> None:
    system = "| Current date: 2026-12-01 | today |\n|---|---|"
    canon = DEFAULT.apply([{"role": "system", "content": system}, {"role": "user", "content": "Q?"}])
    assert canon.messages[0]["content"] == system and canon.hoisted == []
