"""The audit on Apache Spark: the views of :mod:`ledger.audit.views` as Spark temp views,
and the summary and the named checks computed in Spark SQL.

For logs no single machine audits (10^4 ranks, 10^12 events). The driver reads the small
JSON files (``run.json``, ``attempts/``, ``commits/``) and the compactions' pieces tables,
as :func:`ledger.audit.views.connect` does; everything that grows with the events is
read by the executors, through the manifest (:mod:`ledger.manifest`):

- ``segments`` and ``states`` are the per-commit manifest files
  (``manifest/<id>.parquet``), read by Spark (built on the driver from the marker for a
  commit written before manifests existed);
- ``events`` are exactly the files the markers name: each segment read whole, its
  ``commit_id`` and ``step`` joined from the manifest by path; each compacted file
  (whose rows carry both) filtered to the commits wanted; orphan segments are never
  listed, so never read;
- ``lineage`` is ``events`` restricted to the head's lineage ranges (one
  ``attempt = a AND step BETWEEN lo AND hi`` per attempt), the ranges its marker records.

The columns and types are those of the DuckDB views (Spark types: INTEGER, BIGINT,
STRING, BOOLEAN, TIMESTAMP, BINARY). ``uncommitted`` and ``journals`` come from the
journals on the driver (they are small: one commit interval per rank).

:func:`summarize` and :func:`check` answer exactly what :func:`ledger.audit.summarize`
and :func:`ledger.audit.checks.check` answer, with exact distinct counts in SQL in place
of the bitmap pass. The summary makes two passes over the rows, neither joining rows to
commits: rows and samples counted per file (grouped by Spark's per-file
``_metadata.file_path``, then matched to the manifest once per file), and one
aggregation over the lineage's own files (distinct counts as popcounts of 64-bit bitmaps
grouped by (epoch, ``sample_id >> 6``), not a group per id; ids outside the dataset;
last position). Both check each segment's and compacted file's SHA-256 in Spark (``sha2``
over ``binaryFile``) and its row count against its marker before trusting it.

Requires the ``spark`` extra (``pip install 'ledger[spark]'``: pyspark) and Java 17.
On a cluster, pass the master URL (``--master yarn``, ``spark://host:7077``) or run under
``spark-submit`` (see the README); S3 roots are read through Hadoop's ``s3a://``
filesystem, which needs the ``hadoop-aws`` jar on the cluster's classpath.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from ledger import manifest
from ledger.audit import views as duck
from ledger.audit.checks import (
    CheckResult,
    _abandoned,
    _skips,
    coverage,
    duplicates,
    loosest,
)
from ledger.audit.names import CHECKS
from ledger.audit.summary import (
    CONSUMED,
    AttemptSummary,
    EpochSummary,
    Position,
    RankSummary,
    Skew,
    Summary,
)
from ledger.commits import (
    default_head,
    lineage_ranges,
    list_commits,
    parsing_once,
    read_commit,
    read_run,
)
from ledger.compaction import list_compactions
from ledger.errors import LedgerError, LogCorrupted
from ledger.schema import EVENT_SCHEMA
from ledger.store import Store

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

SPARK_VIEWS = (
    "events", "lineage", "commits", "segments", "states", "attempts", "run", "uncommitted",
    "journals",
)  # fmt: skip
"""Temp views :func:`register` creates (the names of :data:`ledger.audit.VIEWS`)."""

_SEGMENT = re.compile(r"^events/attempt=[^/]+/rank=[^/]+/[^/]+\.parquet$")


def session(
    master: str | None = None,
    app_name: str = "ledger-audit",
    config: dict[str, str] | None = None,
) -> SparkSession:
    """A Spark session for an audit: the active one, or a new one.

    Args:
        master: the master URL (``local[4]``, ``yarn``, ``spark://host:7077``); ``None``:
            what ``spark-submit`` or ``spark-defaults.conf`` configured, else ``local[*]``.
        app_name: the application's name.
        config: further Spark settings (``{"spark.sql.shuffle.partitions": "8"}``),
            applied when the session is created.

    Returns:
        The session, with the session time zone UTC (the views' timestamps are UTC).

    Raises:
        LedgerError: if pyspark is not installed.
    """
    try:
        from pyspark.sql import SparkSession
    except ImportError as e:
        raise LedgerError(
            "the Spark audit needs pyspark: pip install 'ledger[spark]' (and Java 17)"
        ) from e
    builder = SparkSession.builder.appName(app_name).config("spark.sql.session.timeZone", "UTC")
    if master is not None:
        builder = builder.master(master)
    for key, value in (config or {}).items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.conf.set("spark.sql.session.timeZone", "UTC")
    return spark


def _frame(spark: SparkSession, table: pa.Table) -> DataFrame:
    """A small Arrow table as a DataFrame (sent from the driver)."""
    from pyspark.sql import types as T

    fields = []
    for f in table.schema:
        kind = _SPARK_TYPES[str(f.type)]
        fields.append(T.StructField(f.name, kind, True))
    rows = [tuple(r.values()) for r in table.to_pylist()]
    return spark.createDataFrame(rows, T.StructType(fields))


def _types() -> dict[str, Any]:
    from pyspark.sql import types as T

    return {
        "int32": T.IntegerType(),
        "int64": T.LongType(),
        "string": T.StringType(),
        "bool": T.BooleanType(),
        "timestamp[us]": T.TimestampNTZType(),
        "binary": T.BinaryType(),
        "fixed_size_binary[32]": T.BinaryType(),
        "dictionary<values=string, indices=int8, ordered=0>": T.StringType(),
        "dictionary<values=string, indices=int16, ordered=0>": T.StringType(),  # source
    }


class _Types(dict[str, Any]):
    """Arrow type names -> Spark types, built on first use (pyspark is imported late)."""

    def __missing__(self, key: str) -> Any:
        self.update(_types())
        return dict.__getitem__(self, key)


_SPARK_TYPES = _Types()


def _event_schema(extra: bool) -> Any:
    from pyspark.sql import types as T

    fields = [T.StructField(f.name, _SPARK_TYPES[str(f.type)], True) for f in EVENT_SCHEMA]
    if extra:
        fields += [
            T.StructField("commit_id", T.StringType(), True),
            T.StructField("step", T.LongType(), True),
        ]
    return T.StructType(fields)


_EVENT_COLUMNS = [*EVENT_SCHEMA.names, "commit_id", "step"]


@parsing_once
def register(spark: SparkSession, root: str, head: str | None = None) -> str | None:
    """Create the audit's temp views of the log under ``root`` on ``spark``.

    Args:
        spark: the session (:func:`session`).
        root: the log root: a local directory, or a URI Spark's Hadoop filesystems read
            (``s3a://bucket/prefix``; the driver reads the JSON files through fsspec, so
            ``s3://`` and ``s3a://`` name the same root there).
        head: the head commit id; ``None``: the default head (newest commit of the
            newest attempt).

    Returns:
        The head commit id (``None``: the log has no commit).

    Raises:
        CommitNotFound: if ``root`` holds no run or ``head`` names no commit.
        LogCorrupted: if a marker, its rank table or its manifest is damaged, the chain
            is broken, or a committed file is missing.
    """
    store = Store(_fsspec_uri(root))
    run = read_run(store)
    commits = list_commits(store)
    by_id = {c.id: c for c in commits}
    if head is None:
        newest = default_head(commits)
        head = newest.id if newest is not None else None
    ranges: manifest.Ranges = ()
    chain: set[str] = set()
    if head is not None:
        top = by_id[head] if head in by_id else read_commit(store, head)
        ranges = lineage_ranges(store, top)
        chain = {c.id for c in commits if manifest.in_ranges(ranges, c.attempt, c.step)}
    tables = duck._tables(commits)
    duck._check_segments_exist(store, tables.segments)
    small = {
        "commits": duck._commits_table(commits, chain, head),
        "attempts": duck._attempts_table(store),
        "run": duck._run_table(run),
    }
    lost, journals = duck._journal_tables(store, tables.states)
    small["uncommitted"] = lost
    small["journals"] = journals
    for name, table in small.items():
        _frame(spark, table).createOrReplaceTempView(name)
    listed = _manifests(spark, store, root, commits)
    listed.createOrReplaceTempView("ledger_manifest")
    spark.sql(
        "SELECT commit_id, step, attempt, rank, path, rows, bytes, sha256 "
        "FROM ledger_manifest WHERE path IS NOT NULL"
    ).createOrReplaceTempView("segments")
    spark.sql(
        "SELECT commit_id, step, attempt, rank, epoch, epoch_batch, batch FROM ledger_manifest"
    ).createOrReplaceTempView("states")
    _events(spark, store, root, commits).createOrReplaceTempView("events")
    lineage = [c for c in commits if c.id in chain]
    _rows(spark, store, root, lineage).createOrReplaceTempView("ledger_lineage_rows")
    where = " OR ".join(f"(attempt = {a} AND step BETWEEN {lo} AND {hi})" for a, lo, hi in ranges)
    spark.sql(f"SELECT * FROM events WHERE {where or 'false'}").createOrReplaceTempView("lineage")
    return head


def _fsspec_uri(root: str) -> str:
    """The root as the driver's fsspec reads it (``s3a://`` is Hadoop's name for S3)."""
    return "s3://" + root[len("s3a://") :] if root.startswith("s3a://") else root


def _spark_uri(root: str, rel: str) -> str:
    """A path under the root as Spark reads it (``s3://`` roots through ``s3a://``)."""
    base = "s3a://" + root[len("s3://") :] if root.startswith("s3://") else root
    return f"{base.rstrip('/')}/{rel}"


def _manifests(spark: SparkSession, store: Store, root: str, commits: Sequence[Any]) -> DataFrame:
    """The manifest rows of every commit: read by Spark where a marker names a manifest
    file, else built from the marker on the driver."""
    schema = _manifest_schema()
    named = [c for c in commits if c.manifest is not None]
    built = [manifest.table(c) for c in commits if c.manifest is None]
    parts = []
    if named:
        paths = [_spark_uri(root, manifest.manifest_path(c.id)) for c in named]
        parts.append(spark.read.schema(schema).parquet(*paths))
    if built:
        parts.append(_frame(spark, pa.concat_tables(built)))
    if not parts:
        return spark.createDataFrame([], schema)
    out = parts[0]
    for p in parts[1:]:
        out = out.unionByName(p)
    return out


def _manifest_schema() -> Any:
    from pyspark.sql import types as T

    return T.StructType(
        [T.StructField(f.name, _SPARK_TYPES[str(f.type)], True) for f in manifest.MANIFEST_SCHEMA]
    )


def _segment_rows(
    spark: SparkSession, store: Store, root: str, paths: Sequence[str], *, with_file: bool = True
) -> DataFrame:
    """The rows of the segment files ``paths`` (no commit columns), each with the path of
    its file as Spark names it (``_ledger_file``, from the reader's ``_metadata.file_path``)
    if ``with_file``.

    Only a reader whose consumer uses the path may carry it: Spark prunes an unused
    ``_metadata`` column to nothing only when a field of it is used, and otherwise reads
    every metadata field (``row_index`` too) and builds the whole struct for every row
    (measured: the lineage's aggregation read ``_tmp_metadata_row_index`` before)."""
    from pyspark.sql import functions as F

    odd = [p for p in paths if not _SEGMENT.match(p)]
    if odd:
        raise LogCorrupted(
            f"segment {store.full(odd[0])} is not at events/attempt=A/rank=R/NAME.parquet: "
            "the Spark audit joins segments to commits by that path"
        )
    if not paths:
        empty = spark.createDataFrame([], _event_schema(False))
        return empty.withColumn("_ledger_file", F.lit(None).cast("string")) if with_file else empty
    raw = spark.read.schema(_event_schema(False)).parquet(*[_spark_uri(root, p) for p in paths])
    return raw.select("*", F.col("_metadata.file_path").alias("_ledger_file")) if with_file else raw


def _relative(column: Any) -> Any:
    """The path under the root of a file Spark names (a URI ending in the segment path)."""
    from pyspark.sql import functions as F

    return F.regexp_extract(column, r"(events/attempt=[^/]+/rank=[^/]+/[^/]+)$", 1)


def _compacted_rows(
    spark: SparkSession, root: str, compacted: Sequence[tuple[str, frozenset[str] | None]]
) -> DataFrame | None:
    """The wanted rows of the compacted files (they carry ``commit_id`` and ``step``)."""
    from pyspark.sql import functions as F

    parts = []
    for path, ids in compacted:
        df = spark.read.schema(_event_schema(True)).parquet(_spark_uri(root, path))
        if ids is not None:
            df = df.where(F.col("commit_id").isin(sorted(ids)))
        parts.append(df.select(*_EVENT_COLUMNS))
    return _union(parts)


def _union(parts: Sequence[DataFrame]) -> DataFrame | None:
    if not parts:
        return None
    out = parts[0]
    for p in parts[1:]:
        out = out.unionByName(p)
    return out


def _events(spark: SparkSession, store: Store, root: str, commits: Sequence[Any]) -> DataFrame:
    """Exactly the committed events (all branches), with ``commit_id`` and ``step``.

    Also registers the hidden views the summary scans: ``ledger_segment_rows`` (the
    segments' rows with their file) and ``ledger_compacted_rows``."""
    from pyspark.sql import functions as F

    listed = manifest.files(store, commits)
    rows = _segment_rows(spark, store, root, [p for p, _, _ in listed.segments])
    rows.createOrReplaceTempView("ledger_segment_rows")
    compacted = _compacted_rows(spark, root, listed.compacted)
    if compacted is None:
        compacted = spark.createDataFrame([], _event_schema(True))
    compacted.createOrReplaceTempView("ledger_compacted_rows")
    parts: list[DataFrame] = []
    if listed.segments:
        names = spark.sql("SELECT path AS _ledger_path, commit_id, step FROM segments")
        tagged = rows.select("*", _relative(F.col("_ledger_file")).alias("_ledger_path"))
        parts.append(tagged.join(F.broadcast(names), "_ledger_path").select(*_EVENT_COLUMNS))
    if listed.compacted:
        parts.append(compacted)
    out = _union(parts)
    return out if out is not None else spark.createDataFrame([], _event_schema(True))


def _rows(spark: SparkSession, store: Store, root: str, commits: Sequence[Any]) -> DataFrame:
    """The events of ``commits`` (a lineage) without commit columns: their segment files
    read directly, so no row is joined to its commit, plus their compacted rows."""
    listed = manifest.files(store, commits)
    names = list(EVENT_SCHEMA.names)
    segments = [p for p, _, _ in listed.segments]
    parts = [_segment_rows(spark, store, root, segments, with_file=False).select(*names)]
    compacted = _compacted_rows(spark, root, listed.compacted)
    if compacted is not None:
        parts.append(compacted.select(*names))
    out = _union(parts)
    assert out is not None
    return out


# ---------------------------------------------------------------- summary


def _one(spark: SparkSession, sql: str) -> tuple:
    rows = spark.sql(sql).collect()
    assert len(rows) == 1, "an aggregate without GROUP BY returns one row"
    return tuple(rows[0])


@parsing_once
def summarize(
    spark: SparkSession, root: str, head: str | None = None, *, checksums: bool = True
) -> Summary:
    """The audit summary of the log under ``root``, computed in Spark SQL.

    Equal to :func:`ledger.audit.summarize` on the same log and head.

    Args:
        spark: the session.
        root: the log root.
        head: head commit id (``None``: the default head).
        checksums: check each committed file's SHA-256 against its marker or compaction
            (one more read of every file; ``False`` trusts the files).

    Returns:
        The summary.

    Raises:
        CommitNotFound: if ``root`` holds no run, or ``head`` names no commit.
        LogCorrupted: if the chain is broken, a committed file is missing, differs from
            its marker (rows, SHA-256), or holds an id outside the dataset.
    """
    head = register(spark, root, head)
    store = Store(_fsspec_uri(root))
    if checksums:
        _check_checksums(spark, store, root)
    run = read_run(store)
    # Pass 1, over every committed row: events and samples per file, grouped by the
    # file's name (a per-file constant) and joined to the segments only once per file.
    counts = spark.sql(
        f"""
        SELECT s.commit_id, s.step, s.attempt, s.rank, s.path, s.rows,
               coalesce(e.events, 0) AS events, coalesce(e.samples, 0) AS samples
        FROM segments AS s LEFT JOIN (
            SELECT commit_id, rank, sum(events) AS events, sum(samples) AS samples FROM (
                SELECT f.events, f.samples, m.commit_id, m.rank FROM (
                    SELECT _ledger_file, count(*) AS events, count_if({CONSUMED}) AS samples
                    FROM ledger_segment_rows GROUP BY _ledger_file
                ) AS f JOIN segments AS m ON m.path = regexp_extract(
                    f._ledger_file, '(events/attempt=[^/]+/rank=[^/]+/[^/]+)$', 1)
                UNION ALL
                SELECT count(*) AS events, count_if({CONSUMED}) AS samples, commit_id, rank
                FROM ledger_compacted_rows GROUP BY commit_id, rank
            ) GROUP BY commit_id, rank
        ) AS e ON e.commit_id = s.commit_id AND e.rank = s.rank
        """
    ).cache()
    try:
        counts.createOrReplaceTempView("segment_counts")
        return _summary(spark, store, run, head)
    finally:
        counts.unpersist()


def _summary(spark: SparkSession, store: Store, run: dict[str, Any], head: str | None) -> Summary:
    """The summary, once ``segment_counts`` is registered (cached)."""
    run_id: str = run["run_id"]
    dataset_len = run.get("config", {}).get("dataset_len")
    bad = spark.sql("SELECT path, events, rows FROM segment_counts WHERE events <> rows LIMIT 1")
    for path, events, rows in bad.collect():
        raise LogCorrupted(f"segment {store.full(path)} has {events} rows, its marker says {rows}")
    # Pass 2, over the lineage's rows only (its files read directly, no join): exact
    # distinct counts without a group per id. Rows are grouped by (epoch, word), a word
    # being 64 consecutive ids (``sample_id >> 6``), each group OR-ing one bit per id
    # (``1 << (sample_id & 63)``) into a 64-bit bitmap of the ids consumed and one of the
    # ids skipped; the distinct counts are the bitmaps' popcounts (``bit_count``). That is
    # 64 times fewer groups than (epoch, id), so the hash aggregation's table and its
    # shuffle shrink alike (a group per id outgrew the execution memory at 10^8 events and
    # spilled). Every int64 id has one (word, bit), negative ones too (arithmetic shift,
    # two's complement mask), so the counts are exact. The rows outside the dataset and
    # each epoch's last position ride in the same aggregation.
    epochs = spark.sql(
        f"""
        WITH flagged AS (
            SELECT epoch, sample_id, position, {CONSUMED} AS used, kind = 'skip' AS dropped
            FROM ledger_lineage_rows WHERE kind = 'skip' OR {CONSUMED}
        ), words AS (
            SELECT epoch, shiftright(sample_id, 6) AS word,
                   count_if(used) AS used,
                   bit_or(CASE WHEN used THEN shiftleft(1L, sample_id & 63) ELSE 0L END)
                       AS used_bits,
                   count_if(dropped) AS dropped,
                   bit_or(CASE WHEN dropped THEN shiftleft(1L, sample_id & 63) ELSE 0L END)
                       AS dropped_bits,
                   max(CASE WHEN used THEN position END) AS last,
                   count_if(sample_id < 0 OR sample_id >= {dataset_len or 0}) AS outside
            FROM flagged GROUP BY epoch, word
        )
        SELECT epoch, sum(used), sum(bit_count(used_bits)), sum(dropped),
               sum(bit_count(dropped_bits)), sum(bit_count(used_bits | dropped_bits)),
               max(last), sum(outside)
        FROM words GROUP BY epoch ORDER BY epoch
        """
    ).collect()
    if any(r[7] for r in epochs):
        outside = spark.sql(
            f"""
            SELECT sample_id, commit_id, rank FROM lineage
            WHERE (kind = 'skip' OR {CONSUMED})
                AND (sample_id < 0 OR sample_id >= {dataset_len or 0})
            LIMIT 1
            """
        ).collect()
        for sample_id, cid, rank in outside:
            raise LogCorrupted(
                f"the segment of rank {rank} at commit {cid} holds sample id {sample_id}, "
                f"outside the dataset's [0, {dataset_len})"
            )
    spark.sql(
        """
        SELECT c.commit_id, c.attempt, c.in_lineage, c.world_size,
               coalesce(e.events, 0) AS events, coalesce(e.samples, 0) AS samples
        FROM commits AS c LEFT JOIN (
            SELECT commit_id, sum(events) AS events, sum(samples) AS samples
            FROM segment_counts GROUP BY commit_id
        ) AS e ON e.commit_id = c.commit_id
        """
    ).createOrReplaceTempView("per_commit")
    attempts = spark.sql(
        f"""
        SELECT coalesce(a.attempt, c.attempt) AS attempt, any_value(a.parent),
               count(c.commit_id), coalesce(sum(c.events), 0),
               coalesce(any_value(u.batches), 0), coalesce(any_value(u.samples), 0),
               coalesce(any_value(a.world_size), any_value(c.world_size), 1)
        FROM attempts AS a FULL OUTER JOIN per_commit AS c ON a.attempt = c.attempt
        LEFT JOIN (
            SELECT attempt, count(DISTINCT rank, batch) AS batches,
                   count_if({CONSUMED}) AS samples
            FROM uncommitted GROUP BY attempt
        ) AS u ON u.attempt = coalesce(a.attempt, c.attempt)
        GROUP BY 1 ORDER BY 1
        """
    ).collect()
    commits, abandoned_commits, abandoned_samples = _one(
        spark,
        """
        SELECT count(*), count_if(NOT in_lineage),
               coalesce(sum(CASE WHEN NOT in_lineage THEN samples END), 0)
        FROM per_commit
        """,
    )
    last = None
    with_samples = [r for r in epochs if r[1]]
    if with_samples:
        e, position = int(with_samples[-1][0]), with_samples[-1][6]
        last = Position(e, int(position)) if position is not None else None
    (journal_bad,) = _one(spark, "SELECT coalesce(sum(unreadable), 0) FROM journals")
    return Summary(
        run_id=run_id,
        dataset_len=dataset_len,
        attempts=tuple(
            AttemptSummary(int(r[0]), r[1], int(r[2]), int(r[3]), int(r[4]), int(r[5]), int(r[6]))
            for r in attempts
        ),
        commits=int(commits),
        head=head,
        epochs=tuple(
            EpochSummary(
                epoch=int(r[0]),
                samples=int(r[1]),
                distinct=int(r[2]),
                coverage=int(r[2]) / dataset_len if dataset_len else 0.0,
                duplicates=int(r[1]) - int(r[2]),
                skipped=int(r[3]),
                skipped_distinct=int(r[4]),
                covered=int(r[5]),
            )
            for r in epochs
        ),
        abandoned_commits=int(abandoned_commits),
        abandoned_samples=int(abandoned_samples),
        last_position=last,
        ranks=_ranks(spark, head) if head else (),
        skew=_skew(spark),
        unreadable_journal_records=int(journal_bad),
    )


def _check_checksums(spark: SparkSession, store: Store, root: str) -> None:
    """Every committed file (segment or compacted file) has the size and SHA-256 its
    marker or compaction names: hashed by the executors (``sha2`` over ``binaryFile``) and
    compared in one join, so no per-file list comes back to the driver."""
    from pyspark.sql import functions as F

    files = {f.path: f for c in list_compactions(store) for f in c.files}
    listed = manifest.files(store, list_commits(store))
    wanted = [p for p, _, _ in listed.segments] + [p for p, _ in listed.compacted]
    if not wanted:
        return
    compacted = pa.table(
        {
            "path": [p for p, _ in listed.compacted],
            "bytes": [files[p].bytes for p, _ in listed.compacted],
            "sha256": [files[p].sha256 for p, _ in listed.compacted],
        },
        schema=pa.schema([("path", pa.string()), ("bytes", pa.int64()), ("sha256", pa.string())]),
    )
    expected = spark.sql("SELECT path, bytes, sha256 FROM segments")
    if compacted.num_rows:
        expected = expected.unionByName(_frame(spark, compacted))
    found = (
        spark.read.format("binaryFile")
        .load([_spark_uri(root, p) for p in wanted])
        .select(
            F.regexp_extract("path", r"(events/.+)$", 1).alias("path"),
            F.col("length").alias("found_bytes"),
            F.sha2("content", 256).alias("found_sha256"),
        )
    )
    bad = (
        found.join(expected, "path")
        .where("found_bytes <> bytes OR found_sha256 <> sha256")
        .select("path")
        .limit(1)
        .collect()
    )
    for (rel,) in bad:
        raise LogCorrupted(
            f"{store.full(rel)} has another size or SHA-256 than its marker or compaction "
            "names: it was altered"
        )


def _ranks(spark: SparkSession, head: str) -> tuple[RankSummary, ...]:
    rows = spark.sql(
        f"""
        SELECT s.rank, s.epoch, s.epoch_batch, s.batch, coalesce(l.samples, 0)
        FROM states AS s LEFT JOIN (
            SELECT rank, sum(samples) AS samples FROM segment_counts
            WHERE commit_id IN (SELECT commit_id FROM commits WHERE in_lineage) AND step > (
                SELECT coalesce(max(step), -1) FROM commits WHERE in_lineage AND world_size
                    <> (SELECT world_size FROM commits WHERE commit_id = '{head}')
            )
            GROUP BY 1
        ) AS l ON l.rank = s.rank
        WHERE s.commit_id = '{head}' ORDER BY s.rank
        """
    ).collect()
    most = max((int(r[4]) for r in rows), default=0)
    return tuple(
        RankSummary(
            rank=int(r[0]),
            epoch=int(r[1]),
            epoch_batch=int(r[2]),
            batch=int(r[3]),
            samples=int(r[4]),
            behind=most - int(r[4]),
        )
        for r in rows
    )


def _skew(spark: SparkSession) -> Skew | None:
    rows = spark.sql(
        """
        WITH per AS (
            SELECT c.commit_id, c.step, c.attempt, c.world_size, s.rank, s.epoch,
                   coalesce(e.n, 0) AS n
            FROM commits AS c JOIN states AS s ON s.commit_id = c.commit_id
            LEFT JOIN (
                SELECT commit_id, rank, sum(samples) AS n FROM segment_counts
                GROUP BY commit_id, rank
            ) AS e ON e.commit_id = c.commit_id AND e.rank = s.rank
            WHERE c.in_lineage
        ), cumulative AS (
            SELECT *, sum(n) OVER (PARTITION BY attempt, rank ORDER BY step) AS seen FROM per
        )
        SELECT commit_id, any_value(world_size), max(seen) - min(seen),
               max(epoch) - min(epoch), any_value(step) AS step
        FROM cumulative GROUP BY commit_id HAVING count(*) > 1
        ORDER BY 3 DESC, 4 DESC, step LIMIT 1
        """
    ).collect()
    if not rows:
        return None
    r = rows[0]
    return Skew(r[0], int(r[1]), int(r[2]), int(r[3]))


# ---------------------------------------------------------------- checks


@parsing_once
def check(
    spark: SparkSession,
    root: str,
    names: Sequence[str] = CHECKS,
    *,
    head: str | None = None,
    max_skew: int | None = None,
    allow_uncommitted: int = 0,
    checksums: bool = True,
    summary: Summary | None = None,
) -> list[CheckResult]:
    """The named checks of :func:`ledger.audit.checks.check`, on Spark.

    The counts come from :func:`summarize` (Spark SQL) and the ``progress`` check is a
    Spark SQL window over ``states``; each verdict is then the function the DuckDB path
    uses, so both paths judge alike.

    Args:
        spark: the session.
        root: the log root.
        names: checks to run, from :data:`CHECKS`.
        head: head commit (default: the newest commit of the newest attempt).
        max_skew: the ``skew`` check's limit in samples (default: the batch size).
        allow_uncommitted: uncommitted batches per attempt the ``abandoned`` check accepts.
        checksums: check every committed file's SHA-256 (see :func:`summarize`).
        summary: what :func:`summarize` returned for this ``root`` and ``head`` just before
            on ``spark`` (its views are still registered): not computed again.

    Returns:
        One result per name, in the order given; a damaged log fails every check.

    Raises:
        ValueError: if a name is not in :data:`CHECKS`.
        CommitNotFound: if ``root`` holds no run, or ``head`` names no commit.
    """
    unknown = [n for n in names if n not in CHECKS]
    if unknown:
        raise ValueError(f"unknown check {unknown[0]!r}; the checks are {', '.join(CHECKS)}")
    store = Store(_fsspec_uri(root))
    try:
        config = read_run(store)["config"]
        if summary is None:
            summary = summarize(spark, root, head, checksums=checksums)
        config = loosest(store, [a.attempt for a in summary.attempts], config)
    except LogCorrupted as e:
        return [CheckResult(name, False, f"not checked, the log is damaged: {e}") for name in names]
    results = []
    for name in names:
        if name == "coverage":
            results.append(coverage(summary))
        elif name == "duplicates":
            results.append(duplicates(summary))
        elif name == "skips":
            results.append(_skips(summary, config))
        elif name == "abandoned":
            results.append(_abandoned(store, summary, allow_uncommitted))
        elif name == "progress":
            results.append(_progress(spark))
        else:
            limit = int(config.get("batch_size", 1)) if max_skew is None else max_skew
            skew = summary.skew
            spread = skew.samples if skew else 0
            results.append(
                CheckResult(
                    name,
                    spread <= limit,
                    f"largest spread {spread} samples at commit {skew.commit} (limit {limit})"
                    if skew
                    else "one rank: no skew",
                )
            )
    return results


def _progress(spark: SparkSession) -> CheckResult:
    rows = spark.sql(
        """
        WITH per AS (
            SELECT s.rank, c.step, c.attempt, c.commit_id, s.epoch, s.batch,
                   lag(s.epoch) OVER w AS prev_epoch, lag(s.batch) OVER w AS prev_batch
            FROM states AS s JOIN commits AS c ON c.commit_id = s.commit_id
            WHERE c.in_lineage
            WINDOW w AS (PARTITION BY s.rank ORDER BY c.step, c.attempt)
        )
        SELECT rank, commit_id, prev_epoch, epoch, prev_batch, batch FROM per
        WHERE epoch < prev_epoch OR batch < prev_batch OR epoch > prev_epoch + 1
        ORDER BY step, attempt, rank LIMIT 5
        """
    ).collect()
    if rows:
        detail = "; ".join(
            f"rank {r} at {c}: epoch {pe} -> {e}, batch {pb} -> {b}" for r, c, pe, e, pb, b in rows
        )
        return CheckResult("progress", False, detail)
    n, e0, e1, b0, b1 = _one(
        spark,
        """
        SELECT count(*), min(s.epoch), max(s.epoch), min(s.batch), max(s.batch)
        FROM states AS s JOIN commits AS c ON c.commit_id = s.commit_id WHERE c.is_head
        """,
    )
    if not n:
        return CheckResult("progress", True, "no commit yet")
    epochs = f"epoch {e0}" if e0 == e1 else f"epochs {e0}-{e1}"
    batches = f"batch {b0}" if b0 == b1 else f"batches {b0}-{b1}"
    return CheckResult("progress", True, f"{n} ranks at {epochs}, {batches}; none went back")


__all__ = ["SPARK_VIEWS", "check", "register", "session", "summarize"]
