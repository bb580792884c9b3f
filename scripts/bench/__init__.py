"""The benchmarks, and their harness. Run one from the repository root as
``python -m scripts.bench.NAME`` (``--help`` says what it measures); each writes its raw results
under ``artifacts/NAME/``, its page ``docs/benchmarks/NAME.md`` and its rows of the index
``docs/benchmarks/README.md``. ``gpu_timings``, ``gpu_check_summary``, ``vllm_kimi_gpu`` and
``gpu_report`` are the stages and the report of ``scripts/gpu_check.sh``; ``measure_rss`` samples any
command's memory. The shared parts: ``harness`` (options, machine record, timing, a private Ray +
Serve, checkpoints, ``report``), ``docs`` (pages, tables, verdicts, the index), ``rows`` (JSON-lines
results), ``rss`` (a process tree's memory), ``floor`` (raw TCP, the transport's floor) and
``vllm_tier`` (the vLLM lane's topology).

``scripts/sim_cluster.py`` imports the harness as ``bench``; importing it puts the repository root
on ``sys.path``, for runs without the editable install.
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
