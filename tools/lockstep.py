"""Throughput of several loaders measured in lockstep: all alive at once, taking turns.

This 2-core machine's speed moves by up to ~2x within minutes (other tenants, clock
changes). Timing each loader's epoch on its own, even interleaved and best of R, compares
loaders run at different moments, so a few percent cannot be resolved. Here every loader
is constructed and iterated at once, in turns of ``turn_s`` seconds (a loader yields
batches until its turn is over, then the next one takes over, the order rotating each
round), so each loader's batches are timed under the same conditions as the others', a
fraction of a second apart. A loader's time is the sum of its turns: construction and
``iter()`` (the workers' start-up), the batches, and at its end one ``state_dict()``.

Work that outlives a turn is charged to the loader that left it: after each turn the
main thread waits until no other thread of the process uses the CPU (polled in windows of
2 ms; a window with less than 10% of its length in process CPU time is quiet), and that
wait, but for its final quiet window, counts as the loader's time (ledger encodes row
groups of its segment on a background thread). Workers are other processes: while a
loader waits for its turn its workers fill their prefetch queue (``prefetch_factor x
num_workers`` batches, 4 for torch's defaults at 2 workers), which every loader does alike;
what that moves between loaders is the difference of their costs for those batches, so
the callers take turns of 0.5 s with workers (~100-600 batches here: under 4% of a turn
prefetched) and 0.1 s without.

Turns remove the drift between loaders, not the noise within a turn: on this machine one
epoch's ratio still moves by ~10% from epoch to epoch (a map-style epoch at 0 workers is
~0.6 s, six turns), so the callers sum several epochs.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

WINDOW_S = 0.002
QUIET = 0.1
SETTLE_LIMIT_S = 1.0


@dataclass
class Timed:
    """One loader's totals over its turns."""

    batches: int = 0
    seconds: float = 0.0
    turns: int = 0

    @property
    def rate(self) -> float:
        """Batches per second."""
        return self.batches / self.seconds if self.seconds else 0.0


def add_epoch(
    totals: dict[str, Timed],
    makes: Mapping[str, Callable[[], Iterable[Any]]],
    num_workers: int,
    say: Callable[[str, Timed], None],
) -> None:
    """One :func:`lockstep` epoch of ``makes`` (turns of :func:`turn` seconds) added to
    ``totals``; ``say(name, timed)`` is called with each loader's epoch."""
    for name, timed in lockstep(makes, turn(num_workers)).items():
        total = totals[name]
        total.batches += timed.batches
        total.seconds += timed.seconds
        total.turns += timed.turns
        say(name, timed)


TURN_S: float | None = None
"""The turn's length in seconds for every worker count (``tools/bench.py --turn``);
``None``: :func:`turn`'s defaults."""


def turn(num_workers: int) -> float:
    """The turn's length in seconds for loaders with ``num_workers`` workers:
    :data:`TURN_S` if set, else 0.1 without workers and 0.5 with."""
    if TURN_S is not None:
        return TURN_S
    return 0.1 if num_workers == 0 else 0.5


def turns_said() -> str:
    """The turns' length in words, for a table's title."""
    if TURN_S is not None:
        return f"turns of {TURN_S:g} s"
    return f"turns of {turn(0):g} s, {turn(1):g} s with workers"


def settle() -> float:
    """Wait until no other thread of this process uses the CPU; the seconds waited but for
    the final quiet window (at most :data:`SETTLE_LIMIT_S`)."""
    t0 = time.perf_counter()
    while True:
        w0 = time.perf_counter()
        c0 = time.process_time()
        time.sleep(WINDOW_S)
        busy = time.process_time() - c0
        now = time.perf_counter()
        if busy < QUIET * (now - w0) or now - t0 > SETTLE_LIMIT_S:
            return w0 - t0


def lockstep(
    makes: Mapping[str, Callable[[], Iterable[Any]]],
    turn_s: float = 0.1,
    on_turn: Callable[[str, int, float], None] | None = None,
) -> dict[str, Timed]:
    """One epoch of every loader in ``makes``, run in turns of ``turn_s`` seconds.

    Args:
        makes: name -> a function that constructs the loader (timed).
        turn_s: wall-clock seconds of one turn.
        on_turn: called after each turn with the name, its batches and its seconds.

    Returns:
        name -> its batches and seconds (construction, ``iter()``, the batches, one
        ``state_dict()`` where the loader has one, and the waits for its background
        threads, :func:`settle`).
    """
    out = {name: Timed() for name in makes}
    loaders: dict[str, Any] = {}
    iters: dict[str, Iterator[Any]] = {}
    for name, make in makes.items():
        t0 = time.perf_counter()
        loaders[name] = make()
        iters[name] = iter(loaders[name])
        out[name].seconds += time.perf_counter() - t0 + settle()
    order = list(makes)
    rnd = 0
    while iters:
        names = [n for n in order if n in iters]
        k = rnd % len(names)
        for name in names[k:] + names[:k]:
            it = iters[name]
            n = 0
            t0 = time.perf_counter()
            end = t0 + turn_s
            try:
                while True:
                    next(it)
                    n += 1
                    if n % 8 == 0 and time.perf_counter() >= end:
                        break
            except StopIteration:
                del iters[name]
                if hasattr(loaders[name], "state_dict"):
                    loaders[name].state_dict()
            secs = time.perf_counter() - t0 + settle()
            timed = out[name]
            timed.batches += n
            timed.seconds += secs
            timed.turns += 1
            if on_turn is not None:
                on_turn(name, n, secs)
            if name not in iters:
                del it
                loaders.pop(name)  # its workers shut down outside any loader's turn
        rnd += 1
    return out
