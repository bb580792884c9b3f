"""The benchmarks (``python -m scripts.bench.NAME``; ``--help`` says what each measures), their harness
(``harness``, ``docs``, ``rows``, ``rss``, ``floor``) and the stages of ``scripts/gpu_check.sh``.
Importing it puts the repository root on ``sys.path`` (``scripts/sim_cluster.py`` imports it as ``bench``).
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
