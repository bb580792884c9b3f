"""scripts/bench/docs.py: each benchmark rewrites only its own marked part of its page, and only its
rows of the index."""

from __future__ import annotations

from scripts.bench.docs import (
    INDEX,
    Target,
    is_contended,
    load_label,
    publish,
    target,
    update_section,
    verdict,
)

DOC = """# A page

## A (scripts/a.py)

old A text

### A's subsection

old numbers

## B (by hand)

B stays.
"""


def test_first_run_replaces_the_unmarked_section_then_only_its_markers(tmp_path) -> None:
    docs = tmp_path / "page.md"
    docs.write_text(DOC)
    update_section(docs, "## A (scripts/a.py)\n\nnew A, run 1\n", "bench_a")
    text = docs.read_text()
    assert "old A text" not in text and "old numbers" not in text and "new A, run 1" in text
    assert "<!-- bench:bench_a begin -->\n## A (scripts/a.py)" in text
    assert text.endswith("## B (by hand)\n\nB stays.\n")
    # Text added by hand after the end marker survives the next run; only the marked block changes.
    docs.write_text(text.replace("<!-- bench:bench_a end -->\n", "<!-- bench:bench_a end -->\n\nA note.\n"))
    update_section(docs, "## A (scripts/a.py)\n\nnew A, run 2\n", "bench_a")
    text = docs.read_text()
    assert "run 1" not in text and "new A, run 2" in text and "A note." in text and "B stays." in text
    assert text.count("bench:bench_a begin") == 1
    update_section(docs, "## C (scripts/c.py)\n\nC\n", "bench_c")  # a new section goes at the end
    assert docs.read_text().rstrip().endswith("C\n<!-- bench:bench_c end -->")


def test_a_page_whose_top_is_its_heading_gets_the_run_there(tmp_path) -> None:
    """A page written by hand so far starts with the script's heading: the first run replaces the
    heading's paragraph and leaves the hand-written sections after it."""
    page = tmp_path / "x.md"
    page.write_text("# X (scripts/bench/x.py)\n\nNot run yet.\n\n## An earlier run, by hand\n\nKept.\n")
    update_section(page, "# X (scripts/bench/x.py)\n\nrun 1\n", "x")
    assert page.read_text() == ("<!-- bench:x begin -->\n# X (scripts/bench/x.py)\n\nrun 1\n<!-- bench:x end -->\n"
                                "\n## An earlier run, by hand\n\nKept.\n")


def index_rows(pages) -> list[str]:
    return [line for line in (pages / INDEX).read_text().splitlines() if line.startswith("| [")]


def test_a_run_replaces_only_its_own_rows_of_the_index(tmp_path) -> None:
    record = {"date": "2026-12-06 03:38 UTC", "cpus": 2, "machine": "x86_64"}
    a1 = [target("a / b", verdict(0.5, "<=", 0.75)), target("answers equal | exact", False)]
    publish("# A\n\nrun 1\n", "a", a1, record, tmp_path)
    publish("# B\n\nrun 1\n", "b", [Target("b's target", "3 / 4", None)], record, tmp_path)
    (tmp_path / "c.md").write_text("# C, by hand\n")
    assert index_rows(tmp_path) == [
        "| [a](a.md) | a / b <= 0.75 | 0.50 | met | 2026-12-06 | 2 CPUs (x86_64) |",
        "| [a](a.md) | answers equal \\| exact | no | **missed** | 2026-12-06 | 2 CPUs (x86_64) |",
        "| [b](b.md) | b's target | 3 / 4 | not measured | 2026-12-06 | 2 CPUs (x86_64) |"]
    publish("# A\n\nrun 2\n", "a", [target("a / b", verdict(0.8, "<=", 0.75))],
            dict(record, date="2026-12-07 09:00 UTC"), tmp_path, machine="1 x GPU")
    rows = index_rows(tmp_path)
    assert rows[0] == "| [a](a.md) | a / b <= 0.75 | 0.80 | **missed** | 2026-12-07 | 1 x GPU |"
    assert len(rows) == 2 and rows[1].startswith("| [b](b.md) |")  # b's row untouched, a's second gone
    assert "run 2" in (tmp_path / "a.md").read_text()
    assert (tmp_path / INDEX).read_text().rstrip().endswith("Pages without a target: [c](c.md).")
    publish("# A\n\nrun 3\n", "a", [], record, "")  # no pages folder: nothing written
    assert "run 2" in (tmp_path / "a.md").read_text()


def test_verdicts_and_labels_are_computed() -> None:
    assert verdict(0.7, "<=", 0.75) == {"value": 0.7, "target": "<= 0.75", "met": True}
    assert verdict(0.75, ">=", 0.8)["met"] is False and verdict(None, ">=", 1)["met"] is None
    assert is_contended([1.0, 0, 0], 2) and not is_contended([0.9, 0, 0], 2)
    assert "contended" not in load_label([0.2, 0, 0], [0.5, 0, 0], 2)
    assert "**contended**" in load_label([7.5, 0, 0], None, 2)


def test_rounds_table_gives_each_name_its_median_and_rounds() -> None:
    from scripts.bench.docs import rounds_table

    rows = rounds_table("app", "serve.delete, s", {"a": [3.0, 1.0, 2.0], "b": [0.5]}, {"a": "A", "b": "B"})
    assert rows[0] == "| app | what it is | serve.delete, s (median of rounds) | rounds |"
    assert rows[2:] == ["| a | A | 2.00 | 3.00, 1.00, 2.00 |", "| b | B | 0.50 | 0.50 |"]


def test_bench_shutdown_verdicts_come_from_the_medians() -> None:
    from scripts.bench import shutdown as bench_shutdown

    results = {"delete_s": {"ours": [1.0, 1.2, 1.1], "floor_default": [3.0, 3.0, 3.1],
                            "floor_fast": [1.0, 1.0, 1.0]}}
    v = bench_shutdown.verdicts(results)
    assert v["over_floor"]["met"] and abs(v["over_floor"]["value"] - 0.1) < 1e-9  # 1.1 - 1.0
    assert v["vs_default"]["met"] and abs(v["vs_default"]["value"] - 1.1 / 3.0) < 1e-9
    results["delete_s"]["ours"] = [3.5, 3.5, 3.5]  # slower than Serve's default: both missed
    assert not any(x["met"] for x in bench_shutdown.verdicts(results).values())


def test_bench_replicas_verdicts_come_from_the_medians() -> None:
    from scripts.bench import replicas as bench_replicas

    def rounds(ingress: tuple[float, float], backend: tuple[float, float]) -> list[dict[str, dict[str, float]]]:
        return [{role: {"cpu_s": cpu + d, "pss_mb": pss + d, "rss_mb": 0.0}
                 for role, (cpu, pss) in (("ingress", ingress), ("backend", backend))} for d in (0.0, -0.1, 0.1)]

    results = {"rounds": {"ours": rounds((1.3, 88.0), (1.1, 86.0)), "floor": rounds((1.2, 87.0), (1.0, 84.0)),
                          "floor_torch": rounds((2.6, 212.0), (2.2, 209.0))}}
    v = bench_replicas.verdicts(results)
    assert all(x["met"] for x in v.values()) and len(v) == 8
    assert abs(v["ingress_cpu_over_floor"]["value"] - 0.1) < 1e-9
    assert abs(v["backend_pss_vs_floor_torch"]["value"] - 86 / 209) < 1e-9
    results["rounds"]["ours"] = rounds((2.7, 213.0), (2.8, 212.0))  # replicas importing torch miss every target
    assert not any(x["met"] for x in bench_replicas.verdicts(results).values())
