"""Loading and validating rule files: every bad file fails with file, line and rule id."""

from __future__ import annotations

from pathlib import Path

import pytest

from rules import RuleError, RuleSet, list_packs, load_ruleset
from tests.rules.helpers import ruleset_from, write_rules


def load_error(tmp_path: Path, body: str) -> tuple[RuleError, Path]:
    path = write_rules(tmp_path, body)
    with pytest.raises(RuleError) as info:
        load_ruleset([str(path)])
    return info.value, path


def assert_error(error: RuleError, path: Path, line: int | None, rule_id: str | None, words: str) -> None:
    assert error.file == str(path)
    assert error.line == line
    assert error.rule_id == rule_id
    assert words in error.reason
    prefix = f"{path}:{line}: " if line is not None else f"{path}: "
    if rule_id is not None:
        prefix += f"rule '{rule_id}': "
    assert str(error) == prefix + error.reason


def test_unknown_rule_key_names_file_line_and_rule(tmp_path: Path) -> None:
    error, path = load_error(
        tmp_path,
        """
        rules:
          - id: my-rule
            match:
              pattern: 'x'
            action: drop
            colour: blue
        """,
    )
    assert_error(error, path, 6, "my-rule", "unknown key 'colour'")


def test_key_of_another_action_is_rejected(tmp_path: Path) -> None:
    error, path = load_error(
        tmp_path,
        """
        rules:
          - id: r1
            match: {pattern: 'x'}
            action: drop
            unit: hour
        """,
    )
    assert_error(error, path, 5, "r1", "does not apply to action 'drop'")


def test_bad_regex_reports_the_pattern_line(tmp_path: Path) -> None:
    error, path = load_error(
        tmp_path,
        """
        rules:
          - id: ok-rule
            match: {pattern: 'fine'}
            action: drop
          - id: lookahead
            match:
              role: system
              pattern: 'foo(?=bar)'
            action: drop
        """,
    )
    assert_error(error, path, 8, "lookahead", "bad regex")


def test_backreference_is_rejected_by_re2(tmp_path: Path) -> None:
    error, path = load_error(
        tmp_path,
        r"""
        rules:
          - id: backref
            match: {pattern: '(a)\1'}
            action: drop
        """,
    )
    assert_error(error, path, 3, "backref", "bad regex")


def test_bad_action(tmp_path: Path) -> None:
    error, path = load_error(
        tmp_path,
        """
        rules:
          - id: r
            match: {pattern: 'x'}
            action: explode
        """,
    )
    assert_error(error, path, 4, "r", "unknown action 'explode'")


def test_missing_action(tmp_path: Path) -> None:
    error, path = load_error(
        tmp_path,
        """
        rules:
          - id: r
            match: {pattern: 'x'}
        """,
    )
    assert_error(error, path, 2, "r", "missing 'action'")


def test_missing_id(tmp_path: Path) -> None:
    error, path = load_error(
        tmp_path,
        """
        rules:
          - id: first
            match: {pattern: 'x'}
            action: drop
          - match: {pattern: 'y'}
            action: drop
        """,
    )
    assert_error(error, path, 5, None, "no 'id'")


def test_bad_id_characters(tmp_path: Path) -> None:
    error, path = load_error(
        tmp_path,
        """
        rules:
          - id: has space
            match: {pattern: 'x'}
            action: drop
        """,
    )
    assert_error(error, path, 2, None, "bad rule id")


def test_duplicate_id_in_one_file(tmp_path: Path) -> None:
    error, path = load_error(
        tmp_path,
        """
        rules:
          - id: twin
            match: {pattern: 'x'}
            action: drop
          - id: twin
            match: {pattern: 'y'}
            action: drop
        """,
    )
    assert_error(error, path, 5, "twin", "duplicate rule id")
    assert f"{path}:2" in error.reason


def test_duplicate_id_across_files(tmp_path: Path) -> None:
    a = write_rules(tmp_path, "rules:\n  - id: same\n    match: {pattern: 'x'}\n    action: drop\n", "a.yaml")
    b = write_rules(
        tmp_path,
        "rules:\n  - id: other\n    match: {pattern: 'x'}\n    action: drop\n"
        "  - id: same\n    match: {pattern: 'y'}\n    action: drop\n",
        "b.yaml",
    )
    with pytest.raises(RuleError) as info:
        load_ruleset([str(a), str(b)])
    assert info.value.file == str(b)
    assert info.value.line == 5
    assert info.value.rule_id == "same"
    assert f"first defined at {a}:2" in info.value.reason


def test_bad_yaml_reports_line(tmp_path: Path) -> None:
    error, path = load_error(
        tmp_path,
        """
        rules:
          - id: r
            match: {pattern: 'x'
            action: drop
        """,
    )
    assert error.file == str(path)
    assert error.line is not None and error.line >= 3
    assert error.rule_id is None
    assert "bad YAML" in error.reason


def test_duplicate_yaml_key_is_an_error(tmp_path: Path) -> None:
    error, path = load_error(
        tmp_path,
        """
        rules:
          - id: r
            action: drop
            match: {pattern: 'x'}
            action: hoist
        """,
    )
    assert_error(error, path, 5, None, "duplicate key 'action'")


def test_unknown_match_key(tmp_path: Path) -> None:
    error, path = load_error(
        tmp_path,
        """
        rules:
          - id: r
            match:
              pattern: 'x'
              roles: system
            action: drop
        """,
    )
    assert_error(error, path, 5, "r", "unknown key 'roles' in match")


def test_unknown_role_and_position(tmp_path: Path) -> None:
    error, path = load_error(
        tmp_path,
        """
        rules:
          - id: r
            match: {pattern: 'x', role: [system, robot]}
            action: drop
        """,
    )
    assert_error(error, path, 3, "r", "unknown role 'robot'")
    error, path = load_error(
        tmp_path,
        """
        rules:
          - id: r
            match: {pattern: 'x', position: middle}
            action: drop
        """,
    )
    assert_error(error, path, 3, "r", "unknown position")


def test_position_and_index_together(tmp_path: Path) -> None:
    error, path = load_error(
        tmp_path,
        """
        rules:
          - id: r
            match:
              pattern: 'x'
              position: last
              index: 0
            action: drop
        """,
    )
    assert_error(error, path, 6, "r", "either 'position' or 'index'")


def test_span_action_without_pattern(tmp_path: Path) -> None:
    error, path = load_error(
        tmp_path,
        """
        rules:
          - id: r
            match: {role: system}
            action: hoist
        """,
    )
    assert_error(error, path, 3, "r", "needs a 'pattern'")


def test_pattern_matching_empty_string(tmp_path: Path) -> None:
    error, path = load_error(
        tmp_path,
        """
        rules:
          - id: r
            match: {pattern: 'a*'}
            action: drop
        """,
    )
    assert_error(error, path, 3, "r", "matches the empty string")


def test_round_needs_unit_and_time_groups(tmp_path: Path) -> None:
    error, path = load_error(
        tmp_path,
        """
        rules:
          - id: r
            match: {pattern: '(?P<hour>\\d\\d):(?P<minute>\\d\\d)'}
            action: round
        """,
    )
    assert_error(error, path, 2, "r", "needs 'unit'")
    error, path = load_error(
        tmp_path,
        """
        rules:
          - id: r
            match:
              pattern: '\\d\\d:\\d\\d'
            action: round
            unit: hour
        """,
    )
    assert_error(error, path, 4, "r", "named groups")
    error, path = load_error(
        tmp_path,
        """
        rules:
          - id: r
            match: {pattern: '%{CLOCK}'}
            action: round
            unit: week
        """,
    )
    assert_error(error, path, 5, "r", "unknown unit 'week'")


def test_template_referring_to_missing_group(tmp_path: Path) -> None:
    error, path = load_error(
        tmp_path,
        """
        rules:
          - id: r
            match: {pattern: '(?P<a>x)'}
            action: replace
            with: '{b}'
        """,
    )
    assert_error(error, path, 5, "r", "group 'b' does not exist")
    error, path = load_error(
        tmp_path,
        """
        rules:
          - id: r
            match: {pattern: '(?P<a>x)'}
            action: reorder
            template: '{a} }'
        """,
    )
    assert_error(error, path, 5, "r", "lone '}'")


def test_bad_group_and_placement(tmp_path: Path) -> None:
    error, path = load_error(
        tmp_path,
        """
        rules:
          - id: r
            match: {pattern: '(x)'}
            action: hoist
            group: 2
        """,
    )
    assert_error(error, path, 5, "r", "group 2 does not exist")
    error, path = load_error(
        tmp_path,
        """
        rules:
          - id: r
            match: {pattern: 'x'}
            action: hoist
            placement: somewhere
        """,
    )
    assert_error(error, path, 5, "r", "unknown placement")


def test_sort_tools_takes_no_match_and_normalize_no_pattern(tmp_path: Path) -> None:
    error, path = load_error(
        tmp_path,
        """
        rules:
          - id: r
            action: sort_tools
            match: {role: system}
        """,
    )
    assert_error(error, path, 4, "r", "takes no 'match'")
    error, path = load_error(
        tmp_path,
        """
        rules:
          - id: r
            action: normalize
            match: {pattern: 'x'}
        """,
    )
    assert_error(error, path, 4, "r", "takes no 'pattern'")
    error, path = load_error(
        tmp_path,
        """
        rules:
          - id: r
            action: normalize
            blank_lines: -1
        """,
    )
    assert_error(error, path, 4, "r", "blank_lines")


def test_fragments_unknown_and_invalid(tmp_path: Path) -> None:
    error, path = load_error(
        tmp_path,
        """
        rules:
          - id: r
            match: {pattern: '%{NO_SUCH_THING}'}
            action: drop
        """,
    )
    assert_error(error, path, 3, "r", "unknown fragment %{NO_SUCH_THING}")
    error, path = load_error(
        tmp_path,
        """
        patterns:
          BROKEN: '(unclosed'
        rules: []
        """,
    )
    assert_error(error, path, 2, None, "fragment 'BROKEN'")
    error, path = load_error(
        tmp_path,
        """
        patterns:
          CLOCK: 'x'
        rules: []
        """,
    )
    assert_error(error, path, 2, None, "already defined")
    error, path = load_error(
        tmp_path,
        """
        patterns:
          LOOP: 'a%{LOOP}'
        rules: []
        """,
    )
    assert_error(error, path, 2, None, "refers to itself")


def test_top_level_problems(tmp_path: Path) -> None:
    error, path = load_error(
        tmp_path,
        """
        rule:
          - id: r
        """,
    )
    assert_error(error, path, 1, None, "unknown top-level key 'rule'")
    error, path = load_error(tmp_path, "# nothing here\n")
    assert_error(error, path, 1, None, "empty file")
    error, path = load_error(tmp_path, "- just\n- a list\n")
    assert_error(error, path, 1, None, "must be a mapping")
    error, path = load_error(tmp_path, "rules: {id: r}\n")
    assert_error(error, path, 1, None, "must be a list")


def test_missing_file_and_unknown_pack(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    with pytest.raises(RuleError) as info:
        load_ruleset([str(missing)])
    assert info.value.file == str(missing)
    assert "not found" in info.value.reason
    with pytest.raises(RuleError) as info:
        load_ruleset(["no-such-pack"])
    assert "unknown rule pack 'no-such-pack'" in str(info.value)
    assert "default" in str(info.value)
    with pytest.raises(RuleError) as info:
        load_ruleset(["_fragments"])
    assert "unknown rule pack" in str(info.value)


def test_include_missing_and_cycle(tmp_path: Path) -> None:
    error, path = load_error(
        tmp_path,
        """
        include:
          - dates
          - ./missing.yaml
        rules: []
        """,
    )
    assert_error(error, path, 3, None, "included file not found")
    write_rules(tmp_path, "include: [b.yaml]\nrules: []\n", "a.yaml")
    write_rules(tmp_path, "include: [a.yaml]\nrules: []\n", "b.yaml")
    with pytest.raises(RuleError) as info:
        load_ruleset([str(tmp_path / "a.yaml")])
    # reported where the cycle closes: b.yaml's include entry, line 1
    assert_error(info.value, tmp_path / "b.yaml", 1, None, "include cycle: ")
    assert info.value.reason.endswith(
        f"{tmp_path / 'a.yaml'} -> {tmp_path / 'b.yaml'} -> {tmp_path / 'a.yaml'}"
    )


@pytest.mark.parametrize(
    ("body", "line", "rule_id", "words"),
    [
        ("rules:\n  - id: r1\n    description: 2024-02-30\n    match: {pattern: 'x'}\n    action: drop\n",
         3, "r1", "bad value: day is out of range for month"),
        ("rules:\n  - id: r1\n    match: {pattern: !re 'x'}\n    action: drop\n",
         3, "r1", "bad value: could not determine a constructor for the tag '!re'"),
        ("patterns:\n  2024-02-30: 'x'\nrules: []\n", 2, None, "bad value: day is out of range for month"),
        ("rules:\n  - id: r1\n    match: {pattern: '(?P<day>\\d+)'}\n    action: round\n    unit: [day]\n",
         5, "r1", "unknown unit ['day']"),
        ("rules:\n  - id: r1\n    <<: 5\n    match: {pattern: 'x'}\n    action: drop\n", 3, "r1",
         "bad merge key: expected a mapping or a list of mappings"),
        ("rules:\n  - id: r1\n    <<: {? [k1, k2] : 1}\n    match: {pattern: 'x'}\n    action: drop\n", 3, "r1",
         "bad merge key: merged keys must be strings"),
    ],
)  # fmt: skip
def test_values_yaml_cannot_build_name_file_line_and_rule(tmp_path: Path, body, line, rule_id, words) -> None:
    error, path = load_error(tmp_path, body)
    assert_error(error, path, line, rule_id, words)


def test_yaml_merge_keys_share_rule_defaults(tmp_path: Path) -> None:
    rules = ruleset_from(
        tmp_path,
        """
        rules:
          - &base
            id: r1
            match: {pattern: 'x+'}
            action: drop
          - <<: *base
            id: r2
            match: {pattern: 'y+'}
        """,
    )
    # r2 takes r1's action from the merge and overrides its id and match
    assert [(r.id, r.action, r.pattern_source) for r in rules.rules] == [
        ("r1", "drop", "x+"),
        ("r2", "drop", "y+"),
    ]


def test_yaml_merge_precedence_own_keys_then_list_order_then_nested(tmp_path: Path) -> None:
    rules = ruleset_from(
        tmp_path,
        """
        rules:
          - &a {id: a, match: {pattern: 'a+'}, action: drop}
          - &b {id: b, match: {pattern: 'b+'}, action: drop, description: from b}
          - <<: [*a, *b]
            id: list
          - <<: {<<: *a, match: {pattern: 'z+'}}
            id: nested
        """,
    )
    got = {r.id: (r.pattern_source, r.description) for r in rules.rules}
    assert got["list"] == ("a+", "from b")  # the earlier mapping of the list wins; b adds what a lacks
    assert got["nested"] == ("z+", "")  # the inner mapping's own key wins over its own merge


def test_bad_placement_override() -> None:
    with pytest.raises(RuleError) as info:
        load_ruleset(["default"], placement="sideways")
    assert "unknown hoist placement" in str(info.value)


def test_every_shipped_pack_loads() -> None:
    packs = list_packs()
    assert set(packs) >= {"default", "dates", "ids", "epochs", "location", "tools", "whitespace"}
    for pack in packs:
        assert isinstance(load_ruleset([pack]), RuleSet)


def test_default_pack_is_all_packs_in_order() -> None:
    default = load_ruleset(["default"])
    parts = load_ruleset(
        ["whitespace", "keep", "dates", "ids", "credentials", "epochs", "location", "per_user", "tools"]
    )
    assert default.rule_ids == parts.rule_ids
    assert default.rule_ids[0] == "whitespace.system"
    assert default.rule_ids[-1] == "tools.sort"


def test_a_file_reached_twice_is_loaded_once(tmp_path: Path) -> None:
    path = write_rules(
        tmp_path, "include: [dates]\nrules:\n  - id: mine\n    match: {pattern: 'x'}\n    action: drop\n"
    )
    ruleset = load_ruleset(["default", str(path)])
    assert ruleset.rule_ids.count("dates.current-datetime-line") == 1
    assert ruleset.rule_ids[-1] == "mine"


def test_empty_source_list_changes_nothing() -> None:
    ruleset = load_ruleset([])
    messages = [
        {"role": "system", "content": "Current date: 2025-05-14  \r\n"},
        {"role": "user", "content": "hi"},
    ]
    tools = [
        {"type": "function", "function": {"name": "b", "parameters": {"z": 1, "a": 2}}},
        {"type": "function", "function": {"name": "a"}},
    ]
    canon = ruleset.apply(messages, tools)
    assert canon.messages == messages
    assert canon.tools == tools
    assert [list(t["function"]) for t in canon.tools] == [["name", "parameters"], ["name"]]
    assert canon.applied == {}
    assert canon.hoisted == []
    assert [s.level for s in canon.segments] == [1, 4]


def test_a_keep_rule_leaves_the_rules_it_names_in_except_free(tmp_path: Path) -> None:
    rules = ruleset_from(
        tmp_path,
        """
        rules:
          - id: guard
            match: {pattern: '(?m)^Ticket: [^\\n]*'}
            action: keep
            except: [ticket-owner]
          - id: ticket-number
            match: {pattern: 'T-[0-9]+'}
            action: drop
          - id: ticket-owner
            match: {pattern: 'owner [a-z]+'}
            action: drop
        """,
    )
    out = rules.apply([{"role": "user", "content": "Ticket: T-42 owner ann"}])
    assert out.messages[0]["content"] == "Ticket: T-42"
    for bad in ("[]", "ticket-owner", "[1]", "['']"):
        error, path = load_error(
            tmp_path,
            f"""
            rules:
              - id: guard
                match: {{pattern: 'x'}}
                action: keep
                except: {bad}
            """,
        )
        assert_error(error, path, 5, "guard", "'except' must be a list of rule ids")
