"""Audit a log: DuckDB views over its events and commits, and a summary.

Example:
    >>> from ledger.audit import connect, summarize
    >>> con = connect("/runs/exp7")
    >>> con.sql("SELECT epoch, count(*) FROM lineage GROUP BY 1").fetchall()
    >>> summarize("/runs/exp7").epochs[0].coverage
"""

from ledger.audit.report import write_report
from ledger.audit.summary import AttemptSummary, EpochSummary, Position, Summary, summarize
from ledger.audit.views import VIEWS, connect

__all__ = [
    "VIEWS",
    "AttemptSummary",
    "EpochSummary",
    "Position",
    "Summary",
    "connect",
    "summarize",
    "write_report",
]
