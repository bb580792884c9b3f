"""Results files that keep up with the measurement (JSON lines): a header record, a ``row`` record per
point appended (file opened, written, closed) the moment it is measured, then a ``done`` record; a
process killed by a time limit loses at most one point. No torch import: summaries read them cheaply.
"""

from __future__ import annotations

import json
from pathlib import Path

from .harness import loadavg


class RowWriter:
    """A JSON-lines results file that is never more than one point behind the measurement."""

    def __init__(self, path: Path, **header) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps({"record": "header", **header, "loadavg": loadavg()}) + "\n")

    def _append(self, record: dict) -> None:
        with self.path.open("a") as f:  # opened per record: a killed process loses no buffered row
            f.write(json.dumps(record) + "\n")

    def row(self, row: dict) -> None:
        self._append({"record": "row", **row})

    def close(self, **info) -> None:
        self._append({"record": "done", **info, "loadavg": loadavg()})


def read_rows(path: Path) -> tuple[dict, list[dict], dict | None]:
    """(header, rows, closing record or None when cut off); a half-written last line is dropped."""
    header, rows, done = {}, [], None
    for line in Path(path).read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        kind = record.pop("record", None)
        header, done = (record if kind == "header" else header), (record if kind == "done" else done)
        if kind == "row":
            rows.append(record)
    return header, rows, done
