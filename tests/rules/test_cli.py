"""rules.cli: check and apply, as the `prefixgate rules ...` subcommands call them."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from rules import RuleErrors, cli, load_ruleset
from tests.rules.helpers import write_rules

GOOD = "rules:\n  - id: g\n    match: {pattern: 'x'}\n    action: drop\n"
BAD = "rules:\n  - id: g2\n    match: {pattern: 'x'}\n    action: drop\n    colour: red\n"


def test_check_ok_and_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = write_rules(tmp_path, GOOD, "good.yaml")
    bad = write_rules(tmp_path, BAD, "bad.yaml")
    assert cli.check([str(good), "default"]) == 0
    out = capsys.readouterr().out
    assert f"OK {good}: 1 rules" in out and "OK default:" in out and "OK together:" in out
    assert cli.check([str(good), str(bad)]) == 1
    captured = capsys.readouterr()
    assert f"{bad}:5: rule 'g2': unknown key 'colour'" in captured.err
    assert f"OK {good}" in captured.out
    assert cli.check([]) == 2


def test_check_names_every_invalid_rule_of_a_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = (
        "rules:\n"
        "  - id: a\n    match: {pattern: 'x'}\n    action: drop\n    colour: red\n"
        "  - id: ok\n    match: {pattern: 'y'}\n    action: drop\n"
        "  - id: b\n    match: {pattern: '('}\n    action: drop\n"
        "  - id: ok\n    match: {pattern: 'z'}\n    action: drop\n"
    )
    path = write_rules(tmp_path, text, "many.yaml")
    assert cli.check([str(path)]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 3, lines
    assert lines[0].startswith(f"{path}:5: rule 'a': unknown key 'colour'")
    assert lines[1].startswith(f"{path}:") and "rule 'b'" in lines[1]
    assert lines[2].startswith(f"{path}:12: rule 'ok': duplicate rule id (first defined at {path}:6)")
    with pytest.raises(RuleErrors) as caught:
        load_ruleset([str(path)])
    assert [e.rule_id for e in caught.value.errors] == ["a", "b", "ok"]
    assert (caught.value.rule_id, caught.value.line) == ("a", 5)  # reads like its first error


def test_check_duplicate_ids_across_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = write_rules(tmp_path, GOOD, "a.yaml")
    b = write_rules(tmp_path, GOOD, "b.yaml")
    assert cli.check([str(a), str(b)]) == 1
    assert "duplicate rule id" in capsys.readouterr().err


def test_apply_prints_canonical_request_and_stable_end(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    body = {
        "model": "m",
        "messages": [
            {"role": "system", "content": "Bot.\nCurrent date: 2025-05-14"},
            {"role": "user", "content": "hi"},
        ],
        "tools": [
            {"type": "function", "function": {"name": "z"}},
            {"type": "function", "function": {"name": "a"}},
        ],
    }
    request = tmp_path / "req.json"
    request.write_text(json.dumps(body), encoding="utf-8")
    assert cli.apply(None, str(request)) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["messages"] == [
        {"role": "system", "content": "Bot."},
        {"role": "user", "content": "<request_context>\nCurrent date: 2025-05-14\n</request_context>\n\nhi"},
    ]
    assert [t["function"]["name"] for t in out["tools"]] == ["a", "z"]
    assert out["stable_prefix_end"] == {"message": 1, "part": 0, "char": 0}
    assert [s["name"] for s in out["segments"]] == ["tools+system", "volatile"]
    assert out["applied"] == {"dates.current-datetime-line": 1, "tools.sort": 1}
    assert out["hoisted"] == ["Current date: 2025-05-14"]
    canon = load_ruleset(["default"]).apply(body["messages"], body["tools"])
    assert out["stable_prefix_sha256"] == hashlib.sha256(canon.stable_prefix_material()).hexdigest()
    assert out["content_hash"] == hashlib.sha256(canon.stable_prefix_material(1)).hexdigest()


def test_apply_shows_where_the_newest_turn_starts_when_an_earlier_turn_holds_a_block(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The trial read ``stable_prefix_end`` (message 1: the first block starts the volatile tail) as "the whole
    history is volatile"; ``turn_stable_end`` says where the newest turn's tail starts, the first turn's block
    being history, as the cache explanation counts it."""
    body = {
        "model": "m",
        "messages": [
            {"role": "system", "content": "You are terse.\nCurrent time: 10:00:00"},
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": "b"},
            {"role": "user", "content": "c"},
            {"role": "assistant", "content": "d"},
            {"role": "user", "content": "e"},
        ],
    }
    request = tmp_path / "turns.json"
    request.write_text(json.dumps(body), encoding="utf-8")
    assert cli.apply(None, str(request)) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["stable_prefix_end"]["message"] == 1
    assert out["turn_stable_end"] == {"message": 5, "part": 0, "char": 0}
    assert "history" in [s["name"] for s in out["turn_segments"]]


def test_apply_with_rules_placement_and_anthropic_body(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    request = tmp_path / "anthropic.json"
    request.write_text(
        json.dumps(
            {
                "system": "Today's date is Monday, May 13, 2024.",
                "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
            }
        ),
        encoding="utf-8",
    )
    assert cli.apply(["dates"], str(request), placement="system_end") == 0
    out = json.loads(capsys.readouterr().out)
    assert out["messages"][0] == {
        "role": "system",
        "content": "<request_context>\nToday's date is Monday, May 13, 2024.\n</request_context>",
    }
    assert out["stable_prefix_end"] == {"message": 0, "part": 0, "char": 0}
    empty = write_rules(tmp_path, "rules: []\n", "empty.yaml")
    assert cli.apply([str(empty)], str(request)) == 0
    assert (
        json.loads(capsys.readouterr().out)["messages"][0]["content"]
        == "Today's date is Monday, May 13, 2024."
    )


def test_apply_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad_rules = write_rules(tmp_path, BAD, "bad.yaml")
    request = tmp_path / "req.json"
    request.write_text('{"messages": [{"role": "user", "content": "x"}]}', encoding="utf-8")
    assert cli.apply([str(bad_rules)], str(request)) == 1
    assert "unknown key 'colour'" in capsys.readouterr().err
    assert cli.apply(None, str(tmp_path / "missing.json")) == 2
    assert "cannot read request" in capsys.readouterr().err
    request.write_text("{not json", encoding="utf-8")
    assert cli.apply(None, str(request)) == 2
    assert "not valid JSON" in capsys.readouterr().err
    request.write_text('{"prompt": "x"}', encoding="utf-8")
    assert cli.apply(None, str(request)) == 2
    assert "'messages' list" in capsys.readouterr().err
    request.write_text('{"messages": [{"role": 1}]}', encoding="utf-8")
    assert cli.apply(None, str(request)) == 2
    assert "messages[0].role must be a string" in capsys.readouterr().err


def test_module_main(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = write_rules(tmp_path, GOOD, "good.yaml")
    assert cli.main(["check", str(good)]) == 0
    request = tmp_path / "req.json"
    request.write_text('{"messages": [{"role": "user", "content": "x"}]}', encoding="utf-8")
    assert cli.main(["apply", "--rules", str(good), "--", str(request)]) == 0
    assert json.loads(capsys.readouterr().out.split("\n", 1)[1])["messages"] == [
        {"role": "user", "content": ""}
    ]


def test_check_accepts_every_shipped_pack_file(capsys: pytest.CaptureFixture[str]) -> None:
    """`prefixgate rules check rules/packs/*.yaml` passes, the fragments file included (it is no rule file,
    but it is shipped and loaded with every rule set)."""
    packs = sorted(str(p) for p in (Path(cli.__file__).parent / "packs").glob("*.yaml"))
    assert any(p.endswith("_fragments.yaml") for p in packs) and len(packs) > 2
    assert cli.check(packs) == 0
    out = capsys.readouterr().out
    assert "_fragments.yaml" in out and "already defined" not in out


def test_readme_rule_example_loads_and_hoists(tmp_path: Path) -> None:
    """The rule file shown in README.md is valid and does what it says."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    blocks = [b.split("```", 1)[0] for b in readme.split("```yaml\n")[1:] if b.startswith("rules:")]
    assert len(blocks) == 1
    path = tmp_path / "readme_rule.yaml"
    path.write_text(blocks[0])
    ruleset = load_ruleset([str(path)])
    canon = ruleset.apply(
        [
            {"role": "system", "content": "You are terse.\nBuild: 0123456789ab"},
            {"role": "user", "content": "hi"},
        ]
    )
    assert canon.applied == {"my.build-id": 1}
    assert canon.messages[0]["content"] == "You are terse."
    assert "Build: 0123456789ab" in canon.messages[1]["content"]
