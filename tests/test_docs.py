"""The user documentation (README.md, docs/*.md) agrees with the code and stays within the repository.

- docs/cli.md's synopses name every option of `python -m moe_runtime forward` and `plan`;
- docs/serving.md names every argument of the app and every metric the replicas export;
- relative links point to files (and headings) that exist;
- nothing points outside the repository (a user who clones it has nothing else) or to internal
  tracker numbers; the README stays short (details belong in docs/).

The benchmark pages (docs/benchmarks/) are left to the scripts that write them, except for the links
and the outside-the-repo check.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]  # written by hand
PAGES = sorted((ROOT / "docs" / "benchmarks").glob("*.md"))  # written by the benchmark scripts
README_MAX_LINES = 200


def _rel(p: Path) -> str:
    return p.relative_to(ROOT).as_posix()


def section(text: str, heading: str) -> str:
    """The body of the ``## heading`` section (up to the next heading of level 1 or 2)."""
    match = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^#{{1,2}} |\Z)", text, flags=re.S | re.M)
    assert match, f"no section '## {heading}'"
    return match.group(1)


def subcommand_options(name: str) -> set[str]:
    from moe_runtime.cli import parser

    sub = next(a for a in parser()._actions if isinstance(a, argparse._SubParsersAction))
    parser = sub.choices[name]
    return {o for a in parser._actions for o in a.option_strings if o.startswith("--") and o != "--help"}


@pytest.mark.parametrize("command", ["forward", "plan"])
def test_cli_doc_lists_every_option(command: str) -> None:
    text = (ROOT / "docs/cli.md").read_text()
    body = section(text, f"`{command}`: synopsis")
    synopsis = re.search(r"```text\n(.*?)```", body, flags=re.S).group(1)
    table = body[body.index("```", body.index("```text") + 3):]
    options = subcommand_options(command)
    assert options, command
    missing = sorted(o for o in options if not re.search(rf"{re.escape(o)}(?![\w-])", synopsis))
    assert not missing, f"docs/cli.md's {command} synopsis lacks {missing}"
    undocumented = sorted(o for o in options if f"`{o}" not in table)
    assert not undocumented, f"docs/cli.md's {command} table lacks {undocumented}"
    named = set(re.findall(r"--[a-z][a-z0-9-]*", synopsis))
    assert named <= options, f"docs/cli.md's {command} synopsis names options the CLI lacks: {named - options}"


def test_serving_doc_names_every_app_argument() -> None:
    from deployments.config.spec import AppArgs, AutoscalingSpec, DeploymentSpec

    text = (ROOT / "docs/serving.md").read_text()
    fields = set(AppArgs.model_fields) | set(DeploymentSpec.model_fields) | set(AutoscalingSpec.model_fields)
    missing = sorted(f for f in fields if f"`{f}`" not in text)
    assert not missing, f"docs/serving.md does not name the app argument(s) {missing}"


def test_serving_doc_names_every_metric() -> None:
    from deployments.serve import metrics

    names = {v for k, v in vars(metrics).items() if k.endswith("_METRIC")}
    text = (ROOT / "docs/serving.md").read_text()
    documented = set(re.findall(r"`ray_(moe_[a-z_]+?)(?:_total)?`", text))
    assert documented == names, (sorted(names - documented), sorted(documented - names))


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return {github_anchor(h) for h in re.findall(r"^#{1,6} (.+)$", text, flags=re.M)}


@pytest.mark.parametrize("doc", DOCS + PAGES, ids=_rel)
def test_relative_links_resolve(doc: Path) -> None:
    text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        exists = dest.exists() and ROOT in dest.parents
        if not exists or (anchor and dest.suffix == ".md" and anchor not in anchors(dest)):
            broken.append(target)
    assert not broken, f"{_rel(doc)}: broken links {broken}"


OUTSIDE = re.compile(r"\.\./shared|shared/DESIGN|DESIGN\.md|/work/shared")
TRACKER = re.compile(r"\bissues? ?#?\d+|\bissue-\d+", re.I)


@pytest.mark.parametrize("doc", DOCS + PAGES, ids=_rel)
def test_no_reference_outside_the_repository(doc: Path) -> None:
    hits = [line for line in doc.read_text().splitlines() if OUTSIDE.search(line)]
    assert not hits, f"{_rel(doc)} points outside the repository: {hits}"


@pytest.mark.parametrize("doc", DOCS, ids=_rel)
def test_no_internal_tracker_numbers(doc: Path) -> None:
    hits = [line for line in doc.read_text().splitlines() if TRACKER.search(line)]
    assert not hits, f"{_rel(doc)} cites internal issue numbers: {hits}"


def test_readme_is_short_and_points_into_docs() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= README_MAX_LINES
    linked = set(re.findall(r"\]\((docs/[^)#]+)", text))
    written = {_rel(p) for p in DOCS if p != README}
    assert written <= linked, f"README's 'Where to go next' misses {sorted(written - linked)}"
