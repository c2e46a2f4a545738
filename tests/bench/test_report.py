"""The benchmark report (bench.report): its quick run writes every plot and the note's table; its parts refuse
bad input with named errors."""

from __future__ import annotations

import json
import platform
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from bench import note
from bench.report import markdown, note_table, plots
from bench.report.__main__ import _peer
from bench.report.provenance import Provenance, cpu_model, git_commit
from bench.report.runner import ROOT, BenchError, Record, benches, last_json, read_records
from tests.engine.engine_helpers import tiny_checkpoint

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
PROV = Provenance(cpu="Test CPU", cores=2, load=0.5, date="2026-12-01 00:00 UTC", commit="abc1234")


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR chunk; fails on anything that is not a PNG."""
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, f"{path.name} is not a PNG"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def note_result(**overrides: float) -> dict:
    """A bench.note JSON line with two workloads (figures chosen for the assertions)."""
    figures = {"on": {}, "off": {}}
    base = {
        "describe": "d",
        "requests": 3,
        "prefill_reduction": 0.95,
        "e2e_reduction": 0.2,
        "throughput_gain": 2.5,
        "cost_reduction": 0.85,
        "price_model": "claude-sonnet-4-5",
        "min_cacheable_tokens": 1024,
        "cost_without_usd": 1.0,
        "cost_with_usd": 0.15,
        "stable_prefix_tokens": 1100,
    }
    for mode in figures:
        figures[mode] = {
            "prefill_s": 0.1,
            "e2e_s": 0.5,
            "throughput_tps": 10.0,
            "cached_tokens": 0,
            "prompt_tokens": 100,
            "ttft_samples_s": [0.1],
            "e2e_samples_s": [0.5],
        }
    return {
        "bench": "note",
        "model": "m",
        "new_tokens": 4,
        "note_claims": {k: list(v) for k, v in note.NOTE_CLAIMS.items()},
        "workloads": {
            "chatbot": base | figures | overrides,
            "rag": base | figures | {"prefill_reduction": 0.5, "throughput_gain": 1.0},
        },
    }


@pytest.mark.slow
def test_quick_report_writes_every_plot_and_the_note_table(tmp_path):
    out = tmp_path / "report"
    done = subprocess.run(
        [sys.executable, "-m", "bench.report", "--quick", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = (out / "REPORT.md").read_text()
    for name in plots.PLOTS:
        width, height = png_size(out / name)
        assert width > 100 and height > 100
        assert f"]({name})" in report
    records = [json.loads(row) for row in (out / "results.jsonl").read_text().splitlines()]
    assert {r["bench"] for r in records} == {b.name for b in benches(None)}
    for name, _key, claim in note_table.ROWS:
        assert f"| {name} | {claim} |" in report
    assert "Quick run" in report
    assert "The llama.cpp peer was not run" in report
    assert set(records[0]["result"]["workloads"]) == {"chatbot", "rag", "few_shot", "agent"}
    assert all((out / "raw" / f"{r['bench']}.txt").is_file() for r in records)


def test_every_plot_says_not_run_without_its_benchmark(tmp_path):
    assert set(plots.SOURCES) == set(plots.PLOTS)
    for name, draw in plots.PLOTS.items():
        if draw is plots.engine_vs_llamacpp:
            draw({}, PROV, tmp_path / name, "no binary")
        else:
            draw({}, PROV, tmp_path / name)
        assert png_size(tmp_path / name)[0] > 100


def test_note_plots_draw_from_a_note_line(tmp_path):
    results = {"note": note_result()}
    plots.note_table(results, PROV, tmp_path / "t.png")
    plots.note_latency(results, PROV, tmp_path / "l.png")
    assert png_size(tmp_path / "t.png")[0] > 100 and png_size(tmp_path / "l.png")[0] > 100


def test_note_table_puts_the_note_beside_ours_row_by_row():
    text = note_table.markdown(note_result())
    rows = text.splitlines()
    assert rows[0] == "| Metric (note's row) | Note | Ours: chatbot | Ours: rag | Verdict |"
    assert rows[2] == "| Prefill time | 90% reduction | -95 % | -50 % | 1 of 2 reach -90 % |"
    assert rows[3] == "| End-to-end latency | 30-50% reduction | -20 % | -20 % | 0 of 2 reach -30 % |"
    assert rows[4] == "| Throughput | 2-3x | 2.50x | 1.00x | 1 of 2 reach 2x |"
    assert rows[5] == "| Cost (API) | 80-90% reduction | -85 % | -85 % | 2 of 2 reach -80 % |"
    assert len(note_table.details(note_result()).splitlines()) == 4


def test_report_markdown_references_every_plot_without_records():
    text = markdown.render(
        PROV, {}, {"note": "exit status 1: boom"}, "no binary", False, "python -m bench.report"
    )
    for name in plots.PLOTS:
        assert f"]({name})" in text
    assert "| note | not run: exit status 1: boom | | |" in text
    assert "The llama.cpp peer was not run: no binary." in text


def test_last_json_takes_the_last_line_and_refuses_others():
    assert last_json('table\n{"a": 1}\n\n') == {"a": 1}
    with pytest.raises(BenchError, match="no output"):
        last_json("  \n")
    with pytest.raises(BenchError, match="not JSON"):
        last_json('{"a": 1}\ndone')
    with pytest.raises(BenchError, match="not a JSON object"):
        last_json("[1, 2]")


def test_records_round_trip_and_a_bad_line_is_refused(tmp_path):
    path = tmp_path / "results.jsonl"
    assert read_records(path) == {}
    record = Record("rules", ["python", "-m", "bench.rules"], 12.3, {"x": 1}, PROV.as_dict())
    path.write_text(record.to_json() + "\n")
    back = read_records(path)["rules"]
    assert (back.result, back.seconds, back.provenance["commit"]) == ({"x": 1}, 12.3, "abc1234")
    path.write_text('{"bench": "rules"}\n')
    with pytest.raises(BenchError, match="results.jsonl:1: not a results record"):
        read_records(path)


def test_peer_binary_must_exist(tmp_path):
    with pytest.raises(SystemExit, match="no such file"):
        _peer(str(tmp_path / "llama-server"))
    assert [b.name for b in benches(None)][-1] != "peers"
    assert benches("/bin/true")[-1].name == "peers"


ZEN3 = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 1
model name\t: AMD EPYC
flags\t\t: fpu sse2 avx fma avx2 bmi2

processor\t: 1
model name\t: another
"""


def test_provenance_names_the_machine_kind_behind_one_model_name():
    # a VM shows "AMD EPYC" for a Zen 3 and a Zen 4 alike: family, model and vector instructions tell them apart
    assert cpu_model(ZEN3) == "AMD EPYC (family 25 model 1, AVX2)"
    zen4 = ZEN3.replace("model\t\t: 1", "model\t\t: 17").replace(
        "bmi2", "bmi2 avx512f avx512_vnni avx512_bf16"
    )
    assert cpu_model(zen4) == "AMD EPYC (family 25 model 17, AVX-512 (VNNI, BF16))"
    assert cpu_model("model name\t: Some CPU\n") == "Some CPU"
    assert cpu_model("flags : avx2\n") == (platform.processor() or "unknown CPU")  # no model name


def test_provenance_names_the_machine_and_commit():
    assert cpu_model()
    assert git_commit(ROOT) != "unknown"
    assert git_commit(Path("/")) == "unknown"
    assert PROV.line() == "Test CPU, 2 cores (load 0.5) | 2026-12-01 00:00 UTC | commit abc1234"


def test_note_cost_without_prefixgate_bills_every_token_as_input():
    ck = tiny_checkpoint()
    workloads = note.build_workloads(ck.tokenizer, scale=1.0, requests=3, sessions=2)
    assert [w.name for w in workloads] == ["chatbot", "rag", "few_shot", "agent"]
    rag = workloads[1]
    prompts = [len(ck.tokenizer.render_chat(m)) for m in rag.sequential]
    cost = note.measure_cost(ck.tokenizer, rag, "claude-opus-5")  # $5 / Mtok input, 512-token minimum
    assert cost["cost_without_usd"] == pytest.approx(sum(prompts) * 5.0 / 1e6)
    assert cost["stable_prefix_tokens"] > 512
    assert cost["cost_with_usd"] < cost["cost_without_usd"]
    with pytest.raises(SystemExit, match="not an Anthropic model"):
        note.measure_cost(ck.tokenizer, rag, "no-such-model")
    agent = note.provider_requests(ck.tokenizer, workloads[3])
    assert [len(r.breakpoints) for r in agent] == [1, 2, 2]
    assert all(a.tokens < b.tokens for a, b in zip(agent, agent[1:], strict=False))


def test_no_run_redraws_from_results_with_the_measurement_provenance(tmp_path):
    from bench.report.__main__ import main

    record = Record("note", ["python", "-m", "bench.note"], 5.0, note_result(), PROV.as_dict())
    (tmp_path / "results.jsonl").write_text(record.to_json() + "\n")
    assert main(["--no-run", "--out", str(tmp_path)]) == 0
    report = (tmp_path / "REPORT.md").read_text()
    assert "Date: 2026-12-01 00:00 UTC. Commit: `abc1234`." in report
    assert "| 2026-12-01 00:00 UTC, commit `abc1234`, Test CPU |" in report  # the record's own machine
    assert "| Prefill time | 90% reduction | -95 % | -50 % | 1 of 2 reach -90 % |" in report
    assert "| engine | not run: no record in results.jsonl (not run, or did not finish) | | |" in report
    for name in plots.PLOTS:
        assert png_size(tmp_path / name)[0] > 100


def test_only_refuses_an_unknown_benchmark(tmp_path):
    from bench.report.__main__ import main

    with pytest.raises(SystemExit):
        main(["--only", "nonesuch", "--out", str(tmp_path)])


def test_reuse_with_only_runs_the_named_benchmark_again_and_keeps_the_others(tmp_path, monkeypatch):
    """``--reuse --only note``: note's record is replaced by a new run, every other record stays; a rerun that
    fails keeps the old record (nothing lost) and exits 1."""
    import bench.report.__main__ as report

    old_note = Record("note", ["python", "-m", "bench.note"], 5.0, note_result(), PROV.as_dict())
    rules = Record("rules", ["python", "-m", "bench.rules"], 9.0, {"bench": "rules"}, PROV.as_dict())
    (tmp_path / "results.jsonl").write_text(old_note.to_json() + "\n" + rules.to_json() + "\n")
    ran: list[str] = []

    def fake_run(bench, quick, raw, timeout, prov):
        ran.append(bench.name)
        return Record(bench.name, ["python", "-m", "bench.note"], 7.0, note_result(), PROV.as_dict())

    monkeypatch.setattr(report, "run_bench", fake_run)
    monkeypatch.setattr(report.plots, "PLOTS", {})  # the records' figures are not what this test draws
    monkeypatch.setattr(report.markdown, "render", lambda *args: "report")
    assert report.main(["--reuse", "--only", "note", "--out", str(tmp_path)]) == 0
    assert ran == ["note"]
    kept = read_records(tmp_path / "results.jsonl")
    assert kept["note"].seconds == 7.0 and kept["rules"].seconds == 9.0

    def failing_run(bench, quick, raw, timeout, prov):
        raise BenchError(f"{bench.name} failed")

    monkeypatch.setattr(report, "run_bench", failing_run)
    assert report.main(["--reuse", "--only", "note", "--out", str(tmp_path)]) == 1
    kept = read_records(tmp_path / "results.jsonl")
    assert kept["note"].seconds == 7.0 and kept["rules"].seconds == 9.0
    ran.clear()
    monkeypatch.setattr(report, "run_bench", fake_run)
    report.main(["--reuse", "--out", str(tmp_path)])  # without --only: note and rules are kept, not run
    assert "note" not in ran and "rules" not in ran


def test_next_turn_section_and_plot_read_the_next_turn_line(tmp_path):
    result = {
        "next_turn_ttft_ms": {"idle": 40.0, "exact": 100.0, "generated": 45.5, "cold": 280.0},
        "cached_tokens": {"idle": 300.0, "exact": 250.0, "generated": 299.0, "cold": 0.0},
        "idle_over_exact": 0.4,
        "tokens_equal_cold": {"idle": True, "exact": True, "generated": False, "cold": True},
    }
    record = Record("next_turn", ["python", "-m", "bench.next_turn"], 1.0, result, {})
    text = markdown.render(PROV, {"next_turn": record}, {}, "no binary", False, "python -m bench.report")
    assert "| prefilled while idle (default) | 40.0 | 300.0 | True |" in text
    assert "| decode KV cached (opt-in) | 45.5 | 299.0 | False |" in text
    assert "Idle / exact TTFT: 0.400." in text
    plots.next_turn_ttft({"next_turn": result}, PROV, tmp_path / "n.png")
    assert png_size(tmp_path / "n.png")[0] > 100
