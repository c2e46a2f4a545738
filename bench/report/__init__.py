"""Benchmark report (issue 17): ``python -m bench.report`` runs the benchmarks (or reads their JSON lines back)
and writes ``REPORT.md`` with PNG plots (matplotlib, Agg) into ``--out`` (default ``bench/results``).

Modules: ``provenance`` (machine, date, commit: every plot and the report say them), ``runner`` (each benchmark
as a subprocess, its last JSON line kept in ``results.jsonl`` and its table in ``raw/``), ``plots`` (one
function per figure), ``note_table`` (the user's note's table beside ours), ``markdown`` (``REPORT.md``).
Invariant: a figure is drawn only from a benchmark's JSON line; nothing is made up when a benchmark did not
run (its figure then says so).
"""
