"""tools/lockstep.py: the benchmark's accounting of loaders run in turns (no timing asserted)."""

from __future__ import annotations

import os
import sys
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tools"))

import lockstep


class Loader:
    """``n`` batches; records each next() and state_dict() in a shared log."""

    def __init__(self, name: str, n: int, log: list[tuple[str, Any]]) -> None:
        self.name, self.n, self.log = name, n, log

    def __iter__(self) -> Any:
        for i in range(self.n):
            self.log.append((self.name, i))
            yield i

    def state_dict(self) -> dict[str, int]:
        self.log.append((self.name, "state_dict"))
        return {}


def test_every_batch_of_every_loader_is_counted_once_in_turns_that_rotate():
    log: list[tuple[str, Any]] = []
    turns: list[tuple[str, int]] = []
    sizes = {"a": 50, "b": 20, "c": 0}
    out = lockstep.lockstep(
        {name: (lambda name=name, n=n: Loader(name, n, log)) for name, n in sizes.items()},
        turn_s=0.0,  # the turn ends at the first check: 8 batches a turn
        on_turn=lambda name, n, secs: turns.append((name, n)),
    )
    assert {name: t.batches for name, t in out.items()} == sizes
    for name, n in sizes.items():
        assert [i for who, i in log if who == name] == [*range(n), "state_dict"]
        assert out[name].turns == len([t for t in turns if t[0] == name])
        assert out[name].seconds > 0
    assert turns[:3] == [("a", 8), ("b", 8), ("c", 0)]  # round 0: the given order
    assert turns[3:5] == [("b", 8), ("a", 8)]  # round 1: rotated by one, c is done
    assert turns[-1] == ("a", 50 - 8 * 6)
    assert sum(n for _, n in turns) == 70


def test_a_loader_without_state_dict_is_iterated_to_its_end():
    out = lockstep.lockstep({"plain": lambda: range(17)}, turn_s=0.0)
    assert (out["plain"].batches, out["plain"].turns) == (17, 3)
    assert out["plain"].rate > 0
