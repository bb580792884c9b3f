"""The benchmarks, and their harness. Run one from the repository root as
``python -m scripts.bench.NAME`` (``--help`` says what it measures); each writes its raw results
under ``artifacts/NAME/`` and its page, ``docs/benchmarks/NAME.md``, with its rows of the index,
``docs/benchmarks/README.md``.

Benchmarks: ``dataplane``, ``experts``, ``fused_cpu``, ``lane_faults``, ``memory``,
``numerics``, ``overhead``, ``real``, ``replicas``, ``serve``, ``served_real``, ``session_faults``,
``shutdown``, ``tail``, ``vllm_engines`` (in the vLLM lane's venv), ``warmup``;
``gpu_timings``, ``gpu_check_summary`` and ``gpu_report`` are the stages and
the report of ``scripts/gpu_check.sh``; ``measure_rss`` samples any command's memory.

The harness:

* ``harness``: command-line options, the machine record, timing loops, percentiles and medians of
  rounds, the packed experts' before / after modes, a private local Ray + Serve, checkpoints written
  once, seeded inputs, plots, and ``report`` (a run's JSON, its page and its index rows);
* ``docs``: each benchmark's page (its opening line, tables, verdicts from the data) and its rows of
  the index;
* ``rows``: JSON-lines results that keep up with the measurement (no torch import);
* ``rss``: the resident memory of a process tree, sampled from /proc;
* ``floor``: the transport's own floor, raw TCP between processes;
* ``vllm_tier``: the vLLM lane's topology (the tier under `serve run`, sessions, engine processes).

``scripts/sim_cluster.py`` imports the harness as ``bench`` (``scripts/`` is its ``sys.path``
entry); importing it puts the repository root on ``sys.path`` too, for runs without the editable
install.
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
