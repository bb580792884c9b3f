"""Run a command and sample the resident memory of its whole process tree (``bench.rss``); print the peak.

    python -m scripts.bench.measure_rss [--interval 0.2] [--json OUT] -- python -m moe_runtime forward ...

The peak ``rss`` (RssAnon + RssShmem) and ``pss`` (Pss_Anon + Pss_Shmem) sums, the samples and the
processes at the rss peak go to stderr and, with ``--json``, to a file. The exit status is the command's.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .rss import measure


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv or argv[-1] == "--":
        print(__doc__, file=sys.stderr)
        return 2
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--interval", type=float, default=0.2, help="seconds between samples")
    ap.add_argument("--json", type=Path, help="also write the measurement here")
    args = ap.parse_args(argv[:argv.index("--")])
    rc, result = measure(argv[argv.index("--") + 1:], args.interval)
    print(f"peak anon+shmem RSS of the process tree: {result['peak_rss_gb']:.3f} GB "
          f"(PSS {result['peak_pss_gb']:.3f} GB; {result['samples']} samples every {args.interval} s, "
          f"up to {result['max_processes']} processes; command exit {rc})", file=sys.stderr)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
