"""One logger for the runtime, and a log-once helper for decisions (not per-request events)."""

from __future__ import annotations

import logging

logger = logging.getLogger("moe_runtime")
_logged: set[str] = set()


def log_once(message: str, log: logging.Logger = logger, level: int = logging.INFO) -> None:
    """Log ``message`` the first time only: what was decided (tail, device, backend), once."""
    if message not in _logged:
        _logged.add(message)
        log.log(level, message)
