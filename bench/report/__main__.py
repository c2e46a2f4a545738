"""``python -m bench.report``: run the benchmarks (or reuse their JSON lines) and write ``REPORT.md`` and the PNG
plots into ``--out`` (default ``bench/results``, committed with the code). ``--quick`` (CI) runs the tests'
tiny random checkpoint on small sizes; write it elsewhere (``--out``) so the committed results stay.

The llama.cpp peer runs when a ``llama-server`` binary is given (``--llama-server``) or found at
``bench/.peers/build/bin/llama-server`` (``bench/build_llama_server.sh``); otherwise the report says it was not
run. A benchmark that fails is reported as not run (its figure says so) and the exit status is 1.

``--reuse`` keeps the records of ``OUT/results.jsonl`` and runs the benchmarks without one; with ``--only`` it
runs the named ones again and keeps every other record (a named one that fails keeps its old record there).
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from bench.report import markdown, plots
from bench.report.provenance import Provenance, collect
from bench.report.runner import ROOT, BenchError, Record, benches, read_records, run_bench

DEFAULT_LLAMA_SERVER = ROOT / "bench" / ".peers" / "build" / "bin" / "llama-server"


def _peer(arg: str | None) -> tuple[str | None, str]:
    """(llama-server binary or None, why the peer does not run when None)."""
    if arg:
        if not Path(arg).is_file():
            raise SystemExit(f"--llama-server {arg}: no such file")
        return arg, ""
    if DEFAULT_LLAMA_SERVER.is_file():
        return str(DEFAULT_LLAMA_SERVER), ""
    return (
        None,
        f"no llama-server binary (none at {DEFAULT_LLAMA_SERVER.relative_to(ROOT)}, no --llama-server)",
    )


def main(argv: list[str] | None = None) -> int:
    """Run, draw, write; 0 when every selected benchmark produced its JSON line."""
    ap = argparse.ArgumentParser(prog="python -m bench.report", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny checkpoint, small sizes (CI)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results", help="output folder")
    ap.add_argument(
        "--only", nargs="+", help="run only these benchmarks (note engine rules traces tiers ...)"
    )
    ap.add_argument(
        "--reuse",
        action="store_true",
        help="keep the records already in OUT/results.jsonl, run the others (with --only: run those again)",
    )
    ap.add_argument("--no-run", action="store_true", help="run nothing: draw from OUT/results.jsonl")
    ap.add_argument("--llama-server", default=None, help="llama-server binary for the llama.cpp peer")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds each benchmark may take")
    args = ap.parse_args(argv)
    server, peer_reason = _peer(args.llama_server)
    if args.quick and server is None:
        peer_reason = "quick run without --llama-server"
    out: Path = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    prov = collect(ROOT)
    known = [b.name for b in benches(server)]
    if args.only and (unknown := set(args.only) - set(known) - {"peers"}):
        ap.error(f"--only: unknown benchmark(s) {sorted(unknown)}; known: {known}")
    records: dict[str, Record] = read_records(out / "results.jsonl") if (args.reuse or args.no_run) else {}
    skipped: dict[str, str] = {}
    failed = False
    for bench in benches(server):
        if args.no_run or (args.only and bench.name not in args.only):
            continue
        if bench.name in records and not args.only:  # --reuse: kept (--only names what to run again)
            continue
        print(f"[report] {bench.name}: {bench.what}", flush=True)
        try:
            record = run_bench(bench, args.quick, out / "raw", args.timeout, prov.as_dict())
        except BenchError as exc:
            skipped[bench.name] = str(exc)
            failed = True
            print(f"[report] {bench.name} failed: {exc}", file=sys.stderr, flush=True)
            continue
        records[bench.name] = record
        print(f"[report] {bench.name}: {record.seconds:.0f} s", flush=True)
        (out / "results.jsonl").write_text("".join(r.to_json() + "\n" for r in records.values()))
    for bench in benches(server):
        if bench.name not in records and bench.name not in skipped and (args.no_run or args.reuse):
            skipped[bench.name] = "no record in results.jsonl (not run, or did not finish)"
    if "peers" not in records and server is None:
        skipped.setdefault("peers", peer_reason)
    results = {name: r.result for name, r in records.items()}
    if records and (args.no_run or args.reuse):  # figures say where and when the numbers were measured
        first = records.get("note") or next(iter(records.values()))
        prov = Provenance(**first.provenance)
    for name, draw in plots.PLOTS.items():
        source = next((records[b] for b in plots.SOURCES[name] if b in records), None)
        where = Provenance(**source.provenance) if source is not None else prov  # where it was measured
        if draw is plots.engine_vs_llamacpp:
            draw(results, where, out / name, skipped.get("peers", peer_reason) or "it failed")
        else:
            draw(results, where, out / name)
    command = "python -m bench.report " + shlex.join(argv if argv is not None else sys.argv[1:])
    text = markdown.render(
        prov, records, skipped, skipped.get("peers", peer_reason), args.quick, command.strip()
    )
    (out / "REPORT.md").write_text(text)
    print(f"[report] wrote {out / 'REPORT.md'} and {len(plots.PLOTS)} plots", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
