"""The benchmark index (docs/benchmarks/README.md) measures each quantity once and says one thing
about it, and every row belongs to a benchmark that can still be run."""

import re
from pathlib import Path

from scripts.bench import docs
from scripts.bench.docs import INDEX, PAGES

ROOT = Path(__file__).resolve().parents[1]
THRESHOLD = re.compile(r" (<=|>=|<|>) [-+\d.e]+\S*( (ms|MB|s)\b)?")  # the target's bound: "<= 0.5 ms"
# The measured quantity: the first "A - B" or "A / B" of a target (before any comma of conditions).
QUANTITY = re.compile(r"^([^,]*?) ([-/]) ([^\s,]+)")


def index_rows() -> list[dict[str, str]]:
    return [{"bench": re.fullmatch(r"\[(\w+)\]\(\1\.md\)", r[0]).group(1), "target": r[1], "verdict": r[3]}
            for r in docs.index_rows()]


def script_of(bench: str) -> Path | None:
    for path in (ROOT / "scripts" / "bench" / f"{bench}.py", ROOT / "scripts" / f"{bench}.sh"):
        if path.is_file():
            return path
    return None


def test_every_row_and_page_belongs_to_a_benchmark_whose_script_exists():
    pages = {p.stem for p in PAGES.glob("*.md") if p.name != INDEX}
    benches = {r["bench"] for r in index_rows()} | pages
    assert not {b for b in benches if script_of(b) is None}, "index rows or pages without a script"
    assert {r["bench"] for r in index_rows()} <= pages, "index rows whose page is gone"


def test_one_target_one_verdict():
    verdicts: dict[str, set[str]] = {}
    for r in index_rows():
        verdicts.setdefault(THRESHOLD.sub("", r["target"]).strip(), set()).add(r["verdict"])
    assert not {t: v for t, v in verdicts.items() if len(v) > 1}


def test_each_quantity_is_measured_by_one_benchmark():
    owners: dict[str, set[str]] = {}
    for r in index_rows():
        if m := QUANTITY.match(r["target"]):
            owners.setdefault(" ".join(m.groups()).lower(), set()).add(r["bench"])
    assert not {q: b for q, b in owners.items() if len(b) > 1}


def test_the_checks_see_a_contradiction():
    """The checks above on the rows that once contradicted each other (a lane's call over the
    in-process forward met in one benchmark, missed in another)."""
    rows = ["lane - in-process per-layer call, A = 1, T = 1 <= 0.5 ms", "lane - in-process - TCP floor <= 0.5 ms"]
    assert len({" ".join(QUANTITY.match(t).groups()) for t in rows}) == 1
    assert THRESHOLD.sub("", "app - direct <= 1.0 ms, every row") == "app - direct, every row"
    assert THRESHOLD.sub("", "shared / separate tokens/s >= 1.0x") == "shared / separate tokens/s"
