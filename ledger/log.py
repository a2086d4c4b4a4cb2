"""Ledger: one rank's view of a run's log (append, commit, open, claim an attempt)."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from ledger.commits import (
    Commit,
    PipelineState,
    SegmentRef,
    claim_attempt,
    commit_id,
    now_iso,
    open_run,
    read_commit,
    write_commit,
)
from ledger.dist import Group
from ledger.errors import CommitConflict, LedgerError, StorageError
from ledger.journal import Journal, journal_path
from ledger.schema import EventChunk, chunks_to_table
from ledger.segments import SegmentBuilder, encode, segment_path
from ledger.store import Store, sha256


class Ledger:
    """The log of one rank of a run, under one root URI.

    Events are appended a batch at a time (to memory and to the journal) and become an
    immutable Parquet segment plus a commit marker at :meth:`commit`.

    Args:
        root: log root: a local path. An fsspec URI (``s3://bucket/prefix``) is parsed,
            but commits to object stores raise ``StorageError`` until exclusive creates
            are built there.
        rank: this process's rank (0 without distributed).
        world_size: number of ranks.
        storage_options: fsspec options (credentials, endpoint) for a remote root.
        journal_dir: local directory for the journal; default: ``ROOT/journal`` for a
            local root, a temporary directory otherwise.
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
        group: Any = None,
    ) -> None:
        self.store = Store(os.fspath(root), storage_options)
        self.rank = rank
        self.world_size = world_size
        self.group = Group(rank, world_size, group)
        self._journal_dir = journal_dir
        self.run_id: str | None = None
        self._config: dict[str, Any] = {}
        self.attempt: int | None = None
        self.head: Commit | None = None  # the latest commit of this lineage
        self._pending: list[EventChunk] = []
        self._builder: SegmentBuilder | None = None
        self._journal: Journal | None = None

    @property
    def root(self) -> str:
        """The normalised root URI (absolute path for local roots)."""
        return self.store.uri

    def open(self, config: dict[str, Any]) -> str:
        """Create or check ``run.json``; returns the run id.

        Raises:
            ConfigMismatch: if the root holds a run with another configuration.
        """
        if self.run_id is None or config != self._config:
            self.run_id = open_run(self.store, config)
            self._config = dict(config)
        return self.run_id

    def start(self, parent: Commit | None) -> int:
        """Start a new attempt resuming from ``parent`` (``None``: from the beginning).

        Discards events appended and not committed by a previous attempt of this object.

        Returns:
            The new attempt number.
        """
        if self.run_id is None:
            raise LedgerError("Ledger.open(config) must be called before Ledger.start()")
        if self.rank == 0:
            attempt = claim_attempt(self.store, parent.id if parent else None, self.world_size)
        self.attempt = int(self.group.broadcast(attempt if self.rank == 0 else None))
        self.head = parent
        self._pending = []
        self._builder = SegmentBuilder(self.attempt, self.rank)
        if self._journal is not None:
            self._journal.close()
        self._journal = Journal(self._journal_file(), self.attempt, self.rank)
        self._journal.reset(parent.id if parent else None)
        return self.attempt

    def _journal_file(self) -> str:
        rel = journal_path(self.attempt or 0, self.rank)
        if self._journal_dir is not None:
            return os.path.join(self._journal_dir, self.store.path.strip("/"), rel)
        local = self.store.local_path(rel)
        if local is not None:
            return local
        return os.path.join(tempfile.gettempdir(), "ledger-journal", self.store.path, rel)

    def append(self, *chunks: EventChunk) -> None:
        """Record one batch's events: in memory until commit, and in the journal (one
        ``write(2)`` for all of ``chunks``)."""
        assert self._journal is not None, "Ledger.start() was not called"
        self._pending.extend(chunks)
        if self._builder is not None:
            for chunk in chunks:
                self._builder.add(chunk)
        self._journal.append(*chunks)

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
            StorageError: if a write fails. The pending events are kept and the next
                commit writes them; a segment written before the failure stays as an
                orphan (no marker names it; a retry at the same step overwrites it).
            CommitConflict: if another writer created the same marker first.

        Note:
            A crash after the segment and before the marker leaves an orphan segment,
            which replay ignores and audits can report.
        """
        if self.attempt is None:
            raise LedgerError("Ledger.start() must be called before Ledger.commit()")
        if not self.group.coordinated:
            if not self._pending and self.head is not None and self.head.step == state.batch:
                return self.head
            segments = self._write_segment(state.batch, snapshot)
            commit = self._marker(state.batch, segments, (state,))
            write_commit(self.store, commit)
            return self._committed(commit)
        return self._commit_collective(state, snapshot)

    def _commit_collective(self, state: PipelineState, snapshot: Sequence[EventChunk]) -> Commit:
        """Every rank writes its segment; rank 0 writes the marker once all exist."""
        mine: dict[str, Any] = {"state": asdict(state), "new": bool(self._pending), "error": None}
        try:
            refs = self._write_segment(state.batch, snapshot)
            mine["segment"] = asdict(refs[0]) if refs else None
        except LedgerError as e:  # the others must still take part in the collective
            mine["error"] = f"rank {self.rank}: {e}"
        everyone = self.group.all_gather(mine)
        decision: dict[str, Any] = {}
        if self.rank == 0:
            errors = [m["error"] for m in everyone if m["error"]]
            step = everyone[0]["state"]["batch"]
            if errors:
                decision = {"error": "; ".join(errors)}
            elif (
                not any(m["new"] for m in everyone)
                and self.head is not None
                and self.head.step == step
            ):
                decision = {"commit": None}
            else:
                commit = self._marker(
                    step,
                    tuple(SegmentRef(**m["segment"]) for m in everyone if m["segment"]),
                    tuple(PipelineState.from_dict(m["state"]) for m in everyone),
                )
                try:
                    write_commit(self.store, commit)
                    decision = {"commit": json.loads(commit.to_json())}
                except LedgerError as e:
                    decision = {"error": f"rank 0: {e}", "kind": type(e).__name__}
        decision = self.group.broadcast(decision)
        if decision.get("error"):
            cls = CommitConflict if decision.get("kind") == "CommitConflict" else StorageError
            raise cls(f"the commit failed, no marker was written: {decision['error']}")
        if decision["commit"] is None:
            assert self.head is not None
            return self.head
        return self._committed(Commit.from_dict(decision["commit"]))

    def _write_segment(self, step: int, snapshot: Sequence[EventChunk]) -> tuple[SegmentRef, ...]:
        """Encode and write this rank's pending events (plus ``snapshot``) as a segment."""
        if not self._pending:
            return ()
        assert self.attempt is not None
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
        rel = segment_path(self.attempt, self.rank, step)
        self.store.write_atomic(rel, data)
        rows = sum(c.rows for c in chunks)
        return (SegmentRef(self.rank, rel, rows, len(data), sha256(data)),)

    def _marker(
        self, step: int, segments: tuple[SegmentRef, ...], states: tuple[PipelineState, ...]
    ) -> Commit:
        assert self.attempt is not None
        return Commit(
            id=commit_id(step, self.attempt),
            step=step,
            attempt=self.attempt,
            parent=self.head.id if self.head else None,
            world_size=self.world_size,
            created_at=now_iso(),
            segments=segments,
            states=states,
        )

    def _committed(self, commit: Commit) -> Commit:
        assert self.attempt is not None and self._journal is not None
        self.head = commit
        self._pending = []
        self._builder = SegmentBuilder(self.attempt, self.rank)
        self._journal.reset(commit.id)
        return commit

    def read_commit(self, cid: str) -> Commit:
        """Read a commit marker of this root (see :func:`ledger.commits.read_commit`)."""
        return read_commit(self.store, cid)

    def close(self) -> None:
        """Close the journal file (pending events stay in it)."""
        if self._journal is not None:
            self._journal.close()
            self._journal = None
