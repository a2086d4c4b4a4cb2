"""Fuzz every reader of the log, and the token check: only ledger's errors come out.

Inputs are arbitrary JSON values and bytes, and mutations (flipped, inserted, deleted,
replaced bytes; fields replaced by arbitrary JSON) of real files of a real log. The only
exceptions allowed are :class:`ledger.errors.LedgerError` types (the journal reader
allows none at all: it is tolerant). ``LEDGER_FUZZ_EXAMPLES`` sets the examples per test
(default 150 here; ``tools/fuzz.py`` runs 10^4 per test).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import itertools
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import Augmented
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ledger
from ledger import commits, segments
from ledger.commits import read_attempt, read_commit, read_run
from ledger.errors import LedgerError, LogCorrupted, TokenError
from ledger.journal import parse_journal
from ledger.loader import _check_token
from ledger.segments import open_segment
from ledger.store import Store

EXAMPLES = int(os.environ.get("LEDGER_FUZZ_EXAMPLES", "150"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

MARKER = "commits/000000000004-0000.json"
SEGMENT = "events/attempt=0/rank=0/seg-000000000004.parquet"
JOURNAL = "journal/attempt=0/rank=0.msgpack"


@functools.cache
def _log() -> str:
    """A real log: commits at batches 2 and 4, two uncommitted batches in the journal."""
    root = os.path.join(tempfile.mkdtemp(prefix="ledger-fuzz-"), "log")
    loader = ledger.DataLoader(Augmented(24), batch_size=3, shuffle=True, seed=3, log=root)
    it = iter(loader)
    for _ in range(2):
        next(it)
    loader.state_dict()
    for _ in range(2):
        next(it)
    loader.state_dict()
    for _ in range(2):
        next(it)
    return root


def _original(rel: str) -> bytes:
    return Path(_log(), rel).read_bytes()


@functools.cache
def _scratch() -> Store:
    """A root the fuzzed files are written into, one at a time."""
    root = tempfile.mkdtemp(prefix="ledger-fuzz-scratch-")
    for folder in ("commits", "ranks", "attempts", "events/attempt=0/rank=0"):
        os.makedirs(os.path.join(root, folder), exist_ok=True)
    return Store(root)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4)
    ),
    max_leaves=12,
)


@st.composite
def mutated(draw: st.DrawFn, data: bytes) -> bytes:
    """``data`` with a few bytes flipped, inserted, deleted or replaced, or cut short."""
    out = bytearray(data)
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "insert", "delete", "replace", "truncate"]))
        i = draw(st.integers(0, max(len(out) - 1, 0)))
        if op == "flip" and out:
            out[i] ^= 1 << draw(st.integers(0, 7))
        elif op == "insert":
            out[i:i] = draw(st.binary(min_size=1, max_size=8))
        elif op == "delete" and out:
            del out[i : i + draw(st.integers(1, 8))]
        elif op == "replace" and out:
            out[i] = draw(st.integers(0, 255))
        elif op == "truncate":
            del out[i:]
    return bytes(out)


@st.composite
def field_replaced(draw: st.DrawFn, rel: str) -> bytes:
    """A JSON file of the log with one field (at any depth) replaced by arbitrary JSON."""
    doc = json.loads(_original(rel))
    node: Any = doc
    for _ in range(draw(st.integers(0, 3))):
        if isinstance(node, dict) and node:
            key = draw(st.sampled_from(sorted(node)))
            if not isinstance(node[key], (dict, list)) or not node[key]:
                break
            node = node[key]
        elif isinstance(node, list) and node:
            nxt = node[draw(st.integers(0, len(node) - 1))]
            if not isinstance(nxt, (dict, list)) or not nxt:
                break
            node = nxt
    if isinstance(node, dict) and node:
        key = draw(st.sampled_from(sorted(node)))
        if draw(st.booleans()):
            node[key] = draw(json_values)
        else:
            del node[key]
    elif isinstance(node, list) and node:
        node[draw(st.integers(0, len(node) - 1))] = draw(json_values)
    return json.dumps(doc).encode()


def _json_file(rel: str) -> st.SearchStrategy[bytes]:
    return st.one_of(
        json_values.map(lambda v: json.dumps(v).encode()),
        st.binary(max_size=64),
        field_replaced(rel),
        st.just(_original(rel)).flatmap(lambda data: mutated(data)),
    )


def _only_ledger_errors(call: Any) -> None:
    with contextlib.suppress(LedgerError):
        call()


@FUZZ
@given(data=_json_file(MARKER))
def test_fuzz_commit_marker(data: bytes) -> None:
    store = _scratch()
    Path(store.path, MARKER).write_bytes(data)
    Path(store.path, RANKS).write_bytes(_original(RANKS))

    def read() -> None:
        commit = read_commit(store, "000000000004-0000")
        list(commit.states), list(commit.segments)

    _only_ledger_errors(read)


_ODD = [None, True, False, -1, 0, 1, 2, 1.0, "", "x", "..", "/a", [], [1], [1, 2], [1, 2, 3]]


def _variants(doc: Any) -> Iterator[Any]:
    """``doc`` with one field (at any depth) replaced by each of :data:`_ODD` or a few
    near misses, or deleted."""
    yield doc
    if isinstance(doc, dict):
        items: list[tuple[Any, Any]] = list(doc.items())
    elif isinstance(doc, list):
        items = list(enumerate(doc))
    else:
        return
    for key, value in items:
        near: list[Any] = []
        if isinstance(value, str):
            near = [value.upper(), value + "\n", value + "/", value.replace("/", "//")]
        for new in [*_ODD, *near, *_variants(value)]:
            out = copy.deepcopy(doc)
            out[key] = new
            yield out
        if isinstance(doc, dict):
            yield {k: v for k, v in doc.items() if k != key}


def test_marker_checked_at_once_as_field_by_field() -> None:
    """A marker's fields checked at once (``ledger verify`` parses 10^4 markers) accept no
    marker the field-by-field checks refuse, and give the same values."""
    cid = "000000000004-0000"
    marker = json.loads(_original(MARKER))
    marker["skips"] = [[7, 9, "bad shard"]]
    taken = 0
    for doc in itertools.chain(_variants(json.loads(_original(MARKER))), _variants(marker)):
        for fast, checked in (
            (commits._v2_fields, commits._v2_fields_checked),
            (commits._usual_fields, commits._extra_fields_checked),
        ):
            once = fast(doc, cid)
            if once is not None:
                assert checked(doc, cid, MARKER) == once, doc
                taken += 1
    assert taken > 100  # the fast path is the usual one


RANKS = "ranks/000000000004-0000.ranks"


@FUZZ
@given(
    data=st.one_of(
        st.binary(max_size=64), st.just(b"").flatmap(lambda _: mutated(_original(RANKS)))
    )
)
def test_fuzz_rank_table(data: bytes) -> None:
    store = _scratch()
    Path(store.path, MARKER).write_bytes(_original(MARKER))
    Path(store.path, RANKS).write_bytes(data)

    def read() -> None:
        commit = read_commit(store, "000000000004-0000")
        list(commit.states), list(commit.segments)  # the table is decoded lazily

    _only_ledger_errors(read)


@FUZZ
@given(data=_json_file("run.json"))
def test_fuzz_run_json(data: bytes) -> None:
    store = _scratch()
    Path(store.path, "run.json").write_bytes(data)
    _only_ledger_errors(lambda: read_run(store))


@FUZZ
@given(data=_json_file("attempts/0000.json"))
def test_fuzz_attempt_record(data: bytes) -> None:
    store = _scratch()
    Path(store.path, "attempts/0000.json").write_bytes(data)
    _only_ledger_errors(lambda: read_attempt(store, "0000.json"))


@FUZZ
@given(
    data=st.one_of(
        st.binary(max_size=256), st.just(b"").flatmap(lambda _: mutated(_original(JOURNAL)))
    )
)
def test_fuzz_journal(data: bytes) -> None:
    contents = parse_journal(data)  # never raises
    intact = parse_journal(_original(JOURNAL))
    # Damage loses records; it never invents more than the journal holds plus inserted bytes.
    assert len(contents.chunks) <= len(intact.chunks) + len(data) // 32


_ANY = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.binary(max_size=24)
    | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
        st.sampled_from(["positions", "values", "sources", "source_names", "x"]), inner,
        max_size=3,
    ),
    max_leaves=8,
)  # fmt: skip
_COUNT = st.lists(st.integers(-3, 2**63 - 1) | st.booleans() | st.none(), min_size=3, max_size=5)


@FUZZ
@given(
    records=st.lists(
        st.tuples(st.integers(0, 7), _ANY | _COUNT, st.integers(-3, 1 << 40)), max_size=6
    )
)
def test_fuzz_journal_records(records: list[tuple[int, Any, int]]) -> None:
    """Well-framed records (their CRC-32s right) whose fields are anything, the ids given
    as a count among them: each is read or counted unreadable, and parsing never raises
    nor allocates past its bound."""
    import msgpack

    from ledger.journal import _FRAME, _FRAME_MAGIC, _crc32

    def frame(rec: Any) -> bytes:
        payload = msgpack.packb(rec, use_bin_type=True)
        return _FRAME.pack(_FRAME_MAGIC, len(payload), _crc32(payload)) + payload

    data = frame(["ledger-journal", 3, 0, 0, None])
    for field, value, position in records:
        rec: list[Any] = ["sample", 0, 1, -1, position, [4, 1000, 7, True], None, None]
        rec[field] = value
        data += frame(rec)
    contents = parse_journal(data)
    assert contents.header is not None
    assert len(contents.chunks) + contents.unreadable == len(records)
    for chunk in contents.chunks:
        assert chunk.sample_ids.dtype == "int64" and chunk.sample_ids.size <= 2**26


@FUZZ
@given(data=st.just(b"").flatmap(lambda _: mutated(_original(SEGMENT))))
def test_fuzz_segment(data: bytes) -> None:
    store = _scratch()
    Path(store.path, SEGMENT).write_bytes(data)

    # No checksum: the Parquet reader itself meets the damage.
    _only_ledger_errors(lambda: segments.read(store, SEGMENT))
    ref = read_commit(Store(_log()), "000000000004-0000").segments[0]
    assert ref.path == SEGMENT
    if data != _original(SEGMENT):  # with the marker's checksum, damage is always caught
        with pytest.raises(LogCorrupted):
            open_segment(store, SEGMENT, rows=ref.rows, checksum=ref.sha256)


def _token() -> dict[str, Any]:
    return {
        "version": 1, "root": "/r", "run_id": "ab", "commit": "000000000004-0000",
        "attempt": 0, "world_size": 1, "step": 4,
    }  # fmt: skip


@FUZZ
@given(
    key=st.sampled_from(sorted(_token())) | st.text(max_size=8),
    value=json_values | st.binary(max_size=8),
    drop=st.booleans(),
)
def test_fuzz_token(key: str, value: Any, drop: bool) -> None:
    token = _token()
    if drop:
        token.pop(key, None)
    else:
        token[key] = value
    try:
        _check_token(token)
    except TokenError:
        return
    # Accepted: every field has the documented type.
    assert isinstance(token["version"], int) and token["version"] == 1
    assert all(isinstance(token[k], str) for k in ("root", "run_id", "commit"))
    assert all(isinstance(token[k], int) for k in ("attempt", "world_size", "step"))


@FUZZ
@given(value=json_values | st.binary(max_size=8))
def test_fuzz_token_whole(value: Any) -> None:
    _only_ledger_errors(lambda: _check_token(value))
