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


def _pieces(mixture: dict[str, Any]) -> str:
    """SQL ``CASE`` giving the schedule piece of a global position ``p``."""
    starts = [int(s) for s, _ in mixture["schedule"]]
    whens = " ".join(f"WHEN p >= {s} THEN {i}" for i, s in reversed(list(enumerate(starts))))
    return f"CASE {whens} END"


def _counts(con: duckdb.DuckDBPyConnection, mixture: dict[str, Any]) -> list[tuple[int, str, int]]:
    size = int(mixture["epoch_size"])
    return con.execute(
        f"""
        SELECT {_pieces(mixture)} AS piece, source, count(*) AS n FROM (
            SELECT CAST(source AS VARCHAR) AS source,
                   CAST(epoch AS BIGINT) * {size} + position AS p
            FROM lineage WHERE kind = 'sample'
        ) GROUP BY ALL ORDER BY 1, 2
        """
    ).fetchall()


def source_shares(con: duckdb.DuckDBPyConnection, config: dict[str, Any]) -> list[SourceShare]:
    """Realised against target share of each source over the lineage of ``con``.

    Args:
        con: a connection from :func:`ledger.audit.connect` (its ``lineage`` view).
        config: the run's configuration (``run.json``'s ``config``), with ``mixture``.

    Returns:
        One :class:`SourceShare` per source, in the mixture's order.
    """
    mixture = config["mixture"]
    names = [s["name"] for s in mixture["sources"]]
    targets = mixture["targets"]
    per_piece: dict[int, dict[str, int]] = {}
    for piece, source, n in _counts(con, mixture):
        per_piece.setdefault(int(piece), {})[str(source)] = int(n)
    total = sum(sum(c.values()) for c in per_piece.values())
    out = []
    for name in names:
        count = sum(c.get(name, 0) for c in per_piece.values())
        expected = var = 0.0
        for piece, c in per_piece.items():
            n = sum(c.values())
            t = float(targets[piece].get(name, 0.0))
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


def shares_over_steps(
    con: duckdb.DuckDBPyConnection, config: dict[str, Any], buckets: int = 10
) -> list[tuple[int, int, dict[str, float]]]:
    """Realised shares per stretch of steps (rank batches): ``(first step, last step,
    {source: share})``, ``buckets`` stretches of equal length over the lineage."""
    rows = con.execute("SELECT max(batch) FROM lineage WHERE kind = 'sample'").fetchone()
    last = int(rows[0]) if rows and rows[0] is not None else -1
    if last < 0:
        return []
    width = max(1, math.ceil((last + 1) / buckets))
    names = [s["name"] for s in config["mixture"]["sources"]]
    counts = con.execute(
        f"""
        SELECT batch // {width} AS b, CAST(source AS VARCHAR), count(*)
        FROM lineage WHERE kind = 'sample' GROUP BY ALL ORDER BY 1
        """
    ).fetchall()
    by: dict[int, dict[str, int]] = {}
    for b, source, n in counts:
        by.setdefault(int(b), {})[str(source)] = int(n)
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


def summarize_mixture(
    con: duckdb.DuckDBPyConnection, config: dict[str, Any], buckets: int = 10
) -> MixtureSummary | None:
    """The mixture's shares, or ``None`` when the run is not a mixture."""
    if "mixture" not in config:
        return None
    return MixtureSummary(source_shares(con, config), shares_over_steps(con, config, buckets))


def check_mixture(con: duckdb.DuckDBPyConnection, config: dict[str, Any]) -> tuple[bool, str]:
    """The ``mixture`` check: ``(ok, one line of detail)``."""
    if "mixture" not in config:
        return True, "not a mixture: no shares to check"
    shares = source_shares(con, config)
    bad = [s for s in shares if not s.ok]
    parts = ", ".join(
        f"{s.source} {s.count} ({s.share:.2%}, target {s.target:.2%}, "
        f"expected {s.expected:.0f} ± {s.tolerance:.0f})"
        for s in (bad or shares)
    )
    if bad:
        return False, f"shares off target by more than {Z:g} binomial sd: {parts}"
    return True, f"shares within {Z:g} binomial sd of target: {parts}"
