"""The attention-worker protocol of cohorts (``client.cohort``): subclass, implement five
methods, run it as a Ray actor.

    class MyWorker(AttentionWorker):
        def start(self, step_input): ...        # a new decode step begins
        def attend(self, layer): ...            # -> x_TH: rows for MoE layer `layer` this step
        def absorb(self, layer, moe_out_TH): ...
        def finish(self): ...                   # -> whatever cohort.step returns for this worker
        def abort(self): ...                    # undo the current step (state as before start)

    workers = [ray.remote(MyWorker).remote(...) for _ in range(M)]

``attend`` returns the same number of rows ``T >= 0`` for every layer of a step (a worker with
nothing to send returns ``[0, H]``: it adds nothing to the expert batch), as a numpy float32 array
(rounded to the deployment dtype, as the Serve path does) or a torch tensor in the deployment
dtype; ``absorb`` gets the layer's output for exactly those rows in the same kind. Rows of the
wrong shape, dtype, count or with NaN/Inf fail the step loudly, naming the worker
(:class:`~deployments.client.errors.WorkerError`); so does an exception in any of the five
methods. Methods are plain (not ``async``) and called one at a time on the actor's thread: a
step on the data plane is one actor call (``cohort_step``) in which the worker is a peer of the
cohort's session and drives its own layers; on the Serve path the driver calls them one by one.

The ``cohort_*`` methods are the cohort's side of the protocol; a subclass leaves them alone.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from moe_runtime.layer import check_hidden
from moe_runtime.units import torch_dtype

from ..common.requests import as_rows, is_torch_tensor
from ..common.wire import WireTensor
from ..dataplane.errors import Failure, SessionError
from ..dataplane.peer import Peer, SessionTicket
from .errors import WorkerError


class WorkerSeat:
    """A worker's place in a cohort: who it is, what rows it may send, where its step is."""

    def __init__(self, index: int, name: str, hidden_size: int, dtypes: dict[int, str], max_tokens: int,
                 epoch: int, undo: Callable[[], None]):
        self.index, self.name, self.hidden_size, self.max_tokens = index, name, hidden_size, max_tokens
        self.undo = undo  # the worker's abort()
        self.dtypes = {int(layer): d for layer, d in dtypes.items()}  # names
        self.epoch = epoch  # an abort moves it on: calls of the aborted attempt are refused
        self.peer: Peer | None = None  # this worker's place in the cohort's session
        self.started = False  # start() ran (or began) for the current step
        self.abort_due = False  # an abort arrived while a call ran: undo before anything else
        self.tokens: int | None = None  # rows per layer this step, from its first attend
        self.numpy: set[int] = set()  # layers whose attend gave numpy this step: absorb gets numpy
        self.phase, self.since = "idle", time.monotonic()
        self.lock = threading.Lock()  # one protocol call at a time (a step vs an abort)

    def fail(self, message: str) -> WorkerError:
        return WorkerError(self.index, self.name, message)

    @contextmanager
    def running(self, epoch: int, phase: str):
        """One protocol call, under the seat's lock (so an abort never overlaps it), if its step
        is current; the user code's exceptions name the worker."""
        with self.lock:
            self.settle()
            if epoch != self.epoch:
                raise self.fail(f"{phase} of an aborted step (epoch {epoch}, now {self.epoch}) refused")
            self.phase, self.since = phase, time.monotonic()
            try:
                yield
            except WorkerError:
                raise
            except Exception as e:
                raise self.fail(f"{phase} raised {type(e).__name__}: {e}") from e
            finally:
                self.phase = "idle"

    def abort(self, epoch: int, wait_s: float) -> bool:
        """Refuse the aborted attempt's calls from now on and undo its step: at once, or -- when a
        call still runs after ``wait_s`` (False) -- as soon as it returns, before any other."""
        self.epoch, self.abort_due = epoch, True
        if not self.lock.acquire(timeout=wait_s):
            return False
        try:
            self.settle()
        finally:
            self.lock.release()
        return True

    def settle(self) -> None:
        """A due abort, under the lock."""
        if not self.abort_due:
            return
        self.abort_due = False
        if self.started:
            self.started = False
            try:
                self.undo()
            except Exception as e:
                raise self.fail(f"abort raised {type(e).__name__}: {e}") from e

    def rows(self, x: Any, layer: int) -> WireTensor:
        """``attend``'s rows, checked and ready for the ranks."""
        dtype = self.dtypes[layer]
        try:
            t = x if is_torch_tensor(x) else as_rows(x, "attend's rows", dtype).to_torch()
            check_hidden(t, self.hidden_size, torch_dtype(dtype), self.max_tokens, allow_empty=True,
                         what=f"attend({layer})'s rows")
        except ValueError as e:
            raise self.fail(str(e)) from None
        if isinstance(x, np.ndarray):
            self.numpy.add(layer)
        if self.tokens is None:
            self.tokens = t.shape[0]
        elif t.shape[0] != self.tokens:
            raise self.fail(f"attend({layer}) returned {t.shape[0]} rows, but {self.tokens} earlier in this "
                            "step (every layer of a step takes the same rows)")
        return WireTensor.from_torch(t)

    def give(self, rows: torch.Tensor, layer: int) -> Any:
        """The layer's output for this worker's rows, in the kind ``attend`` gave."""
        return rows.float().cpu().numpy() if layer in self.numpy else rows


class AttentionWorker:
    """Base class of a cohort's attention workers; see the module doc."""

    def start(self, step_input: Any) -> None:
        raise NotImplementedError

    def attend(self, layer: int) -> Any:
        raise NotImplementedError

    def absorb(self, layer: int, moe_out_TH: Any) -> None:
        raise NotImplementedError

    def finish(self) -> Any:
        raise NotImplementedError

    def abort(self) -> None:
        raise NotImplementedError

    # -- the cohort's side ----------------------------------------------------------------

    def cohort_join(self, index: int, hidden_size: int, dtypes: dict[int, str], max_tokens: int,
                    epoch: int) -> dict[str, Any]:
        """Take seat ``index`` of a cohort; returns this worker's name."""
        import ray

        ctx = ray.get_runtime_context()
        name = ctx.get_actor_name() or f"{type(self).__name__}:{ctx.get_actor_id()[:8]}"
        self.__seat = WorkerSeat(index, name, hidden_size, dtypes, max_tokens, epoch, self.abort)
        return {"name": name}

    def cohort_session(self, ticket: SessionTicket | None) -> None:
        """Join the cohort's session as peer ``index`` (None: leave the one joined)."""
        seat = self._cohort_seat()
        if seat.peer is not None:
            seat.peer.close("the cohort left its session")
            seat.peer = None
        if ticket is not None:
            seat.peer = ticket.join(seat.index)

    def cohort_step(self, epoch: int, step_input: Any, layers: list[int]) -> dict[str, Any]:
        """One decode step on the data plane: start, then per layer attend -> the session's one
        forward -> absorb, then finish; ``{"result": finish()'s, "moves": this peer's moves to a
        healthy group during the step}``. A failure of this worker's own code still takes part in
        the next layer the others wait on (``Peer.fail``), so they are released at once with an
        error naming this worker."""
        seat = self._cohort_seat()
        if seat.peer is None:
            raise RuntimeError("the cohort has not joined this worker to its session")
        moved = len(seat.peer.moves)
        owed = 0  # the next layer this worker must send (the other peers wait for it)
        try:
            self.cohort_start(epoch, step_input)
            for layer in layers:
                x = self.cohort_attend(epoch, layer)
                owed += 1  # sent below, whatever the answer
                try:
                    out, _ = seat.peer.forward_wire(x, layer)
                except SessionError as e:
                    if e.failure is not Failure.INPUT:
                        raise  # every peer's layer (or the session) ended: nobody waits for this one
                    raise seat.fail(f"rank 0 refused its rows for layer {layer}: {e.message}") from None
                self.cohort_absorb(epoch, layer, out.to_torch())
            return {"result": self.cohort_finish(epoch), "moves": seat.peer.moves[moved:]}
        except WorkerError as e:
            if owed < len(layers) and seat.peer.closed is None:  # the others go on to that layer
                seat.peer.fail(layers[owed], e.message)
            raise

    def _cohort_seat(self) -> WorkerSeat:
        seat = getattr(self, "_AttentionWorker__seat", None)
        if seat is None:
            raise RuntimeError(f"{type(self).__name__} has not joined a cohort")
        return seat

    def cohort_start(self, epoch: int, step_input: Any) -> None:
        seat = self._cohort_seat()
        with seat.running(epoch, "start"):
            seat.tokens, seat.started, seat.step_epoch = None, True, epoch
            seat.numpy.clear()
            self.start(step_input)

    def cohort_attend(self, epoch: int, layer: int) -> Any:
        seat = self._cohort_seat()
        with seat.running(epoch, f"attend({layer})"):
            return seat.rows(self.attend(layer), layer)

    def cohort_absorb(self, epoch: int, layer: int, rows: torch.Tensor) -> None:
        seat = self._cohort_seat()
        with seat.running(epoch, f"absorb({layer})"):
            self.absorb(layer, seat.give(rows, layer))

    def cohort_finish(self, epoch: int) -> Any:
        seat = self._cohort_seat()
        with seat.running(epoch, "finish"):
            result = self.finish()
            seat.started = False
            return result

    def cohort_abort(self, epoch: int, wait_s: float) -> bool:
        """Refuse every call of older epochs and undo the current step (``abort()``, when a step
        started); False when a call still ran after ``wait_s`` (it is undone once that returns)."""
        return self._cohort_seat().abort(epoch, wait_s)

    def cohort_state(self) -> dict[str, Any]:
        """What this worker is doing (for a stalled step's diagnosis; answers on the main thread)."""
        seat = self._cohort_seat()
        return {"phase": seat.phase, "for_s": round(time.monotonic() - seat.since, 3), "epoch": seat.epoch}
