"""The ``ledger`` command: a thin click layer over :mod:`ledger.audit`.

Each command parses its options, calls one library function, and formats the result.
A user error (a :class:`ledger.errors.LedgerError`, an error in the user's SQL) prints one
``Error: ...`` line to stderr and exits 1, without a traceback.
"""

from __future__ import annotations

import csv
import dataclasses
import datetime
import decimal
import json
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import click
import duckdb
from rich.console import Console
from rich.table import Table

from ledger.audit import VIEWS, Summary, connect, summarize
from ledger.errors import LedgerError

F = TypeVar("F", bound=Callable[..., Any])

FORMATS = ("table", "csv", "json", "ndjson")
_FETCH_ROWS = 10_000  # rows per fetch when streaming a query result


class _Group(click.Group):
    """A group that turns user errors from any command into one clean line and exit 1."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except LedgerError as e:
            raise click.ClickException(_one_line(str(e))) from e
        except duckdb.Error as e:
            raise click.ClickException(_one_line(str(e))) from e


def _one_line(message: str) -> str:
    """First non-empty line of ``message`` (DuckDB appends a caret diagram on more lines)."""
    return next((line.strip() for line in message.splitlines() if line.strip()), message)


def output_options(f: F) -> F:
    """Add the shared output options (``--format``) to a command."""
    return click.option(
        "--format",
        "fmt",
        type=click.Choice(FORMATS),
        default="table",
        show_default=True,
        help="Output format: a table for reading, csv, json (one array) or ndjson "
        "(one object per line) for other programs.",
    )(f)


@click.group(cls=_Group)
def main() -> None:
    """Audit and inspect a ledger log: what a model saw, and when.

    Example:

    \b
        ledger audit /runs/exp7
        ledger audit /runs/exp7 --sql "SELECT * FROM commits" --format csv
    """


@main.command()
@click.argument("root")
@click.option(
    "--sql",
    metavar="QUERY",
    help=f"Run QUERY over the views ({', '.join(VIEWS)}) instead of printing the "
    "summary; '-' reads it from stdin.",
)
@click.option(
    "--head",
    metavar="COMMIT",
    help="Commit whose lineage the summary and the lineage view hold "
    "[default: the newest commit of the newest attempt].",
)
@output_options
def audit(root: str, sql: str | None, head: str | None, fmt: str) -> None:
    """Summarise the log at ROOT, or run SQL over its views.

    The summary gives attempts, per-epoch samples, coverage, duplicates and skips
    of the head's lineage, and the work of abandoned branches. The views are
    read-only: a query cannot read or write other files.

    Example:

    \b
        ledger audit /runs/exp7
        ledger audit /runs/exp7 --head 000000000040-0000
        ledger audit /runs/exp7 --format csv \\
            --sql "SELECT epoch, count(*) AS samples FROM lineage GROUP BY 1"
        echo "SELECT * FROM commits" | ledger audit /runs/exp7 --sql - --format json
    """
    if sql is None:
        _print_summary(summarize(root, head), fmt)
        return
    if sql == "-":
        sql = sys.stdin.read()
    con = connect(root, head)
    try:
        cursor = con.execute(sql)
        if cursor.description is not None:  # a statement without a result prints nothing
            columns = [d[0] for d in cursor.description]
            _print_rows(columns, _fetch(cursor), fmt)
    finally:
        con.close()


def _fetch(cursor: duckdb.DuckDBPyConnection) -> Iterator[tuple[Any, ...]]:
    while rows := cursor.fetchmany(_FETCH_ROWS):
        yield from rows


# ---------------------------------------------------------------- formatting


def _jsonable(value: Any) -> Any:
    if isinstance(value, (datetime.datetime, datetime.date, datetime.time)):
        return value.isoformat()
    if isinstance(value, decimal.Decimal):
        return int(value) if value == value.to_integral_value() else float(value)
    if isinstance(value, bytes):
        return value.hex()
    return str(value)


def _console(out: Any) -> Console:
    # No markup, emoji or highlighting: values from the log are printed as they are.
    return Console(file=out, markup=False, emoji=False, highlight=False)


def _print_rows(columns: Sequence[str], rows: Iterator[tuple[Any, ...]], fmt: str) -> None:
    """Write ``rows`` to stdout in ``fmt``; csv and ndjson stream, table and json collect."""
    out = sys.stdout
    if fmt == "csv":
        writer = csv.writer(out, lineterminator="\n")
        writer.writerow(columns)
        writer.writerows(rows)
    elif fmt == "ndjson":
        for row in rows:
            out.write(json.dumps(dict(zip(columns, row, strict=True)), default=_jsonable) + "\n")
    elif fmt == "json":
        objects = [dict(zip(columns, row, strict=True)) for row in rows]
        out.write(json.dumps(objects, indent=2, default=_jsonable) + "\n")
    else:
        table = Table(*columns)
        for row in rows:
            table.add_row(*("NULL" if v is None else str(v) for v in row))
        _console(out).print(table)


def _print_summary(s: Summary, fmt: str) -> None:
    if fmt in ("json", "ndjson"):
        indent = 2 if fmt == "json" else None
        click.echo(json.dumps(dataclasses.asdict(s), indent=indent))
        return
    if fmt == "csv":
        raise click.ClickException(
            "the summary is several tables and has no csv form: use --format json, "
            "or --sql with --format csv"
        )
    console = _console(sys.stdout)
    last = s.last_position
    console.print(f"run {s.run_id}, dataset of {s.dataset_len} samples", soft_wrap=True)
    console.print(
        f"{len(s.attempts)} attempts, {s.commits} commits, head {s.head or '-'}", soft_wrap=True
    )
    attempts = Table(title="Attempts")
    attempts.add_column("attempt")
    attempts.add_column("parent", min_width=17, no_wrap=True)  # commit ids are copied whole
    for name in ("ranks", "commits", "events", "uncommitted batches"):
        attempts.add_column(name)
    for a in s.attempts:
        attempts.add_row(
            str(a.attempt), a.parent or "-", str(a.world_size), str(a.commits), str(a.events),
            str(a.uncommitted_batches),
        )  # fmt: skip
    console.print(attempts)
    epochs = Table(
        "epoch", "samples", "distinct", "coverage", "duplicates", "skipped",
        title=f"Lineage of {s.head or '-'}",
    )  # fmt: skip
    for e in s.epochs:
        epochs.add_row(
            str(e.epoch), str(e.samples), str(e.distinct), f"{e.coverage:.2%}",
            str(e.duplicates), str(e.skipped),
        )  # fmt: skip
    console.print(epochs)
    position = f"epoch {last.epoch}, position {last.position}" if last else "-"
    # Streams read out of order (several workers, a shuffle buffer): the furthest position
    # is how far the epoch reaches, not a count of what was consumed (see coverage).
    console.print(f"furthest committed position: {position}", soft_wrap=True)
    console.print(
        f"commits not in the lineage: {s.abandoned_commits}, with {s.abandoned_samples} "
        "samples seen by discarded models",
        soft_wrap=True,
    )
    if len(s.ranks) > 1 or s.skew is not None:
        ranks = Table(
            "rank", "epoch", "epoch batch", "batches", "samples", "behind",
            title=f"Ranks at {s.head or '-'}",
        )  # fmt: skip
        for r in s.ranks:
            ranks.add_row(
                str(r.rank), str(r.epoch), str(r.epoch_batch), str(r.batch), str(r.samples),
                str(r.behind),
            )  # fmt: skip
        console.print(ranks)
        stragglers = [str(r.rank) for r in s.ranks if r.behind]
        console.print(f"stragglers: {', '.join(stragglers) or 'none'}", soft_wrap=True)
    if s.skew is not None:
        console.print(
            f"largest skew: {s.skew.samples} samples and {s.skew.epochs} epochs between the "
            f"{s.skew.world_size} ranks of commit {s.skew.commit}",
            soft_wrap=True,
        )


if __name__ == "__main__":
    sys.exit(main())
