"""The benchmark scripts stay lean: no function of scripts/bench/ runs over 60 lines (a longer one
is a measurement and its report tangled together; the harness or a helper takes the shared part),
and the room as a whole holds at most 5,000 lines (issue 49: the scripts keep what they measure)."""

import ast
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "scripts" / "bench"
MAX_LINES = 60
MAX_ROOM_LINES = 5000


def room_lines() -> int:
    return sum(len(path.read_text().splitlines()) for path in BENCH.glob("*.py"))


def long_functions() -> dict[tuple[str, str], int]:
    found = {}
    for path in sorted(BENCH.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_LINES:
                    found[(path.name, node.name)] = lines
    return found


def test_no_function_over_the_limit():
    over = long_functions()
    assert not over, f"functions over {MAX_LINES} lines: {over}"


def test_the_room_holds_at_most_5000_lines():
    assert room_lines() <= MAX_ROOM_LINES, f"scripts/bench/*.py: {room_lines()} lines"
