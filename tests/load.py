"""``CallLoop``: calls kept going in a thread while a test breaks something under them (tests
import it as ``from load import CallLoop``, as they import ``waiting``)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from waiting import wait_until


class CallLoop:
    """``call()`` over and over in a thread of its own until stopped, keeping every answer
    (``results``) and every exception raised (``errors``; the loop goes on after one).

    As a context manager it starts the thread and returns once the first call has ended, and on
    the way out stops the loop and asserts that its last call ended too (none hung).
    """

    def __init__(self, call: Callable[[], Any], join_timeout_s: float = 120.0):
        self.call, self.join_timeout_s = call, join_timeout_s
        self.results: list[Any] = []
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="call-loop", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.results.append(self.call())
            except BaseException as e:  # noqa: BLE001 -- the test asserts on them
                self.errors.append(e)

    def calls(self) -> int:
        """Calls ended so far, answered or not."""
        return len(self.results) + len(self.errors)

    def __enter__(self) -> CallLoop:
        self._thread.start()
        wait_until(self.calls, timeout_s=60, what="the loop's first call")
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.join_timeout_s)
        assert not self._thread.is_alive(), f"a call still runs {self.join_timeout_s:g} s after the loop stopped"

    def __exit__(self, *exc: object) -> None:
        self.stop()
