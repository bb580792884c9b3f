"""Record a benchmark's results in docs/benchmarks.md: each script owns one ``## `` section."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any


def update_section(docs: Path, section: str) -> None:
    """Replace the section whose heading is ``section``'s first line, or append it at the end."""
    heading = section.splitlines()[0]
    text = docs.read_text() if docs.exists() else "# Benchmarks\n"
    pattern = re.compile(rf"^{re.escape(heading)}\n.*?(?=^## |\Z)", re.S | re.M)
    if pattern.search(text):
        text = pattern.sub(lambda _: section + "\n", text, count=1)
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    docs.parent.mkdir(parents=True, exist_ok=True)
    docs.write_text(text.rstrip("\n") + "\n")


def write_results(results: dict[str, Any], out_dir: Path, name: str, root: Path,
                  plot: Callable[[dict[str, Any], Path], None],
                  markdown: Callable[[dict[str, Any], str, str], str], docs: Path | None) -> str:
    """``{name}.json`` and ``{name}.png`` under ``out_dir``; the markdown section (printed, and
    recorded in ``docs`` when given), which names the files relative to ``root``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, png_path = out_dir / f"{name}.json", out_dir / f"{name}.png"
    json_path.write_text(json.dumps(results, indent=1) + "\n")
    plot(results, png_path)
    rel = [str(p.relative_to(root)) if p.is_relative_to(root) else str(p) for p in (json_path, png_path)]
    section = markdown(results, *rel)
    print("\n" + section)
    if docs:
        update_section(docs, section)
        print(f"updated {docs}")
    return section
