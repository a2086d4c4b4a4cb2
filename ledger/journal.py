"""The per-rank msgpack journal: events since the last commit, one record per batch.

The journal is for forensics: after a crash it tells which batches reached the training
loop after the last commit. It is not needed for exact resume (a model that saw those
batches died with the process). Each record is written with one ``writev(2)`` of a few
bytes plus the batch's sample ids as raw little-endian ``int64`` bytes, so appending costs
one syscall per batch and no Python object per sample; a map-style batch's ids, which
are its epoch's order at consecutive positions, are recorded as their count and the
order's parameters (a record of ~70 bytes instead of 8 per sample), from which the reader
computes them. Records reach the OS page cache
before the batch is handed to the training loop: they survive SIGKILL, but not a power
loss (no fsync per batch). A write that fails or falls short (a full disk) raises
:class:`~ledger.errors.StorageError` after cutting the file back to its whole records;
:class:`ledger.log.Ledger` then warns and goes on (commits do not read the journal).
The journal is always a local file, also for an object-store
root (:func:`ledger.log.default_journal_dir`): the next attempt of the rank uploads it to
``ROOT/journal/`` if it holds uncommitted batches.

Framing (versions 2 and 3): every record is a frame ``MAGIC (4 bytes) | length (uint32 LE) |
CRC-32 of the payload (uint32 LE, zlib's, ISO 3309; computed with zlib-ng's, which gives
the same values faster) | payload``, the payload a msgpack array:

* header: ``["ledger-journal", version, attempt, rank, after_commit or None]``
* event: ``[kind, epoch, batch, worker, first_position, ids, extras, digest]``; ``ids``
  is the sample ids' raw bytes, or (version 3) ``[k, n, seed, shuffle]``: the ids are
  then those of :class:`ledger.order.EpochOrder` ``(n, seed, epoch, shuffle)`` (the
  order ``feistel-ff1-splitmix64-r6-v1``) at positions ``first_position ..
  first_position + k - 1``. Each record carries what it needs, so a damaged header or
  record loses no other record;
  ``extras`` is ``None`` or a map of the optional columns: ``positions``,
  ``token_start``, ``token_end``, ``length`` (raw ``int64`` bytes) and ``values`` (list
  of str or nil); ``digest`` is the batch's 32-byte content digest or nil (records
  written before it existed have 7 fields).
  Readers ignore keys they do not know, so writers may add columns.

The reader is tolerant: a frame whose checksum, msgpack or fields are wrong (positions
past the order's end too) is skipped
and counted (it resynchronises on the next ``MAGIC``), a torn final frame (a crash
mid-write) is dropped, and neither ever raises. Version 1 journals (bare msgpack arrays,
no checksums) are still read.
"""

from __future__ import annotations

import contextlib
import errno
import os
import struct
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import msgpack
import numpy as np

from ledger.errors import StorageError
from ledger.order import EpochOrder
from ledger.schema import DIGEST_BYTES, KINDS, ORDER_ALGORITHM, SAMPLE, SPAN, EventChunk

try:  # zlib-ng's CRC-32: the same values as zlib's, ~5x faster (4 KiB: 0.4 against 2.2 µs)
    from zlib_ng.zlib_ng import crc32 as _crc32
except ImportError:  # an install without it (e.g. one made before it was required)
    from zlib import crc32 as _crc32

MAGIC = "ledger-journal"
VERSION = 3
"""Journal format version (1: bare msgpack arrays; 2: checksummed frames; 3: a map-style
batch's ids may be given as a count of positions of its order)."""
_JOURNAL_ORDER = "feistel-ff1-splitmix64-r6-v1"
"""The order of version 3's counts (:data:`ledger.schema.ORDER_ALGORITHM` when it was
made): a later order would come with a new journal version."""
_FRAME = struct.Struct("<4sII")
_FRAME_MAGIC = b"\xffLJ\xfe"
_IOV_MAX = 1024  # buffers one writev(2) takes (POSIX's IOV_MAX on Linux and macOS)
_MAX_RECORD = 1 << 30  # bytes; a larger length field is damage, not a record
_ARRAYS = ("positions", "token_start", "token_end", "length", "sources", "source_epochs")
_INT64 = (-(1 << 63), (1 << 63) - 1)
_LE_INT64 = np.dtype("<i8")


@dataclass(frozen=True, slots=True)
class JournalOrder:
    """The order a map-style run's batches are cut from, which a journal record names so
    that it can give a batch's ids as a count (see the module's docstring).

    Attributes:
        n: dataset length (samples).
        seed: the run's seed.
        shuffle: whether each epoch is shuffled.
    """

    n: int
    seed: int
    shuffle: bool


def journal_path(attempt: int, rank: int) -> str:
    """Relative path of the journal of ``rank`` in ``attempt``."""
    return f"journal/attempt={attempt}/rank={rank}.msgpack"


class Journal:
    """Append-only journal file on local disk.

    Args:
        path: OS path of the journal file (created with its directory).
        attempt: attempt number written in the header.
        rank: rank written in the header.
        order: the run's order, for a map-style run: chunks marked ``from_order`` are then
            recorded by their count. ``None``: every record holds its ids.
    """

    def __init__(
        self, path: str, attempt: int, rank: int, order: JournalOrder | None = None
    ) -> None:
        self.path = path
        self.attempt = attempt
        self.rank = rank
        # Counts only of the order version 3 names (a new order comes with a new version).
        self.order = order if ORDER_ALGORITHM == _JOURNAL_ORDER else None
        os.makedirs(os.path.dirname(path), exist_ok=True)
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        # Closes the descriptor when the journal is garbage-collected without close():
        # a process that creates and drops many loaders must not run out of descriptors.
        self._closer = weakref.finalize(self, os.close, self._fd)
        self._pack = msgpack.Packer(use_bin_type=True).pack
        self._size = 0  # bytes of whole records in the file
        self.reset(None)

    def append(self, *chunks: EventChunk) -> None:
        """Append one batch's events, one record per chunk, in one ``writev(2)``.

        Raises:
            StorageError: if the write fails or writes less than the records (a full disk,
                a quota); the journal is cut back to its records before it, so a retry
                appends after whole records.
        """
        if len(chunks) == 1:
            parts: Sequence[bytes] = self._record(chunks[0])
        else:
            parts = [part for chunk in chunks for part in self._record(chunk)]
            if len(parts) > _IOV_MAX:  # writev takes at most IOV_MAX buffers (a long skip)
                parts = [b"".join(parts)]
        try:
            written = os.writev(self._fd, parts)
        except OSError as e:
            self._cut_back()
            raise StorageError(f"could not write the journal {self.path}: {e}") from e
        size = self._size + written
        if written != sum(map(len, parts)):  # a short write: ENOSPC or a quota midway
            self._cut_back()
            raise StorageError(
                f"could not write the journal {self.path}: {written} of "
                f"{sum(map(len, parts))} bytes written (is the disk full?)"
            )
        self._size = size

    def _cut_back(self) -> None:
        """Truncate the file to its whole records (after a failed or short write)."""
        with contextlib.suppress(OSError):
            os.ftruncate(self._fd, self._size)

    def _record(self, chunk: EventChunk) -> tuple[bytes, bytes]:
        """The frame header and the payload of one chunk's record."""
        # Once per batch in the main process: the two common shapes (a batch's samples,
        # a packed batch's spans) take a dict literal, the rest :func:`_extras`; the keys
        # come in the same order either way, so the bytes are the same.
        c = chunk
        extras: dict[str, Any] | None
        order = self.order
        if c.from_order and order is not None and c.positions is None and c.sources is None:
            payload = cast(
                bytes,
                self._pack(
                    [c.kind, c.epoch, c.batch, c.worker, c.position,
                     [len(c.sample_ids), order.n, order.seed, order.shuffle],
                     _extras(c) if c.values else None, c.digest]
                ),
            )  # fmt: skip
            return _FRAME.pack(_FRAME_MAGIC, len(payload), _crc32(payload)), payload
        if c.positions is None or c.sources is not None or c.source_epochs is not None:
            extras = _extras(c)
        elif c.token_start is None and c.token_end is None and c.length is None:
            extras = {"positions": _raw(c.positions), "values": c.values}
        elif c.token_start is not None and c.token_end is not None and c.length is not None:
            extras = {
                "positions": _raw(c.positions),
                "token_start": _raw(c.token_start),
                "token_end": _raw(c.token_end),
                "length": _raw(c.length),
                "values": c.values,
            }
        else:
            extras = _extras(c)
        payload = cast(
            bytes,
            self._pack(
                [
                    chunk.kind, chunk.epoch, chunk.batch, chunk.worker, chunk.position,
                    _raw(chunk.sample_ids), extras, chunk.digest,
                ]
            ),
        )  # fmt: skip
        return _FRAME.pack(_FRAME_MAGIC, len(payload), _crc32(payload)), payload

    def reset(self, after_commit: str | None) -> None:
        """Empty the journal after a commit; the header names that commit.

        Raises:
            StorageError: if the file cannot be emptied or its header written (the
                journal is then empty: its records name their batches on their own).
        """
        self._size = 0
        header = _frame(self._pack([MAGIC, VERSION, self.attempt, self.rank, after_commit]))
        try:
            os.ftruncate(self._fd, 0)
            if os.write(self._fd, header) != len(header):
                raise OSError(errno.ENOSPC, "a short write")
        except OSError as e:
            self._cut_back()
            raise StorageError(f"could not write the journal {self.path}: {e}") from e
        self._size = len(header)

    def close(self) -> None:
        """Close the file (idempotent); its records stay on disk."""
        self._closer()
        self._fd = -1


def _extras(chunk: EventChunk) -> dict[str, Any] | None:
    """A record's map of optional columns (``None`` if it has none)."""
    if not (
        chunk.positions is not None
        or chunk.token_start is not None
        or chunk.values
        or chunk.sources is not None
        or chunk.source_epochs is not None
    ):
        return None
    extras: dict[str, Any] = {
        name: _raw(arr) for name in _ARRAYS if (arr := getattr(chunk, name)) is not None
    }
    extras["values"] = chunk.values
    if chunk.sources is not None:
        extras["source_names"] = list(chunk.source_names or ())
    return extras


def _raw(arr: np.ndarray) -> memoryview:
    """The raw little-endian ``int64`` bytes of an integer array (no copy if it is one)."""
    if arr.dtype != _LE_INT64 or not arr.flags.c_contiguous:
        arr = np.ascontiguousarray(arr, dtype=_LE_INT64)
    return arr.data


def _frame(payload: bytes) -> bytes:
    return _FRAME.pack(_FRAME_MAGIC, len(payload), _crc32(payload)) + payload


@dataclass(slots=True)
class JournalContents:
    """What :func:`parse_journal` read from a journal.

    Attributes:
        header: ``version, attempt, rank, after_commit``; ``None`` if the header record
            is missing or damaged.
        chunks: the event records that passed their checksum and checks, in order.
        unreadable: damaged records skipped (a checksum, msgpack or field that is wrong;
            a run of damaged bytes counts once). A torn final record is not counted.
        torn: the file ends inside a record (a crash mid-write).
    """

    header: dict[str, Any] | None = None
    chunks: list[EventChunk] = field(default_factory=list)
    unreadable: int = 0
    torn: bool = False


class _Bad(Exception):
    """A record that does not parse or check."""


def _int(value: Any, lo: int = _INT64[0]) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= _INT64[1]:
        raise _Bad(f"{value!r} is not an integer >= {lo}")
    return value


def _array(raw: Any, rows: int | None) -> np.ndarray:
    if not isinstance(raw, bytes) or len(raw) % 8 or (rows is not None and len(raw) != 8 * rows):
        raise _Bad("an int64 column of the wrong size")
    return np.frombuffer(raw, dtype="<i8").astype(np.int64)


def _header(rec: Any) -> dict[str, Any]:
    if not (isinstance(rec, list) and len(rec) == 5 and rec[0] == MAGIC):
        raise _Bad("not a journal header")
    after = rec[4]
    if after is not None and not isinstance(after, str):
        raise _Bad("after_commit is not a string")
    return {"version": _int(rec[1], 1), "attempt": _int(rec[2], 0), "rank": _int(rec[3], 0),
            "after_commit": after}  # fmt: skip


_COUNTED_IDS = 1 << 26
"""The most ids a journal's records may give by count (512 MiB as ``int64``): a record of
~70 bytes stands for any number of ids, so a damaged or hostile journal could otherwise
make its reader allocate without bound. Records past it are counted unreadable."""


class _Orders:
    """Sample ids of records given as a count of an order's positions (the latest
    :class:`ledger.order.EpochOrder` kept: a journal's records share one per epoch), at
    most :data:`_COUNTED_IDS` in all."""

    def __init__(self) -> None:
        self._last: tuple[tuple[int, int, int, bool], EpochOrder] | None = None
        self._left = _COUNTED_IDS

    def ids(self, epoch: int, position: int, raw: list[Any]) -> np.ndarray:
        if len(raw) != 4:
            raise _Bad("ids are neither bytes nor [count, n, seed, shuffle]")
        if ORDER_ALGORITHM != _JOURNAL_ORDER:  # a later version whose order differs
            raise _Bad(f"ids given by positions of {_JOURNAL_ORDER}, which this version lacks")
        count, n, seed, shuffle = _int(raw[0], 1), _int(raw[1], 1), raw[2], raw[3]
        if not isinstance(shuffle, bool) or not isinstance(seed, int) or isinstance(seed, bool):
            raise _Bad("the order of a record's ids has no seed or shuffle flag")
        if n >= 1 << 62 or position < 0 or position + count > n:
            raise _Bad("a record's positions run past its order's end")
        if count > self._left:
            raise _Bad(f"the journal's records give more than {_COUNTED_IDS} ids by count")
        self._left -= count
        key = (n, seed, epoch, shuffle)
        if self._last is None or self._last[0] != key:
            self._last = (key, EpochOrder(n, seed, epoch, shuffle))
        return self._last[1].sample_ids(np.arange(position, position + count, dtype=np.int64))


def _chunk(rec: Any, orders: _Orders) -> EventChunk:
    """An event record as a chunk; raises :class:`_Bad` for any field that is wrong."""
    if not (isinstance(rec, list) and len(rec) in (7, 8)):
        raise _Bad("not an event record")
    kind, epoch, batch, worker, position, raw, extras = rec[:7]
    digest = rec[7] if len(rec) == 8 else None
    if digest is not None and not (isinstance(digest, bytes) and len(digest) == DIGEST_BYTES):
        raise _Bad("digest is not 32 bytes")
    if kind not in KINDS:
        raise _Bad(f"unknown kind {kind!r}")
    if isinstance(raw, list):
        if extras is not None and (
            not isinstance(extras, dict) or any(extras.get(a) is not None for a in _ARRAYS)
        ):
            raise _Bad("a count of ids with columns of their own")
        ids = orders.ids(_int(epoch, 0), _int(position), raw)
    else:
        ids = _array(raw, None)
    arrays: dict[str, np.ndarray] = {}
    values = None
    if extras is not None:
        if not isinstance(extras, dict):
            raise _Bad("extras is not a map")
        for name in _ARRAYS:
            if extras.get(name) is not None:
                arrays[name] = _array(extras[name], ids.size)
        values = extras.get("values")
        if values is not None and not (
            isinstance(values, list)
            and len(values) == ids.size
            and all(v is None or isinstance(v, str) for v in values)
        ):
            raise _Bad("values is not a list of strings, one per row")
        names = extras.get("source_names")
        if "sources" in arrays:
            if not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
                raise _Bad("sources without a list of source names")
            codes = arrays["sources"]
            if codes.size and not (codes.min() >= 0 and codes.max() < len(names)):
                raise _Bad("a source code names no source")
            arrays["sources"] = codes.astype(np.int16)
            arrays_names = tuple(names)
        else:
            arrays_names = None
    else:
        arrays_names = None
    get = arrays.get
    return EventChunk(
        kind, _int(epoch, 0), _int(batch, 0), _int(worker, -1), _int(position), ids,
        positions=get("positions"), token_start=get("token_start"), token_end=get("token_end"),
        length=get("length"), values=values, digest=digest, sources=get("sources"),
        source_names=arrays_names, source_epochs=get("source_epochs"),
    )  # fmt: skip


def _unpack(payload: bytes) -> Any:
    try:
        return msgpack.unpackb(payload, raw=False)
    except (ValueError, TypeError, OverflowError, RecursionError, msgpack.UnpackException) as e:
        raise _Bad(f"not msgpack: {e}") from None


def parse_journal(data: bytes) -> JournalContents:
    """Parse a journal tolerantly; never raises.

    Args:
        data: the journal file's bytes.

    Returns:
        The header, the intact records, and how many were damaged (see
        :class:`JournalContents`). Chunks whose batch was already committed (a crash
        between the commit marker and the journal reset) are still returned; compare
        ``batch`` with the commit's state.
    """
    if data[:4] != _FRAME_MAGIC:
        return _parse_v1(data)
    out = JournalContents()
    orders = _Orders()
    pos, end, in_sync = 0, len(data), True
    while pos < end:
        if data[pos : pos + 4] == _FRAME_MAGIC and pos + _FRAME.size <= end:
            _, length, crc = _FRAME.unpack_from(data, pos)
            body = pos + _FRAME.size
            if body + length > end and in_sync and data.find(_FRAME_MAGIC, pos + 1) < 0:
                out.torn = True  # the last record was cut short
                break
            payload = data[body : body + length]
            if length <= _MAX_RECORD and len(payload) == length and _crc32(payload) == crc:
                try:
                    rec = _unpack(payload)
                    if pos == 0:
                        out.header = _header(rec)
                    else:
                        out.chunks.append(_chunk(rec, orders))
                except _Bad:
                    out.unreadable += 1  # a record written well that does not check
                pos, in_sync = body + length, True
                continue
        if in_sync:
            out.unreadable += 1  # damage starts here; look for the next frame
            in_sync = False
        nxt = data.find(_FRAME_MAGIC, pos + 1)
        pos = end if nxt < 0 else nxt
    return out


def _parse_v1(data: bytes) -> JournalContents:
    """Version 1: bare msgpack arrays, no checksums; reading stops at the first damage."""
    out = JournalContents()
    unpacker = msgpack.Unpacker(raw=False)
    unpacker.feed(data)
    try:
        out.header = _header(next(unpacker))
    except (StopIteration, _Bad, ValueError, TypeError, RecursionError, msgpack.UnpackException):
        out.unreadable = 1 if data else 0
        return out
    try:
        for rec in unpacker:
            out.chunks.append(_chunk(rec, _Orders()))
    except _Bad:
        out.unreadable += 1
    except (ValueError, TypeError, OverflowError, RecursionError, msgpack.UnpackException):
        out.torn = True  # a torn tail: everything before it is intact
    return out


def read_journal(data: bytes) -> tuple[dict[str, object], list[EventChunk]]:
    """Parse a journal tolerantly (see :func:`parse_journal`), keeping its header.

    Args:
        data: the journal file's bytes.

    Returns:
        ``(header, chunks)``; header keys: ``version, attempt, rank, after_commit``.

    Raises:
        ValueError: if the data does not start with an intact journal header.
    """
    contents = parse_journal(data)
    if contents.header is None:
        raise ValueError("not a ledger journal: no intact header")
    return contents.header, contents.chunks


def uncommitted(
    journals: dict[tuple[int, int], bytes], committed: dict[tuple[int, int], int]
) -> tuple[dict[tuple[int, int], list[EventChunk]], dict[tuple[int, int], int]]:
    """The journaled batches that no commit covers: what reached a training loop and was
    never committed (a crashed attempt's lost work, or a live attempt's work in flight).

    Args:
        journals: journal bytes by ``(attempt, rank)``.
        committed: by ``(attempt, rank)``, the next batch index after that rank's newest
            commit in that attempt (batches below it are committed; a crash between the
            marker and the journal reset leaves such batches in the journal).

    Returns:
        ``(chunks, unreadable)``: by ``(attempt, rank)``, the uncommitted ``sample`` and
        ``span`` chunks in journal order, and the damaged records skipped in each journal.
    """
    out: dict[tuple[int, int], list[EventChunk]] = {}
    unreadable: dict[tuple[int, int], int] = {}
    for key, data in journals.items():
        contents = parse_journal(data)
        unreadable[key] = contents.unreadable
        floor = committed.get(key, -1)
        out[key] = [
            c.split_digest()[0]
            for c in contents.chunks
            if c.kind in (SAMPLE, SPAN) and c.batch >= floor
        ]
    return out, unreadable
