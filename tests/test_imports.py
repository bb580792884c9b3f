"""The import graph of the project's own modules (library, scripts and tests): no cycle, and no
private name (``_x``) imported across modules: a piece two modules share is public in one home."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOPS = ("moe_runtime", "deployments", "scripts", "tests")


def module_names() -> dict[str, Path]:
    """Dotted name -> file. Scripts and tests also answer to the bare names their folder on
    sys.path gives them (``bench.harness``, ``conftest``, ``test_serve_cli``)."""
    names = {}
    for top in TOPS:
        for path in (ROOT / top).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            names[".".join(parts)] = path
            if top in ("scripts", "tests"):
                names[".".join(parts[1:])] = path
    return names


def imports(name: str, path: Path, names: dict[str, Path]) -> list[tuple[str, str]]:
    """``(module, imported name or "")`` of every import of the project's modules in ``path``,
    wherever it stands (functions included)."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(a.name, "") for a in node.names if a.name in names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            for alias in node.names:
                full = f"{target}.{alias.name}"
                if full in names:
                    found.append((full, ""))
                elif target in names:
                    found.append((target, alias.name))
    return found


def graph() -> tuple[dict[str, set[str]], list[str]]:
    names = module_names()
    files = {path: name for name, path in sorted(names.items(), key=lambda kv: len(kv[0]), reverse=True)}
    canon = {name: files[path] for name, path in names.items()}
    edges: dict[str, set[str]] = {}
    private = []
    for path, name in files.items():
        deps = set()
        for target, imported in imports(name, path, names):
            deps.add(canon[target])
            if imported.startswith("_") and not imported.startswith("__"):
                private.append(f"{name} imports {imported} from {canon[target]}")
        edges[name] = deps - {name}
    return edges, private


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle():
    edges, _ = graph()
    assert len(edges) > 100  # every module was read
    assert "deployments.client.errors" in edges["deployments.client.moe_client"]
    assert cycles(edges) == []


def test_the_shared_floors_never_import_the_serve_or_client_side():
    """common, config, control, cluster and the data plane sit under serve/ and client/: an arrow
    up from them (a shared name kept in serve/, say) belongs in common/ instead."""
    edges, _ = graph()
    lower = tuple(f"deployments.{p}." for p in ("common", "config", "control", "cluster", "dataplane"))
    upper = ("deployments.serve.", "deployments.client.")
    up = sorted(f"{a} -> {b}" for a, deps in edges.items() if a.startswith(lower) for b in deps
                if b.startswith(upper))
    assert up == []


def test_no_private_name_crosses_a_module():
    _, private = graph()
    assert private == []


def test_the_checks_catch_what_they_look_for():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
