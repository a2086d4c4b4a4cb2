"""The ``ledger`` command: a thin click layer over :mod:`ledger.audit`.

Each command parses its options, calls one library function, and formats the result.
A user error (a :class:`ledger.errors.LedgerError`, an error in the user's SQL) prints one
``Error: ...`` line to stderr and exits 1, without a traceback.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import csv
import dataclasses
import datetime
import decimal
import gc
import importlib
import importlib.util
import inspect
import json
import math
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import click

from ledger import __version__
from ledger.audit.names import ALL_CHECKS, CHECKS, MIXTURE_CHECKS, VIEWS
from ledger.errors import LedgerError

if TYPE_CHECKING:  # imported where used: `ledger --help` must not import DuckDB or pandas
    import duckdb
    from rich.console import Console

    from ledger.audit import Summary
    from ledger.audit.checks import CheckResult
    from ledger.audit.mixture import MixtureSummary

F = TypeVar("F", bound=Callable[..., Any])

FORMATS = ("table", "csv", "json", "ndjson")
_FETCH_ROWS = 10_000  # rows per fetch when streaming a query result
CHECK_FAILED = 3
"""Exit status when a check fails (``audit --check``, ``verify``, ``show --materialize``);
1 is a user error, 2 a usage error."""


class _Group(click.Group):
    """The one place errors become output: every command's error is one ``Error:`` line on
    stderr and exit status 1, never a traceback.

    A :class:`ledger.errors.LedgerError` (a damaged log names its file and field; a bad
    argument says what to pass) and an error in the user's SQL print their message. Any
    other exception is a bug in ledger: it prints one line saying so, and the traceback
    only when ``LEDGER_DEBUG=1``.
    """

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (click.ClickException, click.exceptions.Exit, click.Abort):
            raise
        except LedgerError as e:
            raise click.ClickException(_one_line(str(e))) from e
        except OSError as e:  # the output path: a missing folder, no permission, disk full
            raise click.ClickException(_one_line(str(e))) from e
        except Exception as e:
            duckdb = sys.modules.get("duckdb")  # loaded by any command that ran SQL
            if duckdb is not None and isinstance(e, duckdb.Error):
                raise click.ClickException(_one_line(str(e))) from e
            spark_errors = sys.modules.get("pyspark.errors")  # --engine spark: the user's SQL
            if spark_errors is not None and isinstance(e, spark_errors.AnalysisException):
                raise click.ClickException(_one_line(str(e))) from e
            if os.environ.get("LEDGER_DEBUG") == "1":
                raise
            raise click.ClickException(
                f"unexpected {type(e).__name__}: {_one_line(str(e))} (a bug in ledger: please "
                "report it; LEDGER_DEBUG=1 shows the traceback)"
            ) from e


class _Count(click.IntRange):
    """An integer >= 0 that fits int64 (batches, ranks, sample counts are int64 in the log
    and its views: a larger one is a usage error, not an overflow inside Arrow)."""

    def __init__(self) -> None:
        super().__init__(min=0, max=(1 << 63) - 1)

    def _describe_range(self) -> str:
        return "0<=x<2**63"


_COUNT = _Count()


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
@click.version_option(__version__, prog_name="ledger")
def main() -> None:
    """Audit and inspect a ledger log: what a model saw, and when.

    Exit status: 0 on success, 1 on an error (one line on stderr), 2 on a usage error,
    3 when a check fails (audit --check, verify, show --materialize).

    A damaged log: audit --check and verify report it as a failed check (exit 3);
    audit, where, show, reconstruct and report print one Error: line naming the file
    (exit 1). No command prints a traceback.

    Example:

    \b
        ledger audit /runs/exp7
        ledger audit /runs/exp7 --check coverage --check duplicates
        ledger where /runs/exp7 --sample 1234
        ledger reconstruct /runs/exp7 --commit 40 --out seen.parquet
    """


@contextlib.contextmanager
def _progress(what: str) -> Iterator[Callable[[int, int], None] | None]:
    """A progress bar on stderr for a long scan, or ``None`` when stderr is not a terminal."""
    if not sys.stderr.isatty():
        yield None
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    columns = (
        TextColumn(what),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(what, total=None)

        def update(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        yield update


def _head_option(f: F) -> F:
    return click.option(
        "--head",
        metavar="COMMIT",
        help="Commit whose lineage is audited: its step (40), STEP-ATTEMPT (40-1) or full id "
        "[default: the newest commit of the newest attempt].",
    )(f)


def _commit(root: str, text: str | None) -> str | None:
    """The full id of the commit the user typed as ``40``, ``40-1`` or the full id."""
    if text is None:
        return None
    from ledger.commits import read_run, resolve_commit
    from ledger.store import Store

    store = Store(root)
    read_run(store)  # "ROOT holds no run; did you mean ROOT/log?" before "no commit 40"
    return resolve_commit(store, text)


@main.command()
@click.argument("root")
@click.option(
    "--sql",
    metavar="QUERY",
    help=f"Run QUERY over the views ({', '.join(VIEWS)}) instead of printing the "
    "summary; '-' reads it from stdin.",
)
@_head_option
@click.option(
    "--check",
    "checks",
    multiple=True,
    type=click.Choice((*ALL_CHECKS, "all")),
    help="Run a named check instead of printing the summary (repeatable; 'all' runs "
    "every one; 'mixture' only for a ledger.Mixture). Exit status 3 if one fails.",
)
@click.option(
    "--allow-uncommitted",
    type=_COUNT,
    default=0,
    show_default=True,
    metavar="BATCHES",
    help="For the abandoned check: accept up to BATCHES uncommitted batches per attempt "
    "(the crash tail a killed process consumed after its last checkpoint; use the "
    "checkpoint interval).",
)
@click.option(
    "--max-rows",
    type=_COUNT,
    default=40,
    show_default=True,
    help="With --sql and --format table: rows shown, half from the start and half from the "
    "end, with the row count (0: all). Other formats print every row.",
)
@click.option(
    "--max-skew",
    type=_COUNT,
    metavar="SAMPLES",
    help="Limit of the skew check, in samples [default: the batch size].",
)
@click.option(
    "--engine",
    type=click.Choice(("duckdb", "spark")),
    default="duckdb",
    show_default=True,
    help="Where the audit runs: DuckDB in this process, or Apache Spark (pip install "
    "'ledger[spark]'; the same views, summary and checks, read through the manifest).",
)
@click.option(
    "--master",
    metavar="URL",
    help="With --engine spark: the Spark master (local[4], yarn, spark://host:7077) "
    "[default: what spark-submit configured, else local[*]].",
)
@output_options
def audit(
    root: str,
    sql: str | None,
    head: str | None,
    checks: tuple[str, ...],
    allow_uncommitted: int,
    max_rows: int,
    max_skew: int | None,
    engine: str,
    master: str | None,
    fmt: str,
) -> None:
    """Summarise the log at ROOT, run checks on it, or run SQL over its views.

    The summary gives attempts, per-epoch samples, coverage, duplicates and skips
    of the head's lineage, and the work of abandoned branches. The checks:
    coverage (finished epochs hold every sample), duplicates (none in an epoch),
    skips (only drop_last's tail), abandoned (no sample seen off the lineage: abandoned
    branches, uncommitted batches, orphan segments), progress (no rank goes back),
    skew (ranks within --max-skew samples), mixture (each source of a ledger.Mixture got
    its target share, within 4 binomial standard deviations). The views are read-only:
    a query cannot read or write other files.

    Example:

    \b
        ledger audit /runs/exp7
        ledger audit /runs/exp7 --head 40
        ledger audit /runs/exp7 --check coverage --check duplicates || exit 1
        ledger audit /runs/exp7 --check all --allow-uncommitted 100
        ledger audit /runs/exp7 --format csv \\
            --sql "SELECT epoch, count(*) AS samples FROM lineage GROUP BY 1"
        echo "SELECT * FROM commits" | ledger audit /runs/exp7 --sql - --format json
        ledger audit s3a://bucket/runs/exp7 --engine spark --master yarn --check all
    """
    from ledger.audit import connect, summarize
    from ledger.audit.checks import check

    if checks and sql is not None:
        raise click.UsageError("--check and --sql cannot be combined")
    if master is not None and engine != "spark":
        raise click.UsageError("--master needs --engine spark")
    head = _commit(root, head)
    if engine == "spark":
        _audit_spark(root, sql, head, checks, allow_uncommitted, max_rows, max_skew, master, fmt)
        return
    if checks:
        if "all" in checks:
            from ledger.commits import read_run
            from ledger.store import Store

            mixed = "mixture" in read_run(Store(root))["config"]
            names: tuple[str, ...] = (*CHECKS, *MIXTURE_CHECKS) if mixed else CHECKS
        else:
            names = tuple(dict.fromkeys(checks))
        with _progress("scanning segments") as progress:
            results = check(
                root,
                names,
                head=head,
                max_skew=max_skew,
                allow_uncommitted=allow_uncommitted,
                progress=progress,
            )
        _print_checks(results, fmt)
        if not all(r.ok for r in results):
            sys.exit(CHECK_FAILED)
        return
    if sql is None:
        with _progress("scanning segments") as progress:
            s = summarize(root, head, progress)
        _print_summary(s, fmt, _mixture_summary(root, s.head))
        return
    if sql == "-":
        sql = sys.stdin.read()
    if not sql.strip():
        raise click.BadParameter("the query is empty", param_hint="'--sql'")
    with _progress("running query"):
        con = connect(root, head)
    try:
        with _progress("running query"):
            cursor = con.execute(sql)
        if cursor.description is not None:  # a statement without a result prints nothing
            columns = [d[0] for d in cursor.description]
            _print_rows(columns, _fetch(cursor), fmt, max_rows=max_rows)
    finally:
        con.close()


def _audit_spark(
    root: str,
    sql: str | None,
    head: str | None,
    checks: tuple[str, ...],
    allow_uncommitted: int,
    max_rows: int,
    max_skew: int | None,
    master: str | None,
    fmt: str,
) -> None:
    """``ledger audit --engine spark``: the same outputs, computed on Spark."""
    from ledger.audit import spark as engine

    with _progress("starting Spark"):
        session = engine.session(master)
        session.sparkContext.setLogLevel("ERROR")
    try:  # pyspark >= 4 logs a failing query as JSON on stderr; the error line says it
        from pyspark.logger import PySparkLogger

        for name in ("SQLQueryContextLogger", "DataFrameQueryContextLogger"):
            PySparkLogger.getLogger(name).disabled = True
    except ImportError:
        pass
    if checks:
        names = CHECKS if "all" in checks else tuple(dict.fromkeys(checks))
        with _progress("running checks on Spark"):
            results = engine.check(
                session,
                root,
                names,
                head=head,
                max_skew=max_skew,
                allow_uncommitted=allow_uncommitted,
            )
        _print_checks(results, fmt)
        if not all(r.ok for r in results):
            sys.exit(CHECK_FAILED)
        return
    if sql is None:
        with _progress("summarising on Spark"):
            s = engine.summarize(session, root, head)
        _print_summary(s, fmt)
        return
    if sql == "-":
        sql = sys.stdin.read()
    if not sql.strip():
        raise click.BadParameter("the query is empty", param_hint="'--sql'")
    with _progress("running query on Spark"):
        engine.register(session, root, head)
        frame = session.sql(sql)
        rows = [tuple(r) for r in frame.toLocalIterator()]
    _print_rows(frame.columns, iter(rows), fmt, max_rows=max_rows)


def _fetch(cursor: duckdb.DuckDBPyConnection) -> Iterator[tuple[Any, ...]]:
    while rows := cursor.fetchmany(_FETCH_ROWS):
        yield from rows


@main.command("where")
@click.argument("root")
@click.option("--sample", "sample_id", required=True, type=int, metavar="ID", help="Sample id.")
@click.option(
    "--source",
    metavar="NAME",
    help="The ledger.Mixture source the id belongs to (required for a mixture's log: ids "
    "are per source).",
)
@_head_option
@output_options
def where_command(
    root: str, sample_id: int, source: str | None, head: str | None, fmt: str
) -> None:
    """Every consumption of sample ID in the log at ROOT, and the commits that saw it.

    One row per (attempt, rank, epoch, batch) that consumed the sample, committed or
    not, with whether it is in the head's lineage; then the commits whose model saw it
    (a commit whose lineage holds one of those consumptions). In a mixture's log the
    id is an index (or row) of --source.

    Example:

    \b
        ledger where /runs/exp7 --sample 1234
        ledger where /runs/exp7 --sample 1234 --head 40 --format json
        ledger where /runs/mix --sample 1234 --source code
    """
    from rich.table import Table

    from ledger.audit.queries import where

    _check_sample(root, sample_id, source)
    head = _commit(root, head)
    with _progress(f"finding sample {sample_id}"):
        h = where(root, sample_id, head, source)
    rows = [dataclasses.astuple(c) for c in h.consumptions]
    columns = [f.name for f in dataclasses.fields(type(h.consumptions[0]))] if rows else []
    if fmt in ("json", "ndjson"):
        indent = 2 if fmt == "json" else None
        click.echo(_dumps(dataclasses.asdict(h), indent=indent))
        return
    if fmt == "csv":
        _print_rows(columns or ["attempt"], iter(rows), fmt)
        return
    console = _console(sys.stdout)
    seen = sum(c.in_lineage for c in h.consumptions)
    name = f"sample {h.sample_id}" + ("" if source is None else f" of source {source!r}")
    console.print(
        f"{name}: {len(rows)} consumptions, {seen} in the lineage of {h.head or '-'}",
        soft_wrap=True,
    )
    if rows:
        spans = any(c.token_start is not None for c in h.consumptions)
        # A packed sample shows its token span; 'kind' is implied ('sample' or 'span').
        table = Table("attempt", "rank", "epoch", "batch", "position")
        if spans:
            table.add_column("tokens")
        table.add_column("commit", min_width=17, no_wrap=True)  # ids are copied whole
        table.add_column("lineage")
        for c in h.consumptions:
            cells = [str(c.attempt), str(c.rank), str(c.epoch), str(c.batch), str(c.position)]
            if spans:
                cells.append("" if c.token_start is None else f"{c.token_start}:{c.token_end}")
            cells += [c.commit_id or "uncommitted", "yes" if c.in_lineage else "no"]
            table.add_row(*cells)
        console.print(table)
    console.print(f"commits whose model saw it: {len(h.commits)}", soft_wrap=True)
    if h.commits:
        console.print(", ".join(h.commits), soft_wrap=True)


def _check_sample(root: str, sample_id: int, source: str | None) -> None:
    from ledger.audit.queries import mixture_sources
    from ledger.commits import read_run
    from ledger.errors import UnsupportedArgument
    from ledger.store import Store

    store = Store(root)
    try:
        sources = mixture_sources(store, source)
    except UnsupportedArgument as e:
        raise click.BadParameter(str(e), param_hint="'--source'") from e
    if sources is None:
        n, where = read_run(store)["config"].get("dataset_len"), "the dataset"
    else:
        n, where = sources[str(source)], f"source {source!r}"
    if sample_id < 0 or (n is not None and sample_id >= int(n)):
        raise click.BadParameter(
            f"sample {sample_id} is outside {where}: its ids are 0 to {int(n or 0) - 1}",
            param_hint="'--sample'",
        )


def _load_object(spec: str, kwargs: str | None, *, construct: bool = True) -> Any:
    """``MODULE:NAME`` or ``path/file.py:NAME``; with ``construct``, a function or class is
    called with ``kwargs`` (a JSON object): a dataset's factory. Without, the object as it
    is (a collate function)."""
    target, sep, name = spec.rpartition(":")
    if not sep or not target or not name:
        raise click.BadParameter(f"{spec!r} is not MODULE:NAME or FILE.py:NAME")
    try:
        if target.endswith(".py"):
            location = importlib.util.spec_from_file_location(os.path.basename(target)[:-3], target)
            if location is None or location.loader is None:
                raise ImportError(f"cannot import {target}")
            module = importlib.util.module_from_spec(location)
            location.loader.exec_module(module)
        else:
            sys.path.insert(0, os.getcwd())
            module = importlib.import_module(target)
        obj = module
        for part in name.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError, OSError) as e:
        raise click.BadParameter(f"cannot load {spec}: {e}") from e
    if construct and (inspect.isfunction(obj) or inspect.isclass(obj)):
        try:
            args = json.loads(kwargs) if kwargs else {}
        except json.JSONDecodeError as e:
            raise click.BadParameter(f"--dataset-kwargs is not JSON: {e}") from e
        if not isinstance(args, dict):
            raise click.BadParameter("--dataset-kwargs must be a JSON object")
        try:
            return obj(**args)
        except Exception as e:  # the user's constructor: a missing or misspelt argument
            raise click.BadParameter(
                f"{spec}(**{args!r}) raised {type(e).__name__}: {_one_line(str(e))}"
                + ("" if args else " (pass its arguments with --dataset-kwargs)")
            ) from e
    return obj


def _dataset_and_collate(
    dataset: str, dataset_kwargs: str | None, collate: str | None
) -> tuple[Any, Any]:
    """The objects ``--dataset`` and ``--collate`` name, checked for what re-creating a
    batch calls on them.

    Raises:
        click.BadParameter: naming the option, if the dataset is neither a map-style
            dataset (``__len__`` and ``__getitem__``), a :class:`ledger.Mixture` nor a
            :class:`ledger.stream.Stream`, or the collate function is not callable.
    """
    from ledger.stream import Stream

    ds = _load_object(dataset, dataset_kwargs)
    mapped = hasattr(ds, "__len__") and hasattr(ds, "__getitem__") and not inspect.ismodule(ds)
    if not (mapped or isinstance(ds, Stream)):
        raise click.BadParameter(
            f"{dataset} gave {type(ds).__name__}, not a dataset: a map-style dataset "
            "(__len__ and __getitem__), a ledger.Mixture or a ledger.stream.Stream, as the "
            "run's loader was given",
            param_hint="'--dataset'",
        )
    collate_fn = _load_object(collate, None, construct=False) if collate else None
    if collate_fn is not None and not callable(collate_fn):
        raise click.BadParameter(
            f"{collate} is {type(collate_fn).__name__}, not callable", param_hint="'--collate'"
        )
    return ds, collate_fn


@contextlib.contextmanager
def _user_code(what: str) -> Iterator[None]:
    """Report an exception of the user's dataset or collate function (re-creating
    batches runs them) as one ``Error:`` line that says whose it is, not as a bug of
    ledger's. ``LEDGER_DEBUG=1`` shows the traceback."""
    try:
        yield
    except (LedgerError, click.ClickException):
        raise
    except Exception as e:
        if os.environ.get("LEDGER_DEBUG") == "1":
            raise
        raise click.ClickException(
            f"{what}: the dataset or collate function raised {type(e).__name__}: "
            f"{_one_line(str(e))} (is it the run's? LEDGER_DEBUG=1 shows the traceback)"
        ) from e


@main.command("show")
@click.argument("root")
@click.option("--batch", required=True, type=_COUNT, help="Batch index.")
@click.option("--rank", default=0, show_default=True, type=_COUNT)
@_head_option
@click.option(
    "--materialize",
    is_flag=True,
    help="Re-create the batch through the dataset with the recorded seeds and compare "
    "its content digest with the recorded one (exit status 3 if they differ).",
)
@click.option(
    "--dataset",
    metavar="MODULE:NAME",
    help="With --materialize: the run's dataset: a dataset object, or a function or class "
    "called with --dataset-kwargs (MODULE is importable from the current directory, or a "
    "path to a .py file).",
)
@click.option("--dataset-kwargs", metavar="JSON", help="Keyword arguments for --dataset.")
@click.option(
    "--collate",
    metavar="MODULE:NAME",
    help="With --materialize: the run's collate_fn [default: torch's default_collate].",
)
@output_options
def show_command(
    root: str,
    batch: int,
    rank: int,
    head: str | None,
    materialize: bool,
    dataset: str | None,
    dataset_kwargs: str | None,
    collate: str | None,
    fmt: str,
) -> None:
    """The samples of batch BATCH of RANK in the lineage, and the batch's digest.

    --materialize re-creates the batch from the dataset and prints its content digest,
    which equals the recorded digest of the batch the training loop received.

    Example:

    \b
        ledger show /runs/exp7 --batch 41
        ledger show /runs/exp7 --batch 41 --rank 3 --format csv
        ledger show /runs/exp7 --batch 41 --materialize \\
            --dataset examples/train_lm.py:StdlibWindows --dataset-kwargs '{"seq_len": 64}'
    """
    import pyarrow as pa
    from rich.table import Table

    from ledger.audit.queries import materialize as materialize_batch
    from ledger.audit.queries import show

    if materialize and dataset is None:
        raise click.UsageError("--materialize needs --dataset")
    head = _commit(root, head)
    made = None
    if materialize:
        assert dataset is not None
        ds, collate_fn = _dataset_and_collate(dataset, dataset_kwargs, collate)
        with _progress(f"re-creating batch {batch}"), _user_code(f"re-creating batch {batch}"):
            made = materialize_batch(root, batch, ds, rank=rank, collate_fn=collate_fn, head=head)
        record = made.record
    else:
        with _progress(f"finding batch {batch}"):
            record = show(root, batch, rank, head)
    # A mixture's events name their source (ids are per source), and a stream source's
    # the source epoch that seeded the sample; shown where the log holds them.
    mixed = [
        c
        for c in ("source", "source_epoch")
        if c in record.events.column_names and record.events[c].null_count < len(record.events)
    ]
    columns = ["position", *mixed, "sample_id", "kind", "token_start", "token_end", "length"]
    columns.append("value")
    events = record.events.select(columns)
    if record.errors is not None:  # bad samples left out of the batch, where they were
        events = pa.concat_tables([events, record.errors.select(columns)]).sort_by("position")
    if fmt in ("json", "ndjson"):
        out: dict[str, Any] = {
            "rank": record.rank, "batch": record.batch, "epoch": record.epoch,
            "worker": record.worker, "commit_id": record.commit_id,
            "digest": record.digest, "events": events.to_pylist(),
            "skip_reason": record.skip_reason,
        }  # fmt: skip
        if made is not None:
            out["materialized_digest"] = made.digest
            out["matches"] = made.matches
        click.echo(_dumps(out, indent=2 if fmt == "json" else None))
    elif fmt == "csv":
        _print_rows(columns, iter(zip(*events.to_pydict().values(), strict=True)), fmt)
    else:
        console = _console(sys.stdout)
        console.print(
            f"batch {record.batch} of rank {record.rank}: epoch {record.epoch}, worker "
            f"{record.worker}, commit {record.commit_id}, {events.num_rows} events",
            soft_wrap=True,
        )
        if record.skip_reason is not None:
            console.print(f"skipped on purpose: {record.skip_reason}", soft_wrap=True)
        console.print(f"recorded digest:     {record.digest or '-'}", soft_wrap=True)
        if made is not None:
            verdict = "matches" if made.matches else "DIFFERS"
            console.print(f"materialized digest: {made.digest} ({verdict})", soft_wrap=True)
        table = Table(*columns)
        for row in zip(*events.to_pydict().values(), strict=True):
            table.add_row(*("" if v is None else str(v) for v in row))
        console.print(table)
    if made is not None and not made.matches:
        sys.exit(CHECK_FAILED)


@main.command("reconstruct")
@click.argument("root")
@click.option(
    "--commit",
    required=True,
    metavar="COMMIT",
    help="The checkpoint's commit: its step (40), STEP-ATTEMPT (40-1) or full id.",
)
@click.option(
    "--out", required=True, type=click.Path(dir_okay=False), help="Parquet file to write."
)
def reconstruct_command(root: str, commit: str, out: str) -> None:
    """Write exactly what the model at COMMIT saw, in order, to a Parquet file.

    One row per sample handed to the training loop (per token span when packing), in
    the order the loop received them (column ordinal), with epoch, batch, rank,
    position, the commit that logged it, and the recorded draws (value).

    Example:

    \b
        ledger reconstruct /runs/exp7 --commit 40 --out seen.parquet
        duckdb -c "SELECT count(DISTINCT sample_id) FROM 'seen.parquet'"
    """
    from ledger.audit.queries import reconstruct

    cid = _commit(root, commit)
    assert cid is not None
    with _progress("reading commits") as progress:
        rows = reconstruct(root, cid, out, progress)
    commit = cid
    click.echo(f"wrote {rows} events of the lineage of {commit} to {out}")


@main.command("compact")
@click.argument("root")
@click.option(
    "--before",
    metavar="COMMIT",
    help="Compact the lineage of this commit: its step (40), STEP-ATTEMPT (40-1) or full id "
    "[default: the newest commit].",
)
def compact_command(root: str, before: str | None) -> None:
    """Rewrite the segments of the lineage of COMMIT at ROOT into few large files.

    Publishes them through a compaction commit, then deletes the originals; every
    view and command answers exactly as before. Safe to kill at any point (run it again
    to finish) and to run while training appends: the newest segment of each rank (what
    a resume reads) is left as it is.

    Example:

    \b
        ledger compact /runs/exp7
        ledger compact s3://bucket/runs/exp7 --before 40000
    """
    from ledger.compaction import compact

    cid = _commit(root, before) if before is not None else None
    result = compact(root, cid)
    if not result.id:
        click.echo(f"nothing to compact; {result.retired} segments retired")
        return
    click.echo(
        f"compaction {result.id}: {result.segments} segments ({result.rows} events) into "
        f"{result.files} files; {result.retired} segments retired"
    )


@main.command("verify")
@click.argument("root")
@click.option(
    "--data",
    is_flag=True,
    help="Also re-create the batches of --batches through --dataset with the recorded "
    "seeds and compare each one's content digest with the recorded one.",
)
@click.option(
    "--dataset",
    metavar="MODULE:NAME",
    help="With --data: the run's dataset (as for show --materialize).",
)
@click.option("--dataset-kwargs", metavar="JSON", help="Keyword arguments for --dataset.")
@click.option(
    "--collate",
    metavar="MODULE:NAME",
    help="With --data: the run's collate_fn [default: torch's default_collate].",
)
@click.option(
    "--batches",
    metavar="START:STOP",
    help="With --data: the batch indexes to re-create [default: every committed batch].",
)
@click.option("--rank", default=0, show_default=True, type=_COUNT)
@output_options
def verify_command(
    root: str,
    data: bool,
    dataset: str | None,
    dataset_kwargs: str | None,
    collate: str | None,
    batches: str | None,
    rank: int,
    fmt: str,
) -> None:
    """Check the integrity of the log at ROOT (exit status 3 if a check fails).

    Markers parse; every parent exists and the chain has no loop; every attempt that
    committed has its record; every segment exists with its marker's size, SHA-256 and
    row count, reads as Parquet with the event schema and holds only its own attempt and
    rank; no sample is consumed twice in an epoch of the lineage. Orphan segments are
    reported. With --data, the data too: each batch of the range is re-created from the
    dataset and must have the digest recorded when the model received it (one batch of
    reads each).

    Example:

    \b
        ledger verify /runs/exp7
        ledger verify /runs/exp7 --format json
        ledger verify /runs/exp7 --data --batches 0:100 \\
            --dataset examples/train_lm.py:StdlibWindows --dataset-kwargs '{"seq_len": 64}'
    """
    from ledger.audit.checks import verify, verify_data

    _exit_without_collecting()
    if data and dataset is None:
        raise click.UsageError("--data needs --dataset")
    span = _batch_range(batches)
    with _progress("hashing segments") as progress:
        v = verify(root, progress)
    results = list(v.results)
    if data and v.ok:
        assert dataset is not None
        ds, collate_fn = _dataset_and_collate(dataset, dataset_kwargs, collate)
        with _progress("re-creating batches") as progress, _user_code("re-creating batches"):
            results.append(
                verify_data(root, ds, batches=span, rank=rank, collate_fn=collate_fn,
                            progress=progress)
            )  # fmt: skip
    _print_checks(results, fmt)
    if fmt == "table":
        click.echo(f"{v.segments} segments, {v.events} events, {v.bytes} bytes")
    if not all(r.ok for r in results):
        sys.exit(CHECK_FAILED)


def _exit_without_collecting() -> None:
    """Have the interpreter's exit skip its garbage collections (for a command that leaves
    no file open: it only reads).

    Python's finalization collects garbage several times while it tears modules down, and
    each collection walks every object still alive: with pyarrow and pandas imported, the
    exit of ``ledger verify`` took 0.29-0.34 s here, 0.08-0.14 s with this.
    :func:`gc.freeze` at exit takes those objects out of the collector's view; reference
    counting still frees them. Registered at exit, not called now, so that a caller that
    runs commands in its own process (``CliRunner``) keeps collecting until it ends.
    """
    global _EXIT_REGISTERED
    if not _EXIT_REGISTERED:
        atexit.register(gc.freeze)
        _EXIT_REGISTERED = True


_EXIT_REGISTERED = False


def _batch_range(text: str | None) -> range | None:
    if text is None:
        return None
    start, sep, stop = text.partition(":")
    if not sep or not start.isdigit() or not stop.isdigit() or int(stop) < int(start):
        raise click.BadParameter(f"{text!r} is not START:STOP (e.g. 0:100)", param_hint="--batches")
    return range(int(start), int(stop))


@main.command("report")
@click.argument("root")
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="HTML file to write.")
@_head_option
def report_command(root: str, out: str, head: str | None) -> None:
    """Write a self-contained HTML report of the log at ROOT, with plots.

    Coverage per epoch over batches, per-rank progress, duplicates over time and the
    commit timeline with abandoned branches, and the summary's tables. The file has no
    external references: open it anywhere, attach it to a ticket.

    Example:

    \b
        ledger report /runs/exp7 --out report.html
    """
    from ledger.audit.report import write_report

    head = _commit(root, head)
    with _progress("scanning the log"):
        path = write_report(root, out, head)
    click.echo(f"wrote {path}")


def _print_checks(results: Sequence[CheckResult], fmt: str) -> None:
    from rich.table import Table

    columns = ["check", "ok", "detail"]
    rows = [(r.check, r.ok, r.detail) for r in results]
    if fmt != "table":
        _print_rows(columns, iter(rows), fmt)
        return
    table = Table("check", "result", "detail")
    for name, ok, detail in rows:
        table.add_row(name, "pass" if ok else "FAIL", detail)
    _console(sys.stdout).print(table)


# ---------------------------------------------------------------- formatting


def _iso(value: datetime.datetime) -> str:
    """ISO 8601 in UTC with a ``Z``; a naive time is UTC already (the views store UTC)."""
    if value.tzinfo is not None:
        value = value.astimezone(datetime.timezone.utc).replace(tzinfo=None)
    return value.isoformat() + "Z"


def _with_iso_times(rows: Iterator[tuple[Any, ...]]) -> Iterator[tuple[Any, ...]]:
    for row in rows:
        yield tuple(_iso(v) if isinstance(v, datetime.datetime) else v for v in row)


def _cell(value: Any) -> str:
    if value is None:
        return "NULL"
    if isinstance(value, datetime.datetime):
        return _iso(value)
    return str(value)


def _dumps(value: Any, indent: int | None = None) -> str:
    """``value`` as JSON that other programs parse: a float that is not finite (DuckDB
    answers ``x / 0`` with ``inf``, ``0.0 / 0`` with ``NaN``) is ``null``, as JSON has no
    NaN or Infinity; values JSON has no type for are :func:`_jsonable`'s."""
    return json.dumps(_finite(value), indent=indent, default=_jsonable, allow_nan=False)


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _jsonable(value: Any) -> Any:
    if isinstance(value, datetime.datetime):
        return _iso(value)
    if isinstance(value, (datetime.date, datetime.time)):
        return value.isoformat()
    if isinstance(value, decimal.Decimal):
        if not value.is_finite():
            return None
        return int(value) if value == value.to_integral_value() else float(value)
    if isinstance(value, bytes):
        return value.hex()
    return str(value)


def _console(out: Any) -> Console:
    from rich.console import Console

    # No markup, emoji or highlighting: values from the log are printed as they are.
    return Console(file=out, markup=False, emoji=False, highlight=False)


def _print_rows(
    columns: Sequence[str], rows: Iterator[tuple[Any, ...]], fmt: str, max_rows: int = 0
) -> None:
    """Write ``rows`` to stdout in ``fmt``; csv and ndjson stream, table and json collect.

    A table shows at most ``max_rows`` rows (0: all), the first and the last half, and
    the row count, as DuckDB's command line does; no column is cut (ids are copied whole).
    """
    out = sys.stdout
    if fmt == "csv":
        writer = csv.writer(out, lineterminator="\n")
        writer.writerow(columns)
        writer.writerows(_with_iso_times(rows))
    elif fmt == "ndjson":
        for row in rows:
            out.write(_dumps(dict(zip(columns, row, strict=True))) + "\n")
    elif fmt == "json":
        objects = [dict(zip(columns, row, strict=True)) for row in rows]
        out.write(_dumps(objects, indent=2) + "\n")
    else:
        _print_table(columns, rows, max_rows, out)


def _print_table(
    columns: Sequence[str], rows: Iterator[tuple[Any, ...]], max_rows: int, out: Any
) -> None:
    from rich.table import Table

    first: list[tuple[Any, ...]] = []
    last: collections.deque[tuple[Any, ...]] = collections.deque(maxlen=max_rows // 2 or None)
    count = 0
    head = max_rows - max_rows // 2 if max_rows else None
    for row in rows:  # only the rows shown are formatted; the others are counted
        count += 1
        if head is None or len(first) < head:
            first.append(row)
        else:
            last.append(row)
    hidden = count - len(first) - len(last)
    shown = [tuple(_cell(v) for v in row) for row in first]
    shown += [("…",) * len(columns)] if hidden else []
    shown += [tuple(_cell(v) for v in row) for row in last]
    table = Table(*columns)
    # Every column as wide as its longest cell: values are never cut or wrapped (ids are
    # copied whole); a table wider than the terminal wraps as a whole, as DuckDB's does.
    widths = [len(c) for c in columns]
    for cells in shown:
        widths = [max(w, len(c)) for w, c in zip(widths, cells, strict=True)]
    for column, width in zip(table.columns, widths, strict=True):
        column.min_width = width
        column.no_wrap = True
    for cells in shown:
        table.add_row(*cells)
    console = _console(out)
    console.width = max(console.width, sum(widths) + 3 * len(widths) + 1)
    console.print(table)
    if hidden:
        console.print(f"{count} rows ({len(first) + len(last)} shown)", soft_wrap=True)


def _mixture_summary(root: str, head: str | None) -> MixtureSummary | None:
    """The shares of a mixture run (``None`` for other runs)."""
    from ledger.audit import connect
    from ledger.audit.mixture import summarize_mixture
    from ledger.commits import read_run
    from ledger.store import Store

    config = read_run(Store(root))["config"]
    if "mixture" not in config:
        return None
    con = connect(root, head)
    try:
        return summarize_mixture(Store(root), con, config)
    finally:
        con.close()


def _print_mixture(m: MixtureSummary) -> None:
    from rich.table import Table

    console = _console(sys.stdout)
    sources = Table("source", "samples", "share", "target", "expected", "within", title="Mixture")
    for x in m.sources:
        sources.add_row(
            x.source, str(x.count), f"{x.share:.2%}", f"{x.target:.2%}",
            f"{x.expected:.0f} ± {x.tolerance:.0f}", "yes" if x.ok else "NO",
        )  # fmt: skip
    console.print(sources)
    names = [x.source for x in m.sources]
    if len(m.phases) > 1:
        phases = Table("phase", *names, title="Shares per phase (target)")
        for number, per in m.phases.items():
            phases.add_row(str(number), *(f"{x.share:.1%} ({x.target:.1%})" for x in per))
        console.print(phases)
    steps = Table("steps", *names, title="Shares over steps")
    for first, last, shares in m.steps:
        steps.add_row(f"{first}-{last}", *(f"{shares[n]:.1%}" for n in names))
    console.print(steps)


def _print_summary(s: Summary, fmt: str, mixture: MixtureSummary | None = None) -> None:
    from rich.table import Table

    if fmt in ("json", "ndjson"):
        indent = 2 if fmt == "json" else None
        out = dataclasses.asdict(s)
        if mixture is not None:  # only mixture runs have the key
            out["mixture"] = dataclasses.asdict(mixture)
        click.echo(_dumps(out, indent=indent))
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
    extra = any(e.errors or e.rolled_back for e in s.epochs)
    epochs = Table(
        "epoch", "samples", "distinct", "coverage", "duplicates", "skipped",
        *(("bad", "rolled back") if extra else ()),
        title=f"Lineage of {s.head or '-'}",
    )  # fmt: skip
    for e in s.epochs:
        epochs.add_row(
            str(e.epoch), str(e.samples), str(e.distinct), f"{e.coverage:.2%}",
            str(e.duplicates), str(e.skipped),
            *((str(e.errors), str(e.rolled_back)) if extra else ()),
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
    if s.unreadable_journal_records:
        console.print(
            f"{s.unreadable_journal_records} journal records unreadable (damaged, skipped)",
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
    _print_skips(console, s)
    if s.skew is not None:
        console.print(
            f"largest skew: {s.skew.samples} samples and {s.skew.epochs} epochs between the "
            f"{s.skew.world_size} ranks of commit {s.skew.commit}",
            soft_wrap=True,
        )
    if mixture is not None:
        _print_mixture(mixture)


def _print_skips(console: Any, s: Summary) -> None:
    """The summary's bad samples and batches skipped on purpose, when there are any."""
    from rich.table import Table

    if s.skipped_batches:
        table = Table("rank", "batches", "samples", "attempt", "reason", title="Skipped batches")
        for r in s.skipped_batches:
            table.add_row(
                str(r.rank), f"{r.first}-{r.last}", str(r.samples), str(r.attempt), r.reason
            )
        console.print(table)
    bad = sum(e.errors for e in s.epochs)
    if bad:
        title = f"Bad samples ({bad}" + (
            f", first {len(s.bad_samples)})" if bad > len(s.bad_samples) else ")"
        )
        table = Table("rank", "epoch", "batch", "sample", "error", title=title)
        for b in s.bad_samples:
            table.add_row(
                str(b.rank), str(b.epoch), str(b.batch), str(b.sample_id), f"{b.type}: {b.message}"
            )
        console.print(table)


if __name__ == "__main__":
    sys.exit(main())
