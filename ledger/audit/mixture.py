"""What share each source of a mixture really got: realised against target, per schedule
piece and over steps (:class:`ledger.Mixture`).

The target share of source ``s`` in a schedule piece is ``n_s / block`` (run.json's
``mixture.targets``: the weights as the mixture realises them). Over the ``n`` samples of
the lineage in a piece, the realised count of ``s`` is compared with ``n * t``; the
tolerance is ``Z`` binomial standard deviations, ``sqrt(sum over pieces of n t (1 -
t))``, plus one sample of rounding. A mixture places its sources by stratified blocks,
so its counts vary less than binomial ones: a failure means the log does not hold the
mixture its configuration describes (a changed weight, a lost or repeated batch).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import duckdb

from ledger.commits import read_attempt
from ledger.store import Store

_SAMPLES = "(kind = 'sample' OR (kind = 'span' AND token_start = 0))"
"""The events that consume one position of a mixture: a sample, or the first span of a
packed sample (a mixture of packed streams)."""

Z = 4.0
"""Binomial standard deviations a realised count may stray from its target."""


@dataclass(frozen=True, slots=True)
class SourceShare:
    """One source's realised and target share over the lineage (all pieces together).

    Attributes:
        source: the source's name.
        count: its samples in the lineage.
        expected: the count its target shares give (samples, fractional).
        tolerance: ``Z`` binomial standard deviations plus one (samples).
        share: realised share of the lineage's samples.
        target: the target share averaged over the lineage's samples.
    """

    source: str
    count: int
    expected: float
    tolerance: float
    share: float
    target: float

    @property
    def ok(self) -> bool:
        """The realised count is within the tolerance of the expected one."""
        return abs(self.count - self.expected) <= self.tolerance


@dataclass(frozen=True, slots=True)
class Piece:
    """A stretch of global positions with one target: a piece of a phase's schedule.

    Attributes:
        start: first global position.
        phase: the phase's number (0: the run's first).
        targets: target share by source.
    """

    start: int
    phase: int
    targets: dict[str, float]


def pieces(store: Store, con: duckdb.DuckDBPyConnection, config: dict[str, Any]) -> list[Piece]:
    """The pieces of the phases of the lineage of ``con``, by start.

    Phase 0's schedule is ``run.json``'s; each later phase's is in the record of the
    attempts serving it (its boundaries count from the phase's start). A piece of a
    phase that a later phase began before is left out.
    """
    phases = {0: (0, config["mixture"])}
    attempts = [
        int(a)
        for (a,) in con.execute("SELECT DISTINCT attempt FROM commits WHERE in_lineage").fetchall()
    ]
    for a in attempts:
        try:
            phase = read_attempt(store, f"{a:04d}.json")["phase"]
        except FileNotFoundError:
            continue
        if phase is not None and "mixture" in phase["config"]:
            phases[int(phase["number"])] = (int(phase["start"]), phase["config"]["mixture"])
    ordered = sorted(phases.items(), key=lambda kv: kv[1][0])
    out: list[Piece] = []
    for i, (number, (start, mixture)) in enumerate(ordered):
        end = ordered[i + 1][1][0] if i + 1 < len(ordered) else None
        for (rel, _), targets in zip(mixture["schedule"], mixture["targets"], strict=True):
            if end is None or start + int(rel) < end:
                out.append(Piece(start + int(rel), number, dict(targets)))
    return out


def _names(config: dict[str, Any], more: list[str]) -> list[str]:
    """The sources of ``run.json``'s mixture in its order, then those that later phases
    added (``more``), in order of appearance."""
    names = [s["name"] for s in config["mixture"]["sources"]]
    return list(dict.fromkeys(names + more))


def _counts(
    con: duckdb.DuckDBPyConnection, size: int, cuts: list[Piece]
) -> list[tuple[int, str, int]]:
    """``(piece index, source, samples)`` of the lineage."""
    whens = " ".join(f"WHEN p >= {c.start} THEN {i}" for i, c in reversed(list(enumerate(cuts))))
    return con.execute(
        f"""
        SELECT CASE {whens} END AS piece, source, count(*) AS n FROM (
            SELECT CAST(source AS VARCHAR) AS source,
                   CAST(epoch AS BIGINT) * {size} + position AS p
            FROM lineage WHERE {_SAMPLES}
        ) GROUP BY ALL ORDER BY 1, 2
        """
    ).fetchall()


def _serving(cuts: list[Piece], piece: int, source: str) -> int:
    """The piece whose targets count a sample of ``source`` at a position of ``piece``:
    that piece, or for a source its phase does not have, the first piece of the next
    phase that has it (a stream mixture's position below a new phase's start that the
    phase took from a removed source and served by its own: :mod:`ledger.stream.mixing`)."""
    at = piece
    while source not in cuts[at].targets:
        later = [i for i in range(at + 1, len(cuts)) if cuts[i].phase != cuts[at].phase]
        if not later:
            return piece
        at = later[0]
    return at


def _shares(
    names: list[str], cuts: list[Piece], per_piece: dict[int, dict[str, int]]
) -> list[SourceShare]:
    total = sum(sum(c.values()) for c in per_piece.values())
    out = []
    for name in names:
        count = sum(c.get(name, 0) for c in per_piece.values())
        expected = var = 0.0
        for piece, c in per_piece.items():
            n = sum(c.values())
            t = float(cuts[piece].targets.get(name, 0.0))
            expected += n * t
            var += n * t * (1 - t)
        out.append(
            SourceShare(
                name,
                count,
                expected,
                Z * math.sqrt(var) + 1,
                count / total if total else 0.0,
                expected / total if total else 0.0,
            )
        )
    return out


def source_shares(
    store: Store, con: duckdb.DuckDBPyConnection, config: dict[str, Any]
) -> tuple[list[SourceShare], dict[int, list[SourceShare]]]:
    """Realised against target share of each source over the lineage of ``con``, in all
    and per phase.

    Args:
        store: the log root (its attempt records hold the phases).
        con: a connection from :func:`ledger.audit.connect` (its ``lineage`` view).
        config: the run's configuration (``run.json``'s ``config``), with ``mixture``.

    Returns:
        One :class:`SourceShare` per source in the mixture's order; and the same per
        phase number (the phases of the lineage that served samples).
    """
    mixture = config["mixture"]
    cuts = pieces(store, con, config)
    names = _names(config, [n for c in cuts for n in c.targets])
    per_piece: dict[int, dict[str, int]] = {}
    for piece, source, n in _counts(con, int(mixture["epoch_size"]), cuts):
        at = _serving(cuts, int(piece), str(source))
        c = per_piece.setdefault(at, {})
        c[str(source)] = c.get(str(source), 0) + int(n)
    by_phase: dict[int, dict[int, dict[str, int]]] = {}
    for piece, c in per_piece.items():
        by_phase.setdefault(cuts[piece].phase, {})[piece] = c
    return _shares(names, cuts, per_piece), {
        ph: _shares(names, cuts, pp) for ph, pp in sorted(by_phase.items())
    }


def shares_over_steps(
    con: duckdb.DuckDBPyConnection, config: dict[str, Any], buckets: int = 10
) -> list[tuple[int, int, dict[str, float]]]:
    """Realised shares per stretch of steps (rank batches): ``(first step, last step,
    {source: share})``, ``buckets`` stretches of equal length over the lineage."""
    rows = con.execute(f"SELECT max(batch) FROM lineage WHERE {_SAMPLES}").fetchone()
    last = int(rows[0]) if rows and rows[0] is not None else -1
    if last < 0:
        return []
    width = max(1, math.ceil((last + 1) / buckets))
    counts = con.execute(
        f"""
        SELECT batch // {width} AS b, CAST(source AS VARCHAR), count(*)
        FROM lineage WHERE {_SAMPLES} GROUP BY ALL ORDER BY 1
        """
    ).fetchall()
    by: dict[int, dict[str, int]] = {}
    for b, source, n in counts:
        by.setdefault(int(b), {})[str(source)] = int(n)
    names = _names(config, [str(source) for _, source, _ in counts])
    out = []
    for b in sorted(by):
        total = sum(by[b].values())
        first = b * width
        out.append(
            (first, min(first + width, last + 1) - 1, {n: by[b].get(n, 0) / total for n in names})
        )
    return out


@dataclass(frozen=True, slots=True)
class MixtureSummary:
    """A mixture's shares over the lineage and over steps (``ledger audit``, the report).

    Attributes:
        sources: realised against target, per source.
        steps: ``(first step, last step, {source: share})`` per stretch of steps.
    """

    sources: list[SourceShare]
    steps: list[tuple[int, int, dict[str, float]]]
    phases: dict[int, list[SourceShare]]


def summarize_mixture(
    store: Store, con: duckdb.DuckDBPyConnection, config: dict[str, Any], buckets: int = 10
) -> MixtureSummary | None:
    """The mixture's shares, or ``None`` when the run is not a mixture."""
    if "mixture" not in config:
        return None
    overall, phases = source_shares(store, con, config)
    return MixtureSummary(overall, shares_over_steps(con, config, buckets), phases)


def check_mixture(
    store: Store, con: duckdb.DuckDBPyConnection, config: dict[str, Any]
) -> tuple[bool, str]:
    """The ``mixture`` check, per phase: ``(ok, one line of detail)``."""
    if "mixture" not in config:
        return True, "not a mixture: no shares to check"
    overall, phases = source_shares(store, con, config)
    bad = [s for shares in phases.values() for s in shares if not s.ok]
    shares = overall if len(phases) <= 1 else [s for p in phases.values() for s in p]
    parts = ", ".join(
        f"{s.source} {s.count} ({s.share:.2%}, target {s.target:.2%}, "
        f"expected {s.expected:.0f} ± {s.tolerance:.0f})"
        for s in (bad or shares)
    )
    where = f" in each of {len(phases)} phases" if len(phases) > 1 else ""
    if bad:
        return False, f"shares off target by more than {Z:g} binomial sd{where}: {parts}"
    return True, f"shares within {Z:g} binomial sd of target{where}: {parts}"
