"""Audit a log: DuckDB views over its events and commits, and a summary.

The names are imported on first use (PEP 562), so the ``ledger`` command starts without
importing DuckDB, pyarrow's datasets or pandas (``ledger --help`` stays fast).

Example:
    >>> from ledger.audit import connect, summarize
    >>> con = connect("/runs/exp7")
    >>> con.sql("SELECT epoch, count(*) FROM lineage GROUP BY 1").fetchall()
    >>> summarize("/runs/exp7").epochs[0].coverage
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ledger.audit.names import VIEWS

if TYPE_CHECKING:
    from ledger.audit.report import write_report
    from ledger.audit.summary import AttemptSummary, EpochSummary, Position, Summary, summarize
    from ledger.audit.views import connect

_LAZY = {
    "write_report": "ledger.audit.report",
    "AttemptSummary": "ledger.audit.summary",
    "EpochSummary": "ledger.audit.summary",
    "Position": "ledger.audit.summary",
    "Summary": "ledger.audit.summary",
    "summarize": "ledger.audit.summary",
    "connect": "ledger.audit.views",
}

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


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'ledger.audit' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
