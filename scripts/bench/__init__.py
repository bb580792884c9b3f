"""The benchmark scripts' shared harness.

* :mod:`bench.harness`: command-line options, the machine record, timing loops and percentiles,
  a private local Ray + Serve, checkpoints written once, seeded inputs, plots;
* :mod:`bench.docs`: each benchmark's section of docs/benchmarks.md, verdicts from the data;
* :mod:`bench.rows`: JSON-lines results that keep up with the measurement (no torch import);
* :mod:`bench.rss`: the resident memory of a process tree, sampled from /proc.

Scripts run as ``python scripts/NAME.py``, so ``scripts/`` is on ``sys.path`` and ``import bench``
works as it is; importing it puts the repository root there too, for runs without the editable
install.
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
