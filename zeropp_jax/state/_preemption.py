"""Stopping at a step every process agrees on, when the scheduler says so.

Cluster schedulers (SLURM, Kubernetes, spot and preemptible VMs) send SIGTERM, then
SIGKILL after a grace period. `StopGuard` catches SIGTERM and SIGINT and answers, after
each step, whether the training loop should stop there (save a checkpoint and exit):

    with zpp.StopGuard() as guard:
        for step in range(start, steps):
            state, metrics = train_step(state, batch(step))
            if guard.should_stop(step + 1):
                zpp.save_checkpoint(path(step + 1), state)
                break

One process stops at the step it is on. Several processes (`jax.distributed`) must stop
at the same step, since the checkpoint save is collective: the first process to see a
signal proposes `step + MARGIN` through the coordination service's key-value store (the
first proposal wins), and every process reads it after each step, so all stop after the
same step. Processes cannot be more than one step apart (every step's collectives need
all of them), so a proposal made after step `s` is seen by every process by the end of
step `s + 1` at the latest, before the agreed `s + 2`. Every call is bounded in time: the
store's read never blocks, a write waits at most `timeout_s`.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterable
from types import FrameType
from typing import Any

from zeropp_jax.interpreter import _jaxpr_compat as jaxpr_compat

KEY = "zeropp_jax/stop_step"
"""The coordination-service key that holds the agreed stop step."""

MARGIN = 2
"""Steps between a proposal and the agreed stop step (see the module docstring)."""

SIGNALS = (signal.SIGTERM, signal.SIGINT)
"""What `StopGuard` catches by default."""


def _client() -> Any:
    """The `jax.distributed` client, or None when this process runs alone."""
    return jaxpr_compat.distributed_client()


class StopGuard:
    """Catches stop signals and says, after each step, whether to stop there.

    Args:
      signals: the signals to catch (default SIGTERM and SIGINT); the previous handlers
        come back on `close()` / leaving the `with` block.
      key: the key-value store key of the agreed step (several guards in one job need
        different keys).
      timeout_s: bound on a write to the coordination service, in seconds.

    Attributes:
      signal_received: the number of the first signal caught, or None.
      stop_step: the agreed step to stop after, once known, else None.

    Install it in the main thread (Python delivers signals there). A second signal while
    the checkpoint is being written is recorded and otherwise ignored: the save finishes,
    and a save that is cut short by SIGKILL leaves the previous checkpoint intact (see
    `zpp.save_checkpoint`).
    """

    def __init__(
        self,
        signals: Iterable[int] = SIGNALS,
        *,
        key: str = KEY,
        timeout_s: float = 30.0,
    ) -> None:
        self.signals = tuple(signals)
        self.key = key
        self.timeout_s = timeout_s
        self.signal_received: int | None = None
        self.signals_received = 0
        self.stop_step: int | None = None
        self._previous: dict[int, Any] = {}
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ installing

    def install(self) -> StopGuard:
        """Installs the handlers (main thread only). Returns self."""
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError(
                "StopGuard.install: signal handlers can only be installed from the main "
                "thread; create the guard there."
            )
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def close(self) -> None:
        """Puts the previous handlers back."""
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def __enter__(self) -> StopGuard:
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        with self._lock:
            self.signals_received += 1
            if self.signal_received is None:
                self.signal_received = signum

    # -------------------------------------------------------------------- deciding

    def should_stop(self, step: int) -> bool:
        """Whether to stop after `step` (the number of steps done). Call it after every
        step, on every process, with the same step numbers.

        Alone, it is True from the first step after a signal. Under `jax.distributed`, a
        process that caught a signal proposes `step + MARGIN`; it is True on every process
        at the agreed step.

        Raises:
          RuntimeError: when the agreed step has already passed (a process skipped calls).
        """
        client = _client()
        if client is None:
            if self.signal_received is not None and self.stop_step is None:
                self.stop_step = step
            return self.stop_step is not None and step >= self.stop_step
        if self.stop_step is None:
            self.stop_step = self._read(client)
        if self.stop_step is None and self.signal_received is not None:
            self.stop_step = self._propose(client, step + MARGIN)
        if self.stop_step is None:
            return False
        if step > self.stop_step:
            raise RuntimeError(
                f"StopGuard: the processes agreed to stop after step {self.stop_step}, but "
                f"this process is at step {step}; call should_stop after every step on "
                "every process."
            )
        return step == self.stop_step

    def _read(self, client: Any) -> int | None:
        try:
            return int(client.key_value_try_get(self.key))
        except Exception as e:  # the store raises NOT_FOUND for a missing key
            if "NOT_FOUND" in str(e) or "not found" in str(e).lower():
                return None
            raise

    def _propose(self, client: Any, step: int) -> int:
        try:
            client.key_value_set(self.key, str(step))
        except Exception as e:  # ALREADY_EXISTS: another process proposed first
            if "ALREADY_EXISTS" not in str(e) and "already exists" not in str(e).lower():
                raise
        agreed = client.blocking_key_value_get(self.key, int(self.timeout_s * 1000))
        return int(agreed)
