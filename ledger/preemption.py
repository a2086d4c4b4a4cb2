"""Preemption: on SIGTERM or SIGUSR1, finish the batch, save, exit.

Schedulers announce the end of a job with a signal before they kill it. SLURM sends
SIGTERM when it preempts or cancels a job (then SIGKILL after ``GraceTime`` /
``KillWait``), and any signal you ask for ahead of the time limit
(``#SBATCH --signal=USR1@90``); it signals every process of the job step, DataLoader
workers included. Spot and preemptible VM agents commonly forward their notice as
SIGTERM. Python's default for both signals is to die on the spot, mid-step, losing
everything since the last checkpoint.

:func:`handle` installs a handler that only records the signal. The training loop
looks at the record at its next batch boundary and saves the model with
``loader.state_dict()``; the resumed run then continues the stream exactly::

    with ledger.preemption.handle() as preempt:
        for batch in loader:
            train_step(batch)
            if preempt.requested:  # distributed: preempt.agreed()
                torch.save({"model": model.state_dict(), "data": loader.state_dict()}, path)
                sys.exit(0)

With ``handle(stop_loaders=True)`` every :class:`ledger.DataLoader` iterating in the
process raises :class:`ledger.errors.Preempted` at its next batch boundary instead of
loading another batch (a safety net for loops that forget to look; the loader's state is
then the one after the last batch it handed out, so ``loader.state_dict()`` is exact).

Rules, as in PyTorch Lightning's and submitit's SLURM handlers:

- Install it in the main thread (Python runs signal handlers only there), before the
  loader's first iteration, so that its workers start with the signals ignored: a signal
  sent to the whole process group must not kill a worker the main process still needs
  for nothing, nor make torch raise "DataLoader worker exited unexpectedly".
- Handlers installed before are chained: a Python callable runs after the signal is
  recorded. ``SIG_DFL`` and ``SIG_IGN`` are not (dying at once is what this avoids).
- A second signal is recorded like the first (SLURM may send SIGUSR1 then SIGTERM);
  what stops a hung process is the scheduler's SIGKILL.
- Leaving the ``with`` block (or :meth:`Preemption.restore`) puts the previous handlers
  back, unless someone else replaced ours meanwhile (then theirs stays, with a warning).
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from types import FrameType
from typing import Any, TypeVar

from ledger.errors import LedgerError, Preempted

DEFAULT_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGUSR1)
"""What :func:`handle` catches by default: SLURM's and spot notices' signals."""

logger = logging.getLogger("ledger")

_installed: list[Preemption] = []  # installed handlers, oldest first
_T = TypeVar("_T")

_Handler = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None


class Preemption:
    """One installation of the preemption handler (use :func:`handle` to make one).

    Attributes:
        signals: the signals handled.
        stop_loaders: whether ledger loaders raise :class:`~ledger.errors.Preempted` at
            their next batch boundary once a signal arrived.
        chain: whether previously installed Python handlers run too.
    """

    def __init__(
        self,
        signals: Iterable[int] = DEFAULT_SIGNALS,
        *,
        stop_loaders: bool = False,
        chain: bool = True,
    ) -> None:
        self.signals = tuple(signal.Signals(s) for s in signals)
        if not self.signals:
            raise ValueError("handle() needs at least one signal")
        self.stop_loaders = stop_loaders
        self.chain = chain
        self._signal: signal.Signals | None = None
        self._count = 0
        self._at: float | None = None
        self._logged = False
        self._previous: dict[signal.Signals, _Handler] = {}
        self._handler = self._on_signal  # one bound method, compared by identity

    # ------------------------------------------------------------------ the record

    @property
    def requested(self) -> bool:
        """Whether one of the signals arrived since :meth:`install` (this process only)."""
        if self._signal is None:
            return False
        if not self._logged:  # logged here, not in the handler: logging takes locks
            self._logged = True
            logger.warning(
                "%s received: save the model and loader.state_dict() at this batch "
                "boundary, then exit",
                self._signal.name,
            )
        return True

    @property
    def signal(self) -> signal.Signals | None:
        """The first signal received, or ``None``."""
        return self._signal

    @property
    def count(self) -> int:
        """How many of the signals arrived since :meth:`install`."""
        return self._count

    @property
    def received_at(self) -> float | None:
        """When the first signal arrived (``time.time()``, seconds), or ``None``."""
        return self._at

    def agreed(self, group: Any = None) -> bool:
        """Whether any rank received a signal: the same answer on every rank.

        Ranks see a signal at different batch boundaries; saving must not start on one
        rank a step before another (``loader.state_dict()`` is a collective commit).
        Call it at every step on every rank: it is one ``all_reduce`` (MAX) of one
        ``int32`` (on the current CUDA device under NCCL). Without an initialised
        ``torch.distributed`` it is :attr:`requested`.

        Args:
            group: the process group (default: the world).
        """
        import torch
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return self.requested
        device = (
            torch.device("cuda", torch.cuda.current_device())
            if dist.get_backend(group) == "nccl"
            else torch.device("cpu")
        )
        flag = torch.tensor([int(self._signal is not None)], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        self.requested  # noqa: B018  (logs this rank's own signal once)
        return bool(flag.item())

    def check(self) -> None:
        """Raise :class:`~ledger.errors.Preempted` if a signal arrived.

        Raises:
            Preempted: naming the signal.
        """
        if self.requested:
            raise Preempted(_message(self._signal), self._signal)

    # ------------------------------------------------------------------ installation

    def install(self) -> Preemption:
        """Install the handler for :attr:`signals`, recording the ones it replaces.

        Returns:
            ``self``.

        Raises:
            LedgerError: if called outside the main thread (Python delivers signals to
                the main thread only), or if this handler is installed already. Nothing
                is installed then.
        """
        if threading.current_thread() is not threading.main_thread():
            raise LedgerError(
                "ledger.preemption.handle() must be installed in the main thread: Python "
                "runs signal handlers only there (install it before starting threads)"
            )
        if self in _installed:
            raise LedgerError("this preemption handler is installed already")
        self._signal, self._count, self._at, self._logged = None, 0, None, False
        self._previous = {s: signal.getsignal(s) for s in self.signals}
        for s in self.signals:
            signal.signal(s, self._handler)
        _installed.append(self)
        return self

    def restore(self) -> None:
        """Put back the handlers :meth:`install` replaced. Idempotent.

        A handler someone installed over ours since is left in place (with a warning):
        restoring ours' predecessor would silently drop theirs.
        """
        if self not in _installed:
            return
        _installed.remove(self)
        for s, previous in self._previous.items():
            if signal.getsignal(s) is self._handler:
                signal.signal(s, previous if previous is not None else signal.SIG_DFL)
            else:
                logger.warning(
                    "the %s handler was replaced while ledger.preemption was installed; "
                    "leaving the new one in place",
                    s.name,
                )

    def __enter__(self) -> Preemption:
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.restore()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # Only assignments here: the handler runs between two bytecodes of the main
        # thread, possibly inside a lock the training loop holds.
        if self._signal is None:
            self._signal = signal.Signals(signum)
            self._at = time.time()
        self._count += 1
        previous = self._previous.get(signal.Signals(signum))
        if self.chain and callable(previous):
            previous(signum, frame)


def handle(
    signals: Iterable[int] = DEFAULT_SIGNALS,
    *,
    stop_loaders: bool = False,
    chain: bool = True,
) -> Preemption:
    """A preemption handler, installed on entering ``with`` (or by ``.install()``).

    Args:
        signals: signals to catch (default SIGTERM and SIGUSR1).
        stop_loaders: make every :class:`ledger.DataLoader` iterating in this process
            raise :class:`~ledger.errors.Preempted` at its next batch boundary (before
            loading another batch) once a signal arrived. In distributed training, where
            ranks must stop at the same step, leave it off and test
            :meth:`Preemption.agreed` at every step instead.
        chain: also run the Python handlers installed before (after recording).

    Returns:
        The :class:`Preemption`, not yet installed.

    Raises:
        ValueError: if ``signals`` is empty or names no signal.
    """
    return Preemption(signals, stop_loaders=stop_loaders, chain=chain)


def requested() -> bool:
    """Whether an installed handler (:func:`handle`) received its signal in this process.

    For code that does not hold the handler, e.g. a callback deep in a training loop.
    """
    return any(p.requested for p in _installed)


def installed_signals() -> frozenset[int]:
    """The signals installed handlers catch (for the loader's workers to ignore)."""
    return frozenset(int(s) for p in _installed for s in p.signals)


def ignore_in_worker(signals: Iterable[int]) -> None:
    """Ignore ``signals`` in a DataLoader worker: the main process decides when to stop,
    and a worker dies with it (``PR_SET_PDEATHSIG``, see :mod:`ledger.loader`)."""
    for s in signals:
        signal.signal(s, signal.SIG_IGN)


def at_batch_boundaries(batches: Iterator[_T]) -> Iterator[_T]:
    """``batches``, raising :class:`~ledger.errors.Preempted` before fetching the next
    batch once a ``stop_loaders`` handler received its signal.

    The check runs before the next batch is asked for, so every batch handed out was
    recorded and none is lost: ``loader.state_dict()`` after the exception is exact.
    """
    try:
        while True:
            for p in _installed:
                if p.stop_loaders:
                    p.check()
            try:
                batch = next(batches)
            except StopIteration:
                return
            yield batch
    finally:
        close = getattr(batches, "close", None)
        if close is not None:
            close()


def _message(sig: signal.Signals | None) -> str:
    name = sig.name if sig is not None else "a preemption signal"
    return (
        f"{name} received: the loader stopped at a batch boundary; save the model and "
        "loader.state_dict() now, then exit (the resumed run continues exactly)"
    )


__all__ = [
    "DEFAULT_SIGNALS",
    "Preemption",
    "handle",
    "installed_signals",
    "requested",
]
