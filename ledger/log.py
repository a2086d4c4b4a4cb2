"""Ledger: one rank's view of a run's log (append, commit, open, claim an attempt)."""

from __future__ import annotations

import glob
import logging
import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ledger.commits import (
    Commit,
    PipelineState,
    SegmentRef,
    claim_attempt,
    commit_id,
    marker_landed,
    new_commit,
    newest_segments,
    now_iso,
    open_run,
    read_commit,
    run_digest,
    write_commit,
)
from ledger.dist import Group
from ledger.errors import CommitConflict, LedgerError, StorageError
from ledger.journal import Journal, JournalOrder, journal_path, read_journal
from ledger.ranks import FAILED, NEWS, NO_NEWS, final_batch_of, from_rows, pack
from ledger.schema import ERROR, ROLLBACK, SAMPLE, EventChunk, chunks_to_table
from ledger.segments import SegmentBuilder, encode, segment_path
from ledger.store import Store, sha256

logger = logging.getLogger("ledger")


def default_journal_dir() -> str:
    """Local directory for the journals of remote roots: ``$LEDGER_JOURNAL_DIR``, else
    ``$XDG_CACHE_HOME/ledger/journal`` (``~/.cache/ledger/journal``)."""
    configured = os.environ.get("LEDGER_JOURNAL_DIR")
    if configured:
        return configured
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "ledger", "journal")


@dataclass(slots=True)
class _Inflight:
    """A commit that was tried and failed, kept so that the next try repeats it exactly.

    Retried unchanged (same segment bytes, same marker bytes) while nothing was appended
    since; once the training loop has moved on, the marker is looked up: if it landed
    after all (a lost reply), it becomes the head and the events it holds leave the
    pending list, otherwise the next commit writes everything afresh.

    Attributes:
        step: the commit's step.
        covered: entries of the pending list it holds.
        state: this rank's state at the commit.
        data: this rank's segment (Parquet bytes), ``None`` without events.
        ref: the segment's reference, ``None`` without events.
        marker: the marker tried (rank 0), ``None`` if the try failed before it.
        rows: the gathered rows the marker was built from (rank 0).
        final: the fingerprint of the segment's final batch
            (:func:`ledger.ranks.final_batch_of`), ``None`` if it has none.
    """

    step: int
    covered: int
    state: PipelineState
    data: bytes | None
    ref: SegmentRef | None
    marker: Commit | None = None
    rows: np.ndarray | None = None
    final: int | None = None


class Ledger:
    """The log of one rank of a run, under one root URI.

    Events are appended a batch at a time (to memory and to the journal) and become an
    immutable Parquet segment plus a commit marker at :meth:`commit`.

    Args:
        root: log root: a local path or an object-store URI (``s3://bucket/prefix``;
            the commit protocol there is described in ``docs/object-storage.md``).
        rank: this process's rank (0 without distributed).
        world_size: number of ranks.
        storage_options: fsspec options (credentials, endpoint, retries) for a remote
            root; see :func:`ledger.store.remote_options` for ledger's defaults.
        journal_dir: local directory for the journal (its files go to
            ``journal_dir/<root>/journal/attempt=A/rank=R.msgpack``); default:
            ``ROOT/journal`` for a local root, :func:`default_journal_dir` for a remote
            one, so appends stay local writes. A remote root's journals are uploaded to
            ``ROOT/journal/`` by the next attempt of the same rank started on the same
            host (crash forensics: what a killed process consumed after its last commit).
        exclusive: how markers and attempt records are created exclusively on an object
            store (:class:`ledger.store.Store`); default ``$LEDGER_EXCLUSIVE`` or
            ``"auto"``.
        group: ``torch.distributed`` process group of the ranks sharing the log
            (default: the world group). With ``world_size > 1`` every rank must call
            :meth:`start` and :meth:`commit` together: they are collective.

    Raises:
        RuntimeError: if ``world_size > 1`` and torch.distributed is not initialised.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        rank: int = 0,
        world_size: int = 1,
        storage_options: dict[str, Any] | None = None,
        journal_dir: str | None = None,
        exclusive: str | None = None,
        group: Any = None,
    ) -> None:
        self.store = Store(os.fspath(root), storage_options, exclusive=exclusive)
        self.rank = rank
        self.world_size = world_size
        self.group = Group(rank, world_size, group)
        self._journal_dir = journal_dir
        self.run_id: str | None = None
        self._config: dict[str, Any] = {}
        self.phase: dict[str, Any] | None = None  # the phase of the attempt (None: the first)
        # Ranges of batches to skip when reached, written in each commit's marker.
        self.planned_skips: tuple[tuple[int, int, str], ...] = ()
        self.attempt: int | None = None
        self.head: Commit | None = None  # the latest commit of this lineage
        self._pending: list[EventChunk] = []
        self._builder: SegmentBuilder | None = None
        self._journal: Journal | None = None
        self._journal_failed = False  # the last journal write failed (warned once)
        self._inflight: _Inflight | None = None

    @property
    def root(self) -> str:
        """The normalised root URI (absolute path for local roots)."""
        return self.store.uri

    def open(self, config: dict[str, Any], run: dict[str, Any] | None = None) -> str:
        """Create or check ``run.json``; returns the run id.

        Args:
            config: the loader's configuration.
            run: ``run.json`` as the caller just read it (:func:`ledger.commits.read_run`),
                checked instead of reading it again; ``None``: read or create it here.

        Raises:
            ConfigMismatch: if the root holds a run with another configuration.
        """
        if self.run_id is None or config != self._config:
            phase_config = self.phase["config"] if self.phase is not None else None
            self.run_id = open_run(self.store, config, phase_config, run)
            self._config = dict(config)
        return self.run_id

    def enter_phase(self, phase: dict[str, Any] | None) -> None:
        """Serve ``phase`` (an attempt record's ``phase``; ``None``: the run's first): the
        next :meth:`open` checks the configuration against the phase's, and the next
        :meth:`start` records the phase in its attempt record."""
        self.phase = phase
        self._config = {}

    def start(self, parent: Commit | None, order: JournalOrder | None = None) -> int:
        """Start a new attempt resuming from ``parent`` (``None``: from the beginning).

        Discards events appended and not committed by a previous attempt of this object.
        ``order``: a map-style run's order, named in the journal's header so that its
        records give a batch's ids as a count (:class:`ledger.journal.JournalOrder`).

        Returns:
            The new attempt number.
        """
        if self.run_id is None:
            raise LedgerError("Ledger.open(config) must be called before Ledger.start()")
        if self.rank == 0:
            attempt = claim_attempt(
                self.store,
                parent.id if parent else None,
                self.world_size,
                self.phase,
                run_digest(self.store),
            )
        self.attempt = int(self.group.broadcast(attempt if self.rank == 0 else None))
        self.head = parent
        self._pending = []
        self._inflight = None
        self._builder = SegmentBuilder(self.attempt, self.rank)
        if self._journal is not None:
            self._journal.close()
        self._upload_journals()
        path = self._journal_file(self.attempt)
        try:
            self._journal = Journal(path, self.attempt, self.rank, order)
        except OSError as e:
            raise StorageError(f"could not open the journal {path}: {e}") from e
        self._journal.reset(parent.id if parent else None)
        return self.attempt

    def _journal_file(self, attempt: int) -> str:
        rel = journal_path(attempt, self.rank)
        base = self._journal_dir
        local = self.store.local_path(rel)
        if base is None and local is not None:
            return local
        where = self.store.path.strip("/")
        if not self.store.is_local:
            where = f"{self.store.protocol}/{where}"
        return os.path.join(base or default_journal_dir(), where, rel)

    def _upload_journals(self) -> None:
        """Upload this rank's journals of earlier attempts from local disk to a remote root.

        A journal holding batches past its last commit (a killed process's) is PUT to
        ``ROOT/journal/attempt=A/rank=R.msgpack``, where audits read it; then, like one
        holding nothing, it is removed from local disk. A failed upload leaves the local
        file for the next start and warns.
        """
        if self.store.is_local:
            return
        current = self._journal_file(self.attempt or 0)
        journals = os.path.dirname(os.path.dirname(current))
        pattern = os.path.join(glob.escape(journals), "attempt=*", os.path.basename(current))
        for path in sorted(glob.glob(pattern)):
            if path == current:
                continue
            try:
                with open(path, "rb") as f:
                    data = f.read()
                header, chunks = read_journal(data)
                if chunks:
                    rel = journal_path(int(str(header["attempt"])), self.rank)
                    self.store.write_atomic(rel, data)
                os.unlink(path)
            except (OSError, ValueError, LedgerError) as e:
                warnings.warn(
                    f"the journal {path} was not uploaded to {self.store.uri}: {e}; it stays "
                    "on local disk and the next attempt tries again",
                    stacklevel=3,
                )

    def append(self, *chunks: EventChunk) -> None:
        """Record one batch's events: in memory until commit, and in the journal (one
        ``write(2)`` for all of ``chunks``). A journal that cannot be written (a full local
        disk) costs a warning, not the batch: commits do not read it."""
        assert self._journal is not None, "Ledger.start() was not called"
        try:
            self._journal.append(*chunks)
        except StorageError as e:
            # The journal is for forensics after a crash; commits do not read it. A full
            # local disk must not stop a batch that its commit (perhaps on object storage)
            # can still record.
            self._journal_trouble(e)
        else:
            self._journal_failed = False
        self._pending.extend(chunks)
        if self._builder is not None:
            for chunk in chunks:
                self._builder.add(chunk)

    def _journal_trouble(self, e: StorageError) -> None:
        """Warn (once until the journal is written again) that a journal write failed."""
        if self._journal_failed:
            return
        self._journal_failed = True
        message = (
            f"{e}: the batches since the last commit are recorded in memory and committed "
            "as usual, but a crash before the next commit would leave some of them out of "
            "the journal"
        )
        logger.warning("%s", message)
        warnings.warn(message, RuntimeWarning, stacklevel=4)

    def commit(self, state: PipelineState, snapshot: Sequence[EventChunk] = ()) -> Commit:
        """Write the pending events as a segment and create the commit marker.

        Idempotent: with no events since the last commit of the same step, returns it.

        Args:
            state: this rank's pipeline state after the last appended event.
            snapshot: events describing the state at the commit (shuffle buffers'
                contents), written at the end of the segment and not journaled.

        Returns:
            The new (or unchanged) head commit.

        Raises:
            StorageError: if a write fails (after the store's retries). The pending
                events are kept, nothing is lost or duplicated: a retry with no batch
                appended since repeats the same PUTs byte for byte (the segment under the
                same name, the same marker, which succeeds if the first try landed and
                only its reply was lost); once batches were appended, the next commit
                first looks for the failed marker, adopts it as the head if it landed,
                and writes the remaining events (else all of them) at the new step.
            CommitConflict: if another writer created the same marker first.

        Note:
            A failure or crash after the segment PUT and before the marker leaves an
            orphan segment (no marker names it), which replay ignores and audits can
            report; a retry at the same step overwrites it with the same bytes.
        """
        if self.attempt is None:
            raise LedgerError("Ledger.start() must be called before Ledger.commit()")
        if self._inflight is not None:
            self._resolve_inflight(state)
        if self.group.coordinated:
            return self._commit_collective(state, snapshot)
        if not self._pending and self.head is not None and self._unchanged(state.batch):
            return self.head
        inflight = self._inflight or self._prepare(state, snapshot)
        self._inflight = inflight
        self._put_segment(inflight)
        if inflight.marker is None:
            row = pack(state, inflight.ref, NEWS, inflight.final)
            inflight.marker = self._marker(state.batch, row[None, :])
        write_commit(self.store, inflight.marker)
        return self._committed(inflight.marker)

    def _resolve_inflight(self, state: PipelineState) -> None:
        """Decide what becomes of the failed commit in :attr:`_inflight` (collective).

        Nothing appended since, same state: keep it, the commit repeats it byte for byte.
        Otherwise rank 0 looks for its marker: if it landed, it becomes the head and its
        events leave the pending list; if not, it is dropped (its segment, if written,
        stays as an orphan) and the commit writes all pending events afresh.
        """
        inflight = self._inflight
        assert inflight is not None
        same = (
            inflight.step == state.batch
            and inflight.covered == len(self._pending)
            and inflight.state == state
        )
        if all(self.group.all_gather(same)):
            return
        verdict: dict[str, Any] = {"landed": None, "error": None}
        if self.rank == 0 and inflight.marker is not None:
            try:
                if marker_landed(self.store, inflight.marker):
                    verdict["landed"] = inflight.marker.header()
            except LedgerError as e:
                verdict["error"] = str(e)
        verdict = self.group.broadcast(verdict)
        if verdict["error"]:
            cid = commit_id(inflight.step, self.attempt or 0)
            raise StorageError(
                f"could not learn whether the failed commit {cid} landed: {verdict['error']}; "
                "the events stay pending, retry"
            )
        self._inflight = None
        if verdict["landed"] is not None:
            # Rank 0 keeps the whole commit (the next marker carries its table forward);
            # the others need only its id and step.
            landed = inflight.marker if self.rank == 0 else None
            self.head = landed or Commit.from_dict(verdict["landed"])
            self._pending = self._pending[inflight.covered :]

    def _commit_collective(self, state: PipelineState, snapshot: Sequence[EventChunk]) -> Commit:
        """Every rank writes its segment and sends rank 0 one integer row (its state and
        segment reference, :func:`ledger.ranks.pack`); rank 0 writes the marker once all
        exist and broadcasts only the commit's header. Ranks other than 0 thus send and
        receive O(1) bytes at any world size; rank 0's O(W) work is numpy's."""
        status, error, ref, final = (NEWS if self._pending else NO_NEWS), None, None, None
        try:
            inflight = self._inflight or self._prepare(state, snapshot)
            self._inflight = inflight
            self._put_segment(inflight)
            ref, final = inflight.ref, inflight.final
        except LedgerError as e:  # the others must still take part in the collective
            status, error = FAILED, f"rank {self.rank}: {e}"
        rows = self.group.gather_rows(pack(state, ref, status, final))
        decision = self._decide(rows) if rows is not None else {}
        decision = self.group.broadcast(decision)
        if decision.get("collect"):  # a rank failed: rank 0 learns why, then says it
            messages = self.group.gather(error)
            decision = {"error": "; ".join(m for m in messages if m)} if messages else {}
            decision = self.group.broadcast(decision)
        if decision.get("error"):
            cls = CommitConflict if decision.get("kind") == "CommitConflict" else StorageError
            raise cls(f"the commit failed: {decision['error']}; the events stay pending")
        if decision["commit"] is None:
            assert self.head is not None
            self._inflight = None
            return self.head
        if self.rank == 0:
            assert self._inflight is not None and self._inflight.marker is not None
            return self._committed(self._inflight.marker)
        return self._committed(Commit.from_dict(decision["commit"]))

    def _decide(self, rows: np.ndarray) -> dict[str, Any]:
        """Rank 0: write the marker of the gathered rows, or say why not."""
        if (rows[:, 0] == FAILED).any():
            return {"collect": True}
        step = int(rows[0, 12])  # rank 0's batch
        news = (rows[:, 0] == NEWS).any()
        if not news and self._unchanged(step):
            return {"commit": None}
        inflight = self._inflight
        assert inflight is not None
        if (
            inflight.marker is None
            or inflight.rows is None
            or not np.array_equal(inflight.rows, rows)
        ):
            inflight.marker = self._marker(step, rows)
            inflight.rows = rows
        try:
            write_commit(self.store, inflight.marker)
            return {"commit": inflight.marker.header()}
        except LedgerError as e:
            return {"error": f"rank 0: {e}", "kind": type(e).__name__}

    def _prepare(self, state: PipelineState, snapshot: Sequence[EventChunk]) -> _Inflight:
        """Encode this rank's pending events (plus ``snapshot``) as the commit's segment."""
        assert self.attempt is not None
        if not self._pending:
            return _Inflight(state.batch, 0, state, None, None)
        builder, self._builder = self._builder, None
        try:
            if builder is not None:
                for chunk in snapshot:
                    builder.add(chunk)
            data = builder.finish() if builder is not None else b""
        except Exception:  # the builder is an optimisation: re-encode from the chunks
            data = b""
        chunks = [*self._pending, *snapshot]
        if not data:
            data = encode(chunks_to_table(chunks, self.attempt, self.rank))
        rel = segment_path(self.attempt, self.rank, state.batch)
        rows = sum(c.rows for c in chunks)
        ref = SegmentRef(self.rank, rel, rows, len(data), sha256(data))
        final = final_batch_of(chunks, (SAMPLE, ERROR, ROLLBACK))
        return _Inflight(state.batch, len(self._pending), state, data, ref, final=final)

    def _put_segment(self, inflight: _Inflight) -> None:
        """PUT the segment under its final name (again, with the same bytes, on a retry)."""
        if inflight.ref is not None and inflight.data is not None:
            self.store.write_atomic(inflight.ref.path, inflight.data)

    def _unchanged(self, step: int) -> bool:
        """Whether a commit at ``step`` with no new event would repeat the head: same
        step, and the same planned skips or the same attempt (whose marker at this step
        exists already: a skip planned since waits for the next commit after a batch)."""
        head = self.head
        if head is None or head.step != step:
            return False
        return head.attempt == self.attempt or head.planned_skips == self.planned_skips

    def _marker(self, step: int, rows: np.ndarray) -> Commit:
        """The commit of ``rows`` (one per rank, :func:`ledger.ranks.pack`), carrying each
        rank's newest segment forward from the head."""
        assert self.attempt is not None
        parent: Any = None
        if self.head is not None:
            parent = self.head.ranks
            if parent is None:  # a version-1 head: its lineage names the newest segments
                parent = newest_segments(self.store, self.head, rows.shape[0])
        header = {
            "id": commit_id(step, self.attempt),
            "step": step,
            "attempt": self.attempt,
            "parent": self.head.id if self.head else None,
            "world_size": self.world_size,
            "created_at": now_iso(),
        }
        ranges = self.head.lineage_ranges if self.head is not None else None
        commit = new_commit(header, from_rows(rows, parent), ranges)
        if self.planned_skips:
            commit._extra["skips"] = self.planned_skips
        return commit

    def _committed(self, commit: Commit) -> Commit:
        assert self.attempt is not None and self._journal is not None
        self.head = commit
        self._inflight = None
        self._pending = []
        self._builder = SegmentBuilder(self.attempt, self.rank)
        try:
            self._journal.reset(commit.id)
        except StorageError as e:  # the commit stands; only the journal's header is lost
            self._journal_trouble(e)
        return commit

    def read_commit(self, cid: str) -> Commit:
        """Read a commit marker of this root (see :func:`ledger.commits.read_commit`)."""
        return read_commit(self.store, cid)

    def close(self) -> None:
        """Close the journal file (pending events stay in it)."""
        if self._journal is not None:
            self._journal.close()
            self._journal = None
