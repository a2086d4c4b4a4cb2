"""The per-rank msgpack journal: events since the last commit, one record per batch.

The journal is for forensics: after a crash it tells which batches reached the training
loop after the last commit. It is not needed for exact resume (a model that saw those
batches died with the process). Each record is written with one ``write(2)`` of a few
bytes plus the batch's sample ids as raw little-endian ``int64`` bytes, so appending costs
one syscall per batch and no Python object per sample. Records reach the OS page cache
before the batch is handed to the training loop: they survive SIGKILL, but not a power
loss (no fsync per batch). The journal is always a local file, also for an object-store
root (:func:`ledger.log.default_journal_dir`): the next attempt of the rank uploads it to
``ROOT/journal/`` if it holds uncommitted batches.

Record layout (msgpack arrays):

* header: ``["ledger-journal", version, attempt, rank, after_commit or None]``
* event: ``[kind, epoch, batch, worker, first_position, ids_bytes, extras]``; ``extras``
  is ``None`` or a map of the optional columns: ``positions``, ``token_start``,
  ``token_end``, ``length`` (raw ``int64`` bytes) and ``values`` (list of str or nil).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any, cast

import msgpack
import numpy as np

from ledger.schema import SAMPLE, SCHEMA_VERSION, SPAN, EventChunk

MAGIC = "ledger-journal"
_ARRAYS = ("positions", "token_start", "token_end", "length")


def journal_path(attempt: int, rank: int) -> str:
    """Relative path of the journal of ``rank`` in ``attempt``."""
    return f"journal/attempt={attempt}/rank={rank}.msgpack"


class Journal:
    """Append-only journal file on local disk.

    Args:
        path: OS path of the journal file (created with its directory).
        attempt: attempt number written in the header.
        rank: rank written in the header.
    """

    def __init__(self, path: str, attempt: int, rank: int) -> None:
        self.path = path
        self.attempt = attempt
        self.rank = rank
        os.makedirs(os.path.dirname(path), exist_ok=True)
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._pack = msgpack.Packer(use_bin_type=True).pack
        self.reset(None)

    def append(self, *chunks: EventChunk) -> None:
        """Append one batch's events, one record per chunk, in one ``write(2)``."""
        os.write(self._fd, b"".join(self._record(chunk) for chunk in chunks))

    def _record(self, chunk: EventChunk) -> bytes:
        ids = np.ascontiguousarray(chunk.sample_ids, dtype="<i8")
        extras: dict[str, Any] | None = None
        if chunk.positions is not None or chunk.token_start is not None or chunk.values:
            extras = {
                name: np.ascontiguousarray(arr, dtype="<i8").data
                for name in _ARRAYS
                if (arr := getattr(chunk, name)) is not None
            }
            extras["values"] = chunk.values
        record = [chunk.kind, chunk.epoch, chunk.batch, chunk.worker, chunk.position, ids.data]
        return cast(bytes, self._pack([*record, extras]))

    def reset(self, after_commit: str | None) -> None:
        """Empty the journal after a commit; the header names that commit."""
        os.ftruncate(self._fd, 0)
        os.write(
            self._fd, self._pack([MAGIC, SCHEMA_VERSION, self.attempt, self.rank, after_commit])
        )

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def read_journal(data: bytes) -> tuple[dict[str, object], list[EventChunk]]:
    """Parse a journal tolerantly: a torn final record (crash mid-write) is dropped.

    Args:
        data: the journal file's bytes.

    Returns:
        ``(header, chunks)``; header keys: ``version, attempt, rank, after_commit``.
        Chunks whose batch was already committed (a crash between the commit marker and
        the journal reset) are still returned; compare ``batch`` with the commit's state.

    Raises:
        ValueError: if the data does not start with a journal header.
    """
    unpacker = msgpack.Unpacker(raw=False)
    unpacker.feed(data)
    records: Iterator[object] = iter(unpacker)
    try:
        head = next(records)
    except (StopIteration, ValueError, msgpack.UnpackException) as e:
        raise ValueError("not a ledger journal: no header") from e
    if not (isinstance(head, list) and len(head) == 5 and head[0] == MAGIC):
        raise ValueError(f"not a ledger journal: header is {head!r}")
    header = {"version": head[1], "attempt": head[2], "rank": head[3], "after_commit": head[4]}
    chunks: list[EventChunk] = []
    try:
        for rec in records:
            kind, epoch, batch, worker, position, raw, extras = cast(list[Any], rec)
            assert isinstance(raw, bytes)
            ids = np.frombuffer(raw, dtype="<i8").astype(np.int64)
            arrays = {
                name: np.frombuffer(extras[name], dtype="<i8").astype(np.int64)
                for name in _ARRAYS
                if extras and extras.get(name) is not None
            }
            values = extras.get("values") if extras else None
            chunks.append(
                EventChunk(kind, epoch, batch, worker, position, ids, values=values, **arrays)
            )
    except (ValueError, TypeError, AssertionError, msgpack.UnpackException):
        pass  # a torn tail: everything before it is intact
    return header, chunks


def uncommitted(
    journals: dict[tuple[int, int], bytes], committed: dict[tuple[int, int], int]
) -> dict[tuple[int, int], list[EventChunk]]:
    """The journaled batches that no commit covers: what reached a training loop and was
    never committed (a crashed attempt's lost work, or a live attempt's work in flight).

    Args:
        journals: journal bytes by ``(attempt, rank)``.
        committed: by ``(attempt, rank)``, the next batch index after that rank's newest
            commit in that attempt (batches below it are committed; a crash between the
            marker and the journal reset leaves such batches in the journal).

    Returns:
        By ``(attempt, rank)``: the uncommitted ``sample`` chunks, in journal order.
        Unreadable journals are skipped.
    """
    out: dict[tuple[int, int], list[EventChunk]] = {}
    for key, data in journals.items():
        try:
            _, chunks = read_journal(data)
        except ValueError:
            continue
        floor = committed.get(key, -1)
        out[key] = [c for c in chunks if c.kind in (SAMPLE, SPAN) and c.batch >= floor]
    return out
