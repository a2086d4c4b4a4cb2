"""What a model saw: where a sample went, what a batch held, the stream up to a commit.

These read segments directly with Arrow (row order is consumption order within a
segment) rather than through SQL, whose result order is only what ``ORDER BY`` says.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ledger import segments, validate
from ledger.audit.scan import read_verified
from ledger.audit.views import connect
from ledger.commits import (
    ATTEMPT_NAME,
    Commit,
    SegmentRef,
    default_head,
    lineage,
    list_commits,
    parsing_once,
    read_attempt,
    read_run,
)
from ledger.errors import (
    BatchSkipped,
    CommitNotFound,
    ConfigMismatch,
    LedgerError,
    SourceMissing,
    UnsupportedArgument,
)
from ledger.schema import BATCH, ERROR, EVENT_SCHEMA, ROLLBACK, SAMPLE, SPAN
from ledger.store import Store

CONSUMED_KINDS = (SAMPLE, SPAN)
"""Event kinds that hand (part of) a sample to the training loop."""


@dataclass(frozen=True, slots=True)
class Consumption:
    """One event that handed a sample (or a span of its tokens) to a training loop.

    Attributes:
        attempt, rank, worker, epoch, batch, position: as in the ``events`` view.
        kind: ``'sample'`` or ``'span'``.
        token_start, token_end: the span's tokens (``None`` for ``'sample'``).
        commit_id: commit whose marker names the event's segment; ``None`` for an event
            only in a journal (consumed, never committed).
        step: that commit's step (``None`` when uncommitted).
        in_lineage: the commit is in the head's lineage (the head's model saw it).
        source: the ``ledger.Mixture`` source the sample belongs to (``None`` outside
            mixtures).
    """

    attempt: int
    rank: int
    worker: int
    epoch: int
    batch: int
    position: int
    kind: str
    token_start: int | None
    token_end: int | None
    commit_id: str | None
    step: int | None
    in_lineage: bool
    source: str | None = None


@dataclass(frozen=True, slots=True)
class SampleHistory:
    """Everything the log says about one sample.

    Attributes:
        sample_id: the sample.
        source: its ``ledger.Mixture`` source (``None`` outside mixtures).
        head: the head commit the lineage is taken from (``None``: empty log).
        consumptions: every consumption, committed ones by step, attempt, rank, batch,
            then the uncommitted ones.
        commits: ids of the commits whose model saw the sample: a commit whose lineage
            holds one of its consumptions, in step order.
    """

    sample_id: int
    head: str | None
    consumptions: tuple[Consumption, ...]
    commits: tuple[str, ...]
    source: str | None = None


@parsing_once
def where(
    root: str, sample_id: int, head: str | None = None, source: str | None = None
) -> SampleHistory:
    """Every consumption of ``sample_id``, and the commits whose model saw it.

    Args:
        root: the log root.
        sample_id: the sample's id (map-style: the dataset index; streams: the row; a
            ``ledger.Mixture``: the index or row in ``source``).
        head: head commit of the lineage (default: the newest commit of the newest
            attempt).
        source: for a log of a ``ledger.Mixture``, the source the id belongs to (ids are
            per source, so the same id names one sample of each source).

    Returns:
        The sample's history.

    Raises:
        CommitNotFound: if ``root`` holds no run, or ``head`` names no commit.
        UnsupportedArgument: if the run is a mixture and ``source`` is not one of its
            sources (or not given), or the run is no mixture and ``source`` is given.
        LogCorrupted: if the commit chain is broken, or a committed segment is missing or
            differs from its marker (every segment is hashed as it is read).
    """
    store = Store(root)
    mixture_sources(store, source)
    con = connect(root, head)
    try:
        rows = _consumptions(store, con, int(sample_id), source)
        lost = con.execute(
            """
            SELECT attempt, rank, worker, epoch, batch, position, kind, token_start,
                   token_end, NULL, NULL, false, CAST(source AS VARCHAR)
            FROM uncommitted WHERE sample_id = $id AND kind IN ('sample', 'span')
                AND ($source IS NULL OR CAST(source AS VARCHAR) = $source)
            ORDER BY attempt, rank, batch, token_start NULLS FIRST
            """,
            {"id": int(sample_id), "source": source},
        ).fetchall()
        head_row = con.execute("SELECT commit_id FROM commits WHERE is_head").fetchone()
        parents = con.execute(
            "SELECT commit_id, parent FROM commits ORDER BY step, attempt"
        ).fetchall()
    finally:
        con.close()
    holding = {r[9] for r in rows}
    seen: dict[str, bool] = {}
    for cid, parent in parents:  # parents sort before children: (step, attempt) order
        seen[cid] = cid in holding or (parent is not None and seen.get(parent, False))
    return SampleHistory(
        sample_id=int(sample_id),
        head=head_row[0] if head_row else None,
        consumptions=tuple(Consumption(*r) for r in rows + lost),
        commits=tuple(cid for cid, _ in parents if seen[cid]),
        source=source,
    )


def mixture_sources(store: Store, source: str | None) -> dict[str, int | None] | None:
    """The sources of the run's ``ledger.Mixture`` (``run.json``'s, then those that later
    phases added) with their lengths (``None`` where no phase record gives one), or
    ``None`` for a run that is no mixture; checks ``source`` against them.

    Raises:
        CommitNotFound: if the root holds no run.
        LogCorrupted: if an attempt record is damaged.
        UnsupportedArgument: if the run is a mixture and ``source`` is ``None`` or not one
            of its sources, or the run is no mixture and ``source`` is given.
    """
    config = read_run(store)["config"]
    if "mixture" not in config:
        if source is not None:
            raise UnsupportedArgument(
                f"the run in {store.uri} is not a ledger.Mixture: it has no source {source!r}"
            )
        return None
    sources: dict[str, int | None] = {}
    mixtures = [config["mixture"]]
    for name in store.ls("attempts", files=True):
        if not ATTEMPT_NAME.match(name):
            continue  # a stray file, as the attempts view ignores it
        try:
            phase = read_attempt(store, name).get("phase")
        except FileNotFoundError:
            continue  # removed since the listing
        if phase is not None and "mixture" in phase.get("config", {}):
            mixtures.append(phase["config"]["mixture"])
    for mix in mixtures:
        for entry in mix.get("sources", []):
            sources.setdefault(str(entry["name"]), entry.get("len"))
    if source not in sources:
        names = ", ".join(repr(n) for n in sources)
        raise UnsupportedArgument(
            f"the run in {store.uri} is a ledger.Mixture of {names}: sample ids are per "
            + ("source; name one" if source is None else f"source, and {source!r} is not one")
        )
    return sources


_WHERE_COLUMNS = [
    "attempt", "rank", "worker", "epoch", "batch", "position", "kind", "token_start",
    "token_end", "sample_id", "source",
]  # fmt: skip


def _consumptions(
    store: Store, con: Any, sample_id: int, source: str | None
) -> list[tuple[Any, ...]]:
    """Committed consumptions of ``sample_id`` (of ``source``, in a mixture), as
    :class:`Consumption` fields, read from every segment a marker names, each checked
    against its marker's SHA-256 as it is read.
    """
    named = con.execute(
        """
        SELECT s.commit_id, s.step, c.in_lineage, s.rank, s.path, s.rows, s.bytes, s.sha256
        FROM segments AS s JOIN commits AS c USING (commit_id)
        """
    ).fetchall()
    refs = [SegmentRef(r, p, n, b, h) for *_, r, p, n, b, h in named]
    found: list[tuple[Any, ...]] = []
    tables = read_verified(store, refs, _WHERE_COLUMNS, None, match=("sample_id", sample_id))
    for (cid, step, in_lineage, *_), hit in zip(named, tables, strict=True):
        if hit.num_rows == 0:
            continue
        kinds = hit["kind"].cast(pa.string())
        keep = pc.is_in(kinds, pa.array(CONSUMED_KINDS))
        sources = hit["source"].cast(pa.string())
        if source is not None:
            keep = pc.and_(keep, pc.equal(sources, source))
        hit = hit.set_column(hit.schema.get_field_index("kind"), "kind", kinds)
        hit = hit.set_column(hit.schema.get_field_index("source"), "source", sources)
        hit = hit.filter(keep)
        for row in hit.drop_columns(["sample_id"]).to_pylist():
            *fields, name = row.values()
            found.append((*fields, cid, step, in_lineage, name))
    # Order: step, attempt, rank, batch, then a packed sample's spans by their first token.
    found.sort(key=lambda r: (r[10], r[0], r[1], r[4], -1 if r[7] is None else r[7]))
    return found


def skip_reason(value: str | None) -> str:
    """The reason in a ``rollback`` event's ``value`` (JSON ``{"reason": ...}``)."""
    try:
        return str(json.loads(value or "{}").get("reason", ""))
    except (ValueError, AttributeError):
        return str(value)


@dataclass(frozen=True, slots=True)
class BatchRecord:
    """One batch of one rank in the lineage, as logged.

    Attributes:
        rank: the rank.
        batch: its batch index.
        epoch: the batch's epoch.
        worker: the worker that produced it (``-1``: main process).
        commit_id: the commit whose segment holds it.
        events: its ``'sample'``/``'span'`` events, in batch order, with the columns of
            :data:`ledger.schema.EVENT_SCHEMA`.
        digest: the content digest recorded when the training loop received the batch
            (``None`` if the loader ran with ``digest=False``).
        errors: its ``'error'`` events: samples left out because loading them raised
            (``on_error="skip"``), with the exception as JSON in ``value``; by position.
        skip_reason: the reason the batch was skipped on purpose
            (:meth:`ledger.DataLoader.skip`), or ``None``. A skipped batch has no
            ``events``: the model never saw it.
    """

    rank: int
    batch: int
    epoch: int
    worker: int
    commit_id: str
    events: pa.Table
    digest: str | None
    errors: pa.Table | None = None
    skip_reason: str | None = None

    @property
    def sample_ids(self) -> np.ndarray:
        """``int64 (rows,)``: the sample of each event (a packed sample once per span)."""
        return np.asarray(self.events.column("sample_id").to_numpy(), np.int64)


def _chain(store: Store, head: str | None) -> list[Commit]:
    commits = list_commits(store)
    if head is None:
        newest = default_head(commits)
        if newest is None:
            return []
        head = newest.id
    return lineage(store, head, known={c.id: c for c in commits})


@parsing_once
def show(root: str, batch: int, rank: int = 0, head: str | None = None) -> BatchRecord:
    """The samples of batch ``batch`` of ``rank`` in the lineage of ``head``.

    Args:
        root: the log root.
        batch: the per-rank batch index (the training step when one batch is one step).
        rank: the rank.
        head: head commit (default: the newest commit of the newest attempt).

    Returns:
        The batch as logged.

    Raises:
        CommitNotFound: if the root holds no run, ``head`` names no commit, or the
            lineage holds no batch ``batch`` of ``rank`` (not reached, or not committed).
        LogCorrupted: if the segment holding it is missing or altered.
    """
    store = Store(root)
    read_run(store)
    for commit in _chain(store, head):
        for ref in commit.segments:
            if ref.rank != rank or ref.rows == 0:
                continue
            found = segments.open_events(store, ref.path, rows=ref.rows, checksum=ref.sha256)
            if isinstance(found, pq.ParquetFile):
                col = EVENT_SCHEMA.get_field_index("batch")
                stats = [
                    found.metadata.row_group(i).column(col).statistics
                    for i in range(found.num_row_groups)
                ]
                if not any(s is None or s.min <= batch <= s.max for s in stats):
                    continue
                found = found.read()
            table = found.filter(pc.equal(found["batch"], batch))
            kinds = table["kind"].cast(pa.string())
            events = table.filter(pc.is_in(kinds, pa.array(CONSUMED_KINDS)))
            errors = table.filter(pc.equal(kinds, ERROR)).sort_by("position")
            skipped = table.filter(pc.equal(kinds, ROLLBACK))
            first = events if events.num_rows else errors if errors.num_rows else skipped
            if first.num_rows == 0:
                continue
            digests = _digests(table.filter(pc.equal(kinds, BATCH)))
            return BatchRecord(
                rank=rank,
                batch=batch,
                epoch=int(first["epoch"][0].as_py()),
                worker=int(first["worker"][0].as_py()),
                commit_id=commit.id,
                events=events,
                digest=digests[0] if digests else None,
                errors=errors if errors.num_rows else None,
                skip_reason=skip_reason(skipped["value"][0].as_py()) if skipped.num_rows else None,
            )
    raise CommitNotFound(
        f"the lineage of {head or 'the default head'} in {store.uri} holds no batch {batch} "
        f"of rank {rank}: it was not reached, or not committed"
    )


def _digests(rows: pa.Table) -> list[str]:
    """Hex digests of ``batch`` rows: the ``digest`` column, or in logs written before
    it existed, ``value``."""
    if "digest" in rows.column_names:
        found = [d.hex() for d in rows["digest"].to_pylist() if d is not None]
        if found:
            return found
    return [v for v in rows["value"].to_pylist() if v is not None]


RECONSTRUCT_SCHEMA = pa.schema(
    [pa.field("ordinal", pa.int64(), nullable=False)]
    + [f for f in EVENT_SCHEMA if f.name != "kind"]
    + [
        pa.field("kind", pa.string(), nullable=False),
        pa.field("commit_id", pa.string(), nullable=False),
        pa.field("step", pa.int64(), nullable=False),
    ]
)
"""Columns of :func:`reconstruct`'s output: ``ordinal`` (0, 1, ...: the order in which
the training loop received the events), the event columns, and the commit holding each."""


@parsing_once
def reconstruct(
    root: str,
    commit: str,
    out: str | Path,
    progress: Callable[[int, int], None] | None = None,
) -> int:
    """Write exactly what the model at ``commit`` saw, in order, to a Parquet file.

    The rows are the ``'sample'`` and ``'span'`` events of the commit's lineage (for a
    packed stream, one row per span: which tokens of which sample), ordered by the
    training step (``batch``), then rank, then their order in the batch. Each segment's
    checksum is verified before it is used. The file is written beside ``out`` under a
    temporary name and renamed into place: on an error an existing ``out`` is unchanged.

    Args:
        root: the log root.
        commit: the commit id (``"000000000042-0001"``).
        out: the Parquet file to write (overwritten).
        progress: called with ``(commits done, commits in all)``.

    Returns:
        The number of rows written.

    Raises:
        CommitNotFound: if the root holds no run or ``commit`` is not in it.
        LogCorrupted: if a segment of the lineage is missing or altered.
    """
    store = Store(root)
    read_run(store)
    chain = _chain(store, commit)
    with output_file(out) as tmp:
        return _write_lineage(store, chain, tmp, progress)


@contextmanager
def output_file(out: str | os.PathLike[str]) -> Iterator[Path]:
    """A temporary path beside ``out``, renamed to ``out`` when the block succeeds and
    removed when it raises: a failed write leaves an existing ``out`` unchanged."""
    path = Path(out)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _write_lineage(
    store: Store,
    chain: list[Commit],
    out: Path,
    progress: Callable[[int, int], None] | None,
) -> int:
    total = 0
    with pq.ParquetWriter(str(out), RECONSTRUCT_SCHEMA, compression="zstd") as writer:
        for done, c in enumerate(chain, 1):
            parts = []
            for ref in sorted(c.segments, key=lambda s: s.rank):
                t = segments.read(store, ref.path, rows=ref.rows, checksum=ref.sha256)
                kinds = t["kind"].cast(pa.string())
                t = t.filter(pc.is_in(kinds, pa.array(CONSUMED_KINDS)))
                parts.append(
                    t.set_column(
                        t.schema.get_field_index("kind"), "kind", t["kind"].cast(pa.string())
                    )
                )
            if parts:
                table = pa.concat_tables(parts)
                # Arrow's sort is stable: rows of a batch keep their order.
                table = table.take(
                    pc.sort_indices(table, [("batch", "ascending"), ("rank", "ascending")])
                )
                n = table.num_rows
                table = (
                    table.append_column("commit_id", pa.array([c.id] * n, pa.string()))
                    .append_column("step", pa.array(np.full(n, c.step, np.int64)))
                    .add_column(0, "ordinal", pa.array(np.arange(total, total + n, dtype=np.int64)))
                )
                writer.write_table(table.select(RECONSTRUCT_SCHEMA.names).cast(RECONSTRUCT_SCHEMA))
                total += n
            if progress is not None:
                progress(done, len(chain))
    return total


@dataclass(frozen=True, slots=True)
class Materialized:
    """A batch re-created from the dataset with the recorded seeds.

    Attributes:
        record: the batch as logged.
        data: the re-created batch (what the collate function returned).
        digest: its content digest.
        matches: ``digest == record.digest`` (``False`` when no digest was recorded).
    """

    record: BatchRecord
    data: Any
    digest: str
    matches: bool


@parsing_once
def _check_dataset_kind(store: Store, config: dict[str, Any], dataset: Any) -> None:
    """Refuse a dataset that is not of the run's kind, before re-creating a batch with it:
    a map-style dataset for a stream's run, a Stream for a map-style run, or a Stream
    whose source, shuffle buffer or packer differ from the run's (``run.json``), which
    would fail deep in a collate function or give another batch.

    Raises:
        UnsupportedArgument: for the other kind.
        ConfigMismatch: naming the Stream's first differing field.
    """
    from ledger.mixture import Mixture
    from ledger.stream.spec import Stream

    if isinstance(dataset, Mixture) or "mixture" in config:
        return  # a mixture's sources are checked by name as its batch is re-created
    streamed = "source" in config  # a stream's run records its shards' fingerprints
    if isinstance(dataset, Stream) != streamed:
        given = "a ledger.stream.Stream" if isinstance(dataset, Stream) else "a map-style dataset"
        ran = "a ledger.stream.Stream" if streamed else "a map-style dataset"
        raise UnsupportedArgument(
            f"the run in {store.uri} read {ran}, and {given} was given: pass the dataset "
            "the run trained on"
        )
    if not streamed:
        return
    mine = dataset.config()
    for field in ("shuffle_buffer", "packer"):
        if mine[field] != config.get(field):
            raise ConfigMismatch(
                field, config.get(field), mine[field],
                f"The run's Stream had {field}={config.get(field)!r}: pass the Stream the "
                "run trained on.",
            )  # fmt: skip
    dataset.source.check(config.get("source", []))


def materialize(
    root: str,
    batch: int,
    dataset: Any,
    *,
    rank: int = 0,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    head: str | None = None,
) -> Materialized:
    """Re-create a logged batch through the dataset, with the run's seeds.

    Map-style datasets and mixtures: the logged ids fetched as the loader fetched them
    (:func:`ledger.fetch.load_batch` with the run's RNG mode: seeded once per batch from
    ``(seed, epoch, first position)``, or per sample from ``(seed, epoch, i)``), then
    ``collate_fn``. Streams (:class:`ledger.stream.Stream`): each sample re-read
    from its shard and transformed with its seed; packed streams re-pack the logged
    token spans into sequences. Mixtures of streams: likewise, each sample with its
    source's seed and the source epoch its event records (``source_epoch``). The global
    RNG states are restored afterwards.

    Args:
        root: the log root.
        batch: the per-rank batch index.
        dataset: the run's dataset (map-style or a Stream), built as for training.
        rank: the rank.
        collate_fn: the run's collate function (default: torch's ``default_collate``).
        head: head commit (default: the newest commit of the newest attempt).

    Returns:
        The re-created batch and whether its digest equals the recorded one.

    Raises:
        CommitNotFound: if the lineage holds no such batch.
        BatchSkipped: if the batch was skipped on purpose (the model never saw it).
        LedgerError: if the dataset's length differs from the run's, or a mixture of
            streams' log predates the ``source_epoch`` column.
        UnsupportedArgument: if the run read a Stream and ``dataset`` is not one, or the
            other way round.
        ConfigMismatch: if the Stream's source, shuffle buffer or packer differs from the
            run's (named).
        SourceMissing: if the batch holds a sample of a mixture source the given mixture
            does not have (a later phase removed it).
    """
    import torch.utils.data as tud

    from ledger.digest import batch_digest
    from ledger.fetch import load_batch, rng_of
    from ledger.mixture import Mixture
    from ledger.stream.mixer import rebuild_mixed_batch
    from ledger.stream.sample import rebuild_batch
    from ledger.stream.spec import Stream

    record = show(root, batch, rank, head)
    store = Store(root)
    config = read_run(store)["config"]
    collate = collate_fn or tud.default_collate
    seed = int(validate.require(config, "seed", int, f"{store.full('run.json')}, config"))
    rng = rng_of(config)
    if record.skip_reason is not None:
        raise BatchSkipped(
            f"batch {batch} of rank {rank} was skipped ({record.skip_reason}): the model "
            "never saw it, there is nothing to re-create"
        )
    _check_dataset_kind(store, config, dataset)
    if isinstance(dataset, Mixture) and dataset.streams:
        data = rebuild_mixed_batch(
            dataset, seed, record.events, rng == "sample", collate, seed_maps=rng != "off"
        )
    elif isinstance(dataset, Stream):
        data = rebuild_batch(dataset, seed, record.epoch, record.events, rng == "sample", collate)
    else:
        if len(dataset) != config["dataset_len"]:
            raise LedgerError(
                f"the dataset has {len(dataset)} samples, the run's had "
                f"{config['dataset_len']}: pass the dataset the run trained on"
            )
        # The batch as requested: with the samples that failed to load, which are tried
        # again (their draws came before their batch-mates').
        columns = ["position", "sample_id"] + (["source"] if isinstance(dataset, Mixture) else [])
        asked = record.events.select(columns)
        if record.errors is not None:
            asked = pa.concat_tables([asked, record.errors.select(columns)]).sort_by("position")
        ids = np.asarray(asked["sample_id"].to_numpy(), np.int64)
        if isinstance(dataset, Mixture):  # the log holds ids in their sources
            names = asked["source"].cast(pa.string()).to_pylist()
            ids = dataset.join(names, ids)
            if (ids < 0).any():
                name = names[int(np.flatnonzero(ids < 0)[0])]
                raise SourceMissing(
                    "mixture source",
                    name,
                    None,
                    f"Batch {batch} holds samples of source {name!r}, which this mixture "
                    f"({', '.join(dataset.names)}) does not have: pass the mixture of the "
                    "phase that served the batch.",
                )
        _, _, data = load_batch(
            dataset,
            ids,
            seed=seed,
            epoch=record.epoch,
            position=int(asked["position"][0].as_py()),
            rng=rng,
            main_process=True,
            skip_errors=record.errors is not None,
            collate=collate,
        )
    digest = batch_digest(data)
    return Materialized(record, data, digest, digest == record.digest)
