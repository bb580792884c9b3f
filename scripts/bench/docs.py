"""Benchmark pages: a run rewrites its part of docs/benchmarks/NAME.md (between ``<!-- bench:NAME
begin -->`` and ``<!-- bench:NAME end -->``; text outside the markers is never touched) and its rows of
the index, docs/benchmarks/README.md (a row per target: value, verdict, date and machine).
"""

from __future__ import annotations

import json
import operator
import re
import shlex
import statistics
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from . import ROOT

PAGES = ROOT / "docs" / "benchmarks"  # a page per benchmark, and the index
INDEX = "README.md"

# A run is "contended" when other work already kept at least half the machine's CPUs busy when it
# started (1-minute load average before the run >= CPUs / 2): its timings carry that noise.
CONTENDED_LOAD_PER_CPU = 0.5
OPS = {"<=": operator.le, "<": operator.lt, ">=": operator.ge, ">": operator.gt}
Markdown = Callable[[dict[str, Any], str, str], str]  # (results, JSON path, PNG path) -> the section


class Target(NamedTuple):
    """One row of the index: a target in words with its threshold, the value measured, the verdict."""

    target: str
    measured: str
    met: bool | None


Targets = Callable[[dict[str, Any]], list[Target]]  # results -> the run's rows of the index


def update_section(docs: Path, section: str, name: str | None = None) -> None:
    """Put ``section`` between ``name``'s markers in ``docs``: in place of what they hold, else of the
    old unmarked section with its heading, else at the end."""
    heading = section.splitlines()[0]
    name = name or heading.lstrip("# ").strip()
    begin, end = f"<!-- bench:{name} begin -->", f"<!-- bench:{name} end -->"
    block = f"{begin}\n{section.rstrip()}\n{end}\n"
    text = docs.read_text() if docs.exists() else ""
    marked = re.compile(rf"^{re.escape(begin)}\n.*?^{re.escape(end)}\n?", re.S | re.M)
    unmarked = re.compile(rf"^{re.escape(heading)}\n.*?(?=^#{{1,2}} |^<!-- bench:|\Z)", re.S | re.M)
    if marked.search(text):
        text = marked.sub(lambda _: block, text, count=1)
    elif unmarked.search(text):
        text = unmarked.sub(lambda _: block + "\n", text, count=1)
    else:
        text = (text.rstrip("\n") + "\n\n" if text.strip() else "") + block
    docs.parent.mkdir(parents=True, exist_ok=True)
    docs.write_text(text.rstrip("\n") + "\n")


def verdict(value: float | None, op: str, target: float) -> dict[str, Any]:
    """A target check from the data: ``{"value", "target": "op target", "met": bool | None}``."""
    met = None if value is None else bool(OPS[op](value, target))
    return {"value": value, "target": f"{op} {target}", "met": met}


def verdict_word(met: bool | None) -> str:
    return {True: "met", False: "**missed**", None: "not measured"}[met]


def yes_no(ok: bool) -> str:
    return "yes" if ok else "**no**"


def verdict_text(v: dict[str, Any], fmt: str = ".2f", unit: str = "") -> str:
    """A :func:`verdict` in words: '**0.70** (target <= 0.75: met)'."""
    return f"**{v['value']:{fmt}}{unit}** (target {v['target']}{unit}: {verdict_word(v['met'])})"


def _one_minute(load: list[float] | float) -> float:
    return load[0] if isinstance(load, list | tuple) else load


def is_contended(load_before: list[float] | float, cpus: int) -> bool:
    return _one_minute(load_before) >= CONTENDED_LOAD_PER_CPU * cpus


def load_label(load_before: list[float] | float, load_after: list[float] | float | None, cpus: int) -> str:
    after = "" if load_after is None else f", {_one_minute(load_after):.2f} after"
    text = f"1-minute load average {_one_minute(load_before):.2f} before{after} on {cpus} CPUs"
    if is_contended(load_before, cpus):
        text += (" -- **contended**: other work held at least half the CPUs when the run started, "
                 "so every timing below carries that noise")
    return text


def section_start(heading: str, script: str, argv: list[str], machine: dict[str, Any], details: str,
                  json_path: str, png_path: str | None = None) -> str:
    """A section's heading and its run: command, date, machine, ``details``, load, raw data and plot."""
    command = " ".join(["python", "-m", f"scripts.bench.{script}", *([shlex.join(argv)] if argv else [])])
    ray = f", Ray {machine['ray']}" if "ray" in machine else ""
    load = load_label(machine["loadavg_before"], machine.get("loadavg_after"), machine["cpus"])
    plot = f", plot: `{png_path}`" if png_path else ""
    return (f"{heading}\n\nRun: `{command}` -- {machine['date']}, {machine['cpus']} CPUs, torch "
            f"{machine['torch']}{ray}; {details}; {load}. Raw data: `{json_path}`{plot}.")


def table(head: str, rows: Iterable[Iterable[Any]], align: str = "") -> list[str]:
    """A markdown table: ``head`` the column names joined by ' | ', ``align`` an 'l' or 'r' per column."""
    align = align or "l" * len(head.split(" | "))
    rule = "|" + "".join("---:|" if a == "r" else "---|" for a in align)
    return [f"| {head} |", rule, *map(table_row, rows)]


def table_row(cells: Iterable[Any]) -> str:
    return "| " + " | ".join(map(str, cells)) + " |"


def pct(value: float | None) -> str:
    return "" if value is None else f"{100 * value:.0f} %"


def rounds_table(kind: str, measure: str, values: dict[str, list[float]], what: dict[str, str],
                 fmt: str = ".2f") -> list[str]:
    """A table of measurements in rounds: each name of ``values``, what it is, the median and the rounds."""
    return table(f"{kind} | what it is | {measure} (median of rounds) | rounds",
                 ([name, what[name], f"{statistics.median(vs):{fmt}}", ", ".join(f"{v:{fmt}}" for v in vs)]
                  for name, vs in values.items()), "llrl")


def model_text(model: dict[str, int]) -> str:
    text = (f"H={model['hidden_size']}, D={model['routed_expert_hidden_size']}, E={model['num_experts']}, "
            f"k={model['num_experts_per_token']}, I={model['moe_intermediate_size']}")
    return text + (f", {model['num_shared_experts']} shared experts" if "num_shared_experts" in model else "")


def repo_relative(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def target(what: str, v: dict[str, Any] | bool, fmt: str = ".2f", unit: str = "") -> Target:
    """A :func:`verdict` as an index row (``what``, its threshold, the value), or a yes/no one."""
    if isinstance(v, bool):
        return Target(what, yes_no(v).strip("*"), v)
    measured = "-" if v["value"] is None else f"{v['value']:{fmt}}{unit}"
    return Target(f"{what} {v['target']}{unit}", measured, v["met"])


def target_lines(targets: Iterable[Target]) -> list[str]:
    return [f"- {t.target}: {t.measured} ({verdict_word(t.met)})" for t in targets]


def _cells(line: str) -> list[str]:
    return [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]


INDEX_HEAD = """# Benchmarks

Every benchmark writes a page here (`python -m scripts.bench.NAME`: the page names its command, the
machine and the load), and its rows of this index: a row per target, the value measured, the
verdict, and when and where. A run replaces its benchmark's rows; this file is never edited by hand.
Raw results and plots go to `artifacts/`, which is not committed.

| benchmark | target | measured | verdict | date | machine |
|---|---|---|---|---|---|
"""


def index_rows(pages: Path = PAGES) -> list[list[str]]:
    index = pages / INDEX
    return [_cells(line) for line in (index.read_text().splitlines() if index.exists() else [])
            if line.startswith("| [")]


def update_index(pages: Path, name: str, targets: Sequence[Target], date: str, machine: str) -> None:
    """Replace ``name``'s rows of the index with ``targets``, drop those of pages that are gone, and list
    the pages without a target below the table."""
    link = f"[{name}]({name}.md)"
    # A retired benchmark's page is deleted with its script: its rows go with it.
    rows = [r for r in index_rows(pages)
            if r[0] != link and (pages / re.sub(r".*\((.*)\)", r"\1", r[0])).is_file()]
    rows += [[link, t.target, t.measured, verdict_word(t.met), date, machine] for t in targets]
    rows.sort(key=lambda r: r[0])  # stable: each benchmark's rows keep their order
    listed = {r[0] for r in rows}
    others = [f"[{p.stem}]({p.name})" for p in sorted(pages.glob("*.md"))
              if p.name != INDEX and f"[{p.stem}]({p.name})" not in listed]
    text = INDEX_HEAD + "".join(table_row(c.replace("|", "\\|") for c in r) + "\n" for r in rows)
    if others:
        text += "\nPages without a target: " + ", ".join(others) + ".\n"
    (pages / INDEX).write_text(text)


def publish(section: str, name: str, targets: Sequence[Target], record: dict[str, Any],
            pages: str | Path | None, machine: str | None = None) -> None:
    """Rewrite ``name``'s page part and index rows in ``pages`` (none: nothing), dated from ``record``."""
    if not pages:
        return
    pages = Path(pages)
    update_section(pages / f"{name}.md", section, name)
    machine = machine or f"{record['cpus']} CPUs ({record['machine']})"
    update_index(pages, name, targets, record["date"][:10], machine)
    print(f"updated {pages / name}.md and {pages / INDEX}")


def render_section(json_path: Path, markdown: Markdown, targets: Targets, pages: str | Path | None,
                   name: str, results: dict[str, Any] | None = None, machine: str | None = None) -> str:
    """The page part of ``results`` (default: the JSON at ``json_path``), published in ``pages``."""
    results = results or json.loads(json_path.read_text())
    section = markdown(results, repo_relative(json_path), repo_relative(json_path.with_suffix(".png")))
    print("\n" + section)
    publish(section, name, targets(results), results["machine"], pages, machine)
    return section
