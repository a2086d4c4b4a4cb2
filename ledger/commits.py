"""Run metadata, attempts, commit markers, the commit chain and lineage.

A commit marker (``commits/<step>-<attempt>.json``) ties the segments of all ranks to a
checkpoint step and names its parent commit; markers form a chain. The lineage of a head
commit is the chain from it back to the first commit: exactly what the model at that
checkpoint saw. Markers are created exclusively, so a commit id is written once.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import gc
import json
import operator
import os
import re
import socket
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, fields
from datetime import datetime, timezone
from typing import Any, TypeVar

import numpy as np

from ledger import manifest as manifest_mod
from ledger import ranks as ranks_mod
from ledger.errors import (
    CommitConflict,
    CommitNotFound,
    ConfigMismatch,
    LedgerError,
    LogCorrupted,
)
from ledger.ranks import RankTable, SegmentRef
from ledger.schema import READABLE_VERSIONS, SCHEMA_VERSION
from ledger.store import Fetched, Store, sha256
from ledger.validate import INT64_MAX, items, obj, relative_path, require, sha256_hex

RUN_FILE = "run.json"

F = TypeVar("F", bound=Callable[..., Any])


def now_iso() -> str:
    """Current UTC time in ISO 8601."""
    return datetime.now(timezone.utc).isoformat()


def _dump(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, indent=1, sort_keys=True).encode()


def _load(store: Store, rel: str, fetched: Fetched | None = None) -> dict[str, Any]:
    raw = store.read_known(rel, fetched)
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise LogCorrupted(f"{store.full(rel)} is not valid JSON: {e}") from e
    version = data.get("version") if isinstance(data, dict) else None
    if not isinstance(data, dict) or version not in READABLE_VERSIONS:
        raise LogCorrupted(
            f"{store.full(rel)} has version {version!r}, this ledger reads versions "
            f"{', '.join(map(str, READABLE_VERSIONS))}"
        )
    return data


# ---------------------------------------------------------------- pipeline state


@dataclass(slots=True, unsafe_hash=True)
class WorkerState:
    """Where one logical worker of a stream stands, as of the last batch consumed from it.

    Treat it as immutable: it is not frozen only because a frozen dataclass's constructor
    costs ~2.5 µs more, and a stream makes one per consumed batch (hashable all the same).

    Attributes:
        worker: logical worker id on its rank (``0..num_workers-1``; 0 without workers).
        shard: index into the worker's shard list of the shard being read.
        row: rows of that shard already read.
        rows_read: rows read this epoch (into the shuffle buffer or straight through).
        draws: shuffle-buffer draws made this epoch (the counter of the counter-based RNG).
        emitted: samples the buffer handed on this epoch.
        doc: sample id of the document the packer is in the middle of, ``-1`` for none.
        doc_offset: tokens of ``doc`` already packed.
        doc_length: tokens of ``doc``, EOS included.
        tails: samples another world size or worker count left partly packed, to
            finish before reading on: ``(sample id, token offset, length)``.
    """

    worker: int
    shard: int = 0
    row: int = 0
    rows_read: int = 0
    draws: int = 0
    emitted: int = 0
    doc: int = -1
    doc_offset: int = 0
    doc_length: int = 0
    tails: tuple[tuple[int, int, int], ...] = ()

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "a worker state") -> WorkerState:
        """Parse a worker state from JSON.

        Raises:
            LogCorrupted: naming ``where`` and the field, if a field is missing or mangled.
        """
        known = {f.name: f.default for f in fields(cls)}
        unknown = sorted(set(obj(d, where)) - set(known))
        if unknown:
            raise LogCorrupted(f"{where}: unknown field {unknown[0]!r} in a worker state")
        tails = []
        for t in items(d, "tails", where, default=()):
            if not (isinstance(t, (list, tuple)) and len(t) == 3 and all(_is_int(v) for v in t)):
                raise LogCorrupted(f"{where}: field 'tails' holds {t!r}, not 3 integers")
            tails.append((int(t[0]), int(t[1]), int(t[2])))
        ints = {
            name: require(d, name, int, where, default=default, minimum=-1)
            for name, default in known.items()
            if name != "tails"
        }
        return cls(**ints, tails=tuple(tails))


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(slots=True, unsafe_hash=True)
class PipelineState:
    """Where one rank's pipeline stands, between two batches.

    Treat it as immutable: it is not frozen only because a frozen dataclass's constructor
    costs ~2 µs more, and a loader makes one per consumed batch (hashable all the same).

    Attributes:
        rank: the rank.
        epoch: epoch of the next batch.
        epoch_batch: batches of ``epoch`` this rank has consumed (0 at an epoch start).
        batch: per-rank index of the next batch over the lineage (= batches consumed).
        workers: streams only: the state of each logical worker (the shuffle buffers'
            contents are logged as ``buffer`` events at each commit).
        next_worker: streams only: the logical worker whose batch comes next.
        epoch_start: position where the current world size began stepping through
            ``epoch`` (0 unless the epoch was resumed with another world size).
        origin: streams only: the commit an attempt with another world size or worker
            count resumed from; the epochs unfinished there are served from what that
            commit left (:func:`ledger.stream.plan.carry_over`). ``""``: none.
    """

    rank: int = 0
    epoch: int = 0
    epoch_batch: int = 0
    batch: int = 0
    workers: tuple[WorkerState, ...] = ()
    next_worker: int = 0
    epoch_start: int = 0
    origin: str = ""

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "a pipeline state") -> PipelineState:
        """Parse a pipeline state from JSON.

        Raises:
            LogCorrupted: naming ``where`` and the field, if a field is missing or mangled.
        """
        workers = items(d, "workers", where, default=())
        return cls(
            require(d, "rank", int, where, minimum=0),
            require(d, "epoch", int, where, minimum=0),
            require(d, "epoch_batch", int, where, minimum=0),
            require(d, "batch", int, where, minimum=0),
            tuple(WorkerState.from_dict(w, f"{where}, worker {i}") for i, w in enumerate(workers)),
            require(d, "next_worker", int, where, default=0, minimum=0),
            require(d, "epoch_start", int, where, default=0, minimum=0),
            require(d, "origin", str, where, default=""),
        )


# ---------------------------------------------------------------- run.json


# Hints for ConfigMismatch: what the user should do when a key differs.
_HINTS = {
    "dataset_len": "The dataset changed since the run started: resume with the original "
    "dataset, or start a new run under a new log root.",
    "order": "The epoch-order algorithm of this ledger version differs from the log's: resume "
    "with the ledger version that wrote the log.",
}


# Recorded in run.json but free to change between attempts (elastic resume).
ELASTIC_KEYS = ("world_size", "workers")
# Recorded in run.json and kept by the run whatever the loader resuming it would choose
# for a new run: a stream's carry dealing (the pipeline takes the log's, see
# :meth:`ledger.stream.pipeline.StreamPipeline.check_logged`).
LOG_KEYS = ("carry",)


def upgrade_config(config: dict[str, Any]) -> dict[str, Any]:
    """A logged configuration in today's keys: logs written before the RNG modes record
    ``per_sample_rng`` (``True``: ``rng="sample"``, ``False``: ``rng="off"``)."""
    if "per_sample_rng" in config and "rng" not in config:
        config = dict(config)
        config["rng"] = "sample" if config.pop("per_sample_rng") else "off"
    return config


def open_run(
    store: Store,
    config: dict[str, Any],
    phase_config: dict[str, Any] | None = None,
    existing: dict[str, Any] | None = None,
) -> str:
    """Create ``run.json`` for a new run, or check ``config`` against an existing one.

    Args:
        store: the log root.
        config: JSON-serialisable configuration (dataset length, seed, batch size, ...).
        phase_config: the configuration of the phase being resumed (an attempt record's
            ``phase``), checked instead of ``run.json``'s; ``None``: the run's first phase.
        existing: ``run.json`` as the caller just read it (:func:`read_run`; it never
            changes once created), or ``None`` to look here.

    Returns:
        The run id (hex string).

    Raises:
        ConfigMismatch: if the root already holds a run whose config differs; names the
            first differing key with both values.
    """
    if existing is not None:
        return _check_config(existing, config, phase_config)
    if not store.exists(RUN_FILE):
        run = {
            "version": SCHEMA_VERSION,
            "run_id": os.urandom(8).hex(),
            "created_at": now_iso(),
            "config": config,
        }
        try:
            store.create_exclusive(RUN_FILE, _dump(run))
            return str(run["run_id"])
        except CommitConflict:
            pass  # another process created it first: check against theirs
    return _check_config(read_run(store), config, phase_config)


def _check_config(
    run: dict[str, Any], config: dict[str, Any], phase_config: dict[str, Any] | None
) -> str:
    """``run``'s id if ``config`` matches its configuration (or ``phase_config``).

    Raises:
        ConfigMismatch: naming the first differing key with both values.
    """
    logged: dict[str, Any] = upgrade_config(run["config"] if phase_config is None else phase_config)
    for key in sorted((set(logged) | set(config)) - set(ELASTIC_KEYS) - set(LOG_KEYS)):
        if logged.get(key) != config.get(key):
            hint = _HINTS.get(key, "")
            if key in PHASE_KEYS:
                hint = (hint + " " if hint else "") + (
                    "To change it deliberately, resume with "
                    "load_state_dict(token, new_phase=True): the change is recorded as a new "
                    "phase of the run."
                )
            raise ConfigMismatch(key, logged.get(key), config.get(key), hint)
    return str(run["run_id"])


PHASE_KEYS = ("mixture", "batch_size", "drop_last")
"""Configuration keys a new phase may change (``load_state_dict(token, new_phase=True)``)."""


def phase_of(store: Store, commit: Commit | None) -> dict[str, Any] | None:
    """The phase ``commit`` belongs to: its attempt record's ``phase`` (``None``: the
    run's first phase, configured by ``run.json``). One small read, whatever the history.

    Raises:
        LogCorrupted: if the attempt record is damaged.
    """
    if commit is None:
        return None
    try:
        return read_attempt(store, f"{commit.attempt:04d}.json")["phase"]
    except FileNotFoundError:
        return None  # attempt records are advisory for older logs


def read_run(store: Store) -> dict[str, Any]:
    """Contents of ``run.json``.

    Raises:
        CommitNotFound: if the root holds no run.
        LogCorrupted: if ``run.json`` is not JSON, of another version, or lacks or
            mangles ``run_id``, ``created_at``, ``config`` or a typed config key.
    """
    run = find_run(store)
    if run is None:
        hint = "".join(f"; did you mean {store.uri}/{name}?" for name in _runs_below(store))
        raise CommitNotFound(f"{store.uri} holds no ledger run (no {RUN_FILE}){hint}")
    return run


def find_run(store: Store) -> dict[str, Any] | None:
    """Contents of ``run.json`` as :func:`read_run` checks them, or ``None`` if the root
    holds no run (one read: no separate existence check).

    Raises:
        LogCorrupted: as :func:`read_run`.
    """
    try:
        raw = store.read_bytes(RUN_FILE)
    except FileNotFoundError:
        return None
    run = _load(store, RUN_FILE, {RUN_FILE: raw})
    where = store.full(RUN_FILE)
    require(run, "run_id", str, where)
    require(run, "created_at", str, where)
    config = require(run, "config", dict, where)
    for key, kind in _RUN_CONFIG.items():
        # A seed is any integer torch.manual_seed takes: up to 2**64 - 1.
        top = SEED_MAX if key == "seed" else INT64_MAX
        require(
            config,
            key,
            kind,
            f"{where}, config",
            default=None,
            nullable=key not in _RUN_REQUIRED,  # every writer puts a number there
            minimum=_RUN_REQUIRED.get(key),
            maximum=top,
        )
    packer = require(config, "packer", dict, f"{where}, config", default=None, nullable=True)
    if packer is not None:  # a packed stream's: the report divides by seq_len
        require(packer, "seq_len", int, f"{where}, config, packer", minimum=1)
    if "mixture" in config:
        check_mixture(config["mixture"], f"{where}, config, mixture")
    # After the fields: a mangled field is named; a well-formed edit is caught here.
    _check_run_bytes(store, raw)
    return run


def _check_run_bytes(store: Store, raw: bytes) -> None:
    """``run.json``'s bytes against the SHA-256 the run's first attempt recorded when it
    began (``attempts/0000.json``'s ``run_sha256``): ``run.json`` is created once and
    never rewritten, so any difference is damage, and every answer read from it (the
    dataset's length, the seed, a mixture's sources) would be silently wrong. One small
    read, once per command. A first record that is missing, does not parse or names no
    well-formed digest (a log begun before this check) is not compared: a damaged record
    is :func:`read_attempt`'s to report.

    Raises:
        LogCorrupted: naming both files, if they disagree.
    """
    cache = command_cache()
    key = ("run.json checked", store.uri)
    if cache is not None and cache.get(key) == raw:
        return
    rel = "attempts/0000.json"
    try:
        record = json.loads(store.read_bytes(rel))
    except (FileNotFoundError, ValueError, RecursionError):
        return
    recorded = record.get("run_sha256") if isinstance(record, dict) else None
    if isinstance(recorded, str) and _HEX64.fullmatch(recorded) and recorded != sha256(raw):
        raise run_changed(store, rel)
    if cache is not None:
        cache[key] = raw


def run_changed(store: Store, record: str) -> LogCorrupted:
    """The error for a ``run.json`` whose SHA-256 differs from the one the attempt record
    ``record`` (a path relative to the root) names."""
    return LogCorrupted(
        f"{store.full(RUN_FILE)} differs from the SHA-256 {store.full(record)} recorded "
        "when its attempt began: run.json is never rewritten, so it (or that record) was "
        "changed or damaged since. Restore it from a copy of the log"
    )


def run_digest(store: Store) -> str:
    """The SHA-256 of ``run.json``'s bytes as they are on storage (what an attempt record
    names in ``run_sha256``).

    Raises:
        FileNotFoundError: if the root holds no run.
    """
    return sha256(store.read_bytes(RUN_FILE))


def check_mixture(mix: Any, where: str) -> dict[str, Any]:
    """A mixture's configuration as ``run.json`` (or a phase's attempt record) holds it,
    checked for what the audits read: ``epoch_size``, ``sources`` (each a ``name`` and
    a ``len``), ``schedule`` (``[start, {source: weight}]`` pairs) and ``targets`` (a map
    of shares per schedule entry).

    Raises:
        LogCorrupted: naming ``where`` and the field, if one is missing or mangled.
    """
    require(mix, "epoch_size", int, where, minimum=0)
    for i, source in enumerate(require(mix, "sources", list, where)):
        require(source, "name", str, f"{where}, sources[{i}]")
        require(source, "len", int, f"{where}, sources[{i}]", minimum=0, default=None)
    schedule = require(mix, "schedule", list, where)
    targets = require(mix, "targets", list, where)
    for i, entry in enumerate(schedule):
        if not (
            isinstance(entry, list)
            and len(entry) == 2
            and _is_int(entry[0])
            and 0 <= entry[0] <= INT64_MAX
            and _weights(entry[1])
        ):
            raise LogCorrupted(f"{where}: schedule[{i}] is {entry!r}, not [start, weights]")
    if len(targets) != len(schedule) or not all(_weights(t) for t in targets):
        raise LogCorrupted(f"{where}: field 'targets' is not one map of shares per schedule entry")
    return dict(mix)


def _weights(value: Any) -> bool:
    """Whether ``value`` is a map of source names to numbers."""
    return isinstance(value, dict) and all(
        isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool)
        for k, v in value.items()
    )


SEED_MAX = (1 << 64) - 1
"""The largest seed a run may have (``torch.manual_seed``'s); the smallest is -2**63."""

# Config keys that, when present, hold a number (never null), and their smallest value.
_RUN_REQUIRED: dict[str, int | None] = {"dataset_len": 0, "batch_size": 1, "seed": None}

# Config keys readers rely on, with their types (checked when present).
_RUN_CONFIG: dict[str, type | tuple[type, ...]] = {
    "dataset_len": int,
    "seed": int,
    "batch_size": int,
    "shuffle": bool,
    "drop_last": bool,
    "world_size": int,
    "order": str,
    "per_sample_rng": bool,
    "source": list,
}


def _runs_below(store: Store, limit: int = 64) -> list[str]:
    """Directories directly under the root that hold a run (at most the first ``limit``
    entries are looked at, so a mistyped root with many children stays cheap)."""
    try:
        names = store.ls("")[:limit]
    except LedgerError:
        return []
    return [name for name in names if store.exists(f"{name}/{RUN_FILE}")][:3]


# ---------------------------------------------------------------- attempts

ATTEMPT_NAME = re.compile(r"^[0-9]{1,9}\.json$")
"""Names of attempt records under ``attempts/``; other files there are ignored."""


def read_attempt(store: Store, name: str) -> dict[str, Any]:
    """Read and check the attempt record ``attempts/<name>``.

    Returns:
        Its fields: ``attempt`` (int), ``parent`` (str or None), ``world_size`` (int),
        ``created_at`` (str or None), ``host`` (str or None), ``pid`` (int or None),
        ``phase`` (dict or None), ``run_sha256`` (the SHA-256 of ``run.json`` when the
        attempt began; None in records written before it was recorded).

    Raises:
        LogCorrupted: naming the file and the field, if it is not a valid record.
        FileNotFoundError: if it does not exist.
    """
    rel = f"attempts/{name}"
    where = store.full(rel)
    a = _load(store, rel)
    attempt = require(a, "attempt", int, where, minimum=0)
    if ATTEMPT_NAME.match(name) and int(name[: -len(".json")]) != attempt:
        raise LogCorrupted(f"{where}: field 'attempt' is {attempt}, its name says otherwise")
    return {
        "attempt": attempt,
        "parent": require(a, "parent", str, where, nullable=True),
        "world_size": require(a, "world_size", int, where, minimum=1),
        "created_at": require(a, "created_at", str, where, default=None, nullable=True),
        "host": require(a, "host", str, where, default=None, nullable=True),
        "pid": require(a, "pid", int, where, default=None, nullable=True),
        "phase": _phase(a.get("phase"), where),
        "run_sha256": sha256_hex(a, "run_sha256", where) if "run_sha256" in a else None,
    }


def _phase(phase: Any, where: str) -> dict[str, Any] | None:
    """An attempt record's ``phase`` (see :func:`claim_attempt`), checked."""
    if phase is None:
        return None
    if not isinstance(phase, dict):
        raise LogCorrupted(f"{where}: field 'phase' is not an object")
    require(phase, "number", int, where, minimum=1)
    require(phase, "start", int, where, minimum=0)
    if not isinstance(phase.get("config"), dict):
        raise LogCorrupted(f"{where}: the phase has no 'config' object")
    if "mixture" in phase["config"]:
        check_mixture(phase["config"]["mixture"], f"{where}, phase, config, mixture")
    base = phase.get("base")
    if not (isinstance(base, list) and all(isinstance(b, int) for b in base)):
        raise LogCorrupted(f"{where}: the phase's 'base' is not a list of integers")
    return phase


def claim_attempt(
    store: Store,
    parent: str | None,
    world_size: int,
    phase: dict[str, Any] | None = None,
    run_sha256: str | None = None,
) -> int:
    """Claim the next attempt number by creating ``attempts/<A>.json`` exclusively.

    Args:
        store: the log root.
        parent: commit the attempt resumes from (``None``: from the start).
        world_size: the attempt's world size.
        phase: the phase the attempt serves, when it is not the run's first: ``number``
            (>= 1), ``config`` (the loader's configuration in the phase), ``start`` (the
            global position where it began), ``base`` (what each mixture source had
            been given before it) and ``previous`` (the same of the phase before).
        run_sha256: the SHA-256 of ``run.json``'s bytes (:func:`run_digest`), recorded so
            that readers can tell a damaged ``run.json`` (:func:`find_run`).

    Returns:
        The attempt number: one more than the largest existing one (0 for a new run).
    """
    names = store.ls("attempts", files=True)
    existing = [int(n[: -len(".json")]) for n in names if ATTEMPT_NAME.match(n)]
    attempt = max(existing, default=-1) + 1
    while True:
        record: dict[str, Any] = {
            "version": SCHEMA_VERSION,
            "attempt": attempt,
            "parent": parent,
            "world_size": world_size,
            "created_at": now_iso(),
            "host": socket.gethostname(),
            "pid": os.getpid(),
        }
        if phase is not None:
            record["phase"] = phase
        if run_sha256 is not None:
            record["run_sha256"] = run_sha256
        try:
            store.create_exclusive(f"attempts/{attempt:04d}.json", _dump(record))
            return attempt
        except CommitConflict:
            attempt += 1  # a concurrent process took it; the next number is ours to try


# ---------------------------------------------------------------- commits


@dataclass(frozen=True, slots=True)
class Commit:
    """A commit marker.

    Attributes:
        id: ``f"{step:012d}-{attempt:04d}"``.
        step: batches consumed by rank 0 along the lineage at the commit.
        attempt: attempt that wrote it.
        parent: id of the previous commit of the lineage, ``None`` for the first.
        world_size: world size of the attempt.
        created_at: ISO 8601 UTC time.
        segments: segments of the events consumed since ``parent``, one per rank with
            events (empty when no batch was consumed).
        states: pipeline state of each rank after the commit (a tuple, or for a
            version-2 marker a :class:`~ledger.ranks.RankTable` that decodes rows lazily).
        ranks: the per-rank table of a version-2 marker (it also names each rank's
            newest segment of the lineage); ``None`` for a version-1 marker, or a commit
            being built without one (:func:`new_commit` gives it one).
        version: marker format version the commit was read from or will be written in.

    The lineage ranges and the manifest reference (:mod:`ledger.manifest`) are properties:
    read from the marker, or computed once when the commit is written.
    """

    id: str
    step: int
    attempt: int
    parent: str | None
    world_size: int
    created_at: str
    segments: Sequence[SegmentRef] = ()
    states: Sequence[PipelineState] = field(default=())
    ranks: RankTable | None = field(default=None, compare=False, repr=False)
    version: int = field(default=SCHEMA_VERSION, compare=False)
    _blob: list[bytes] = field(default_factory=list, compare=False, repr=False)
    _extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def lineage_ranges(self) -> manifest_mod.Ranges | None:
        """The lineage as ``(attempt, first step, last step)`` ranges
        (:mod:`ledger.manifest`); ``None`` for a marker written without them."""
        return self._extra.get("lineage")

    @property
    def planned_skips(self) -> tuple[tuple[int, int, str], ...]:
        """Ranges of batches ``[start, stop)`` to skip when reached, with their reasons
        (:meth:`ledger.DataLoader.skip` with ``steps``): those not yet reached at this
        commit, carried forward by every later commit of the lineage until reached."""
        return tuple(self._extra.get("skips", ()))

    @property
    def manifest(self) -> tuple[str, str] | None:
        """``(path, sha256)`` of the commit's manifest file; ``None`` when its marker
        names none (written before manifests existed)."""
        return self._extra.get("manifest")

    def manifest_bytes(self) -> bytes:
        """The Parquet bytes of the commit's manifest (computed once)."""
        if "manifest_bytes" not in self._extra:
            data = manifest_mod.encode(manifest_mod.table(self))
            self._extra["manifest_bytes"] = data
            self._extra["manifest"] = (manifest_mod.manifest_path(self.id), sha256(data))
        return bytes(self._extra["manifest_bytes"])

    def state(self, rank: int) -> PipelineState:
        """State of ``rank`` after this commit.

        Raises:
            LogCorrupted: if the marker has no state for ``rank``.
        """
        if isinstance(self.states, RankTable):
            if 0 <= rank < len(self.states):
                return self.states[rank]
        else:
            for s in self.states:
                if s.rank == rank:
                    return s
        raise LogCorrupted(f"commit {self.id} records no state for rank {rank}")

    def header(self) -> dict[str, Any]:
        """The marker's scalar fields (what ranks other than 0 receive after a commit)."""
        return {
            "id": self.id,
            "step": self.step,
            "attempt": self.attempt,
            "parent": self.parent,
            "world_size": self.world_size,
            "created_at": self.created_at,
        }

    def table_bytes(self) -> bytes:
        """The Parquet bytes of the per-rank table (computed once, then reused by retries)."""
        if not self._blob:
            if self.ranks is not None:
                rows = self.ranks.rows
            else:
                rows = ranks_mod.build(list(self.states), self.segments, [])
            self._blob.append(ranks_mod.encode(rows))
        return self._blob[0]

    def _shape(self) -> tuple[int, int]:
        if self.ranks is not None:
            return (int(self.ranks.rows.shape[0]), int(self.ranks.rows.shape[1]))
        rows = ranks_mod.build(list(self.states), self.segments, [])
        return (int(rows.shape[0]), int(rows.shape[1]))

    def to_json(self) -> bytes:
        """The version-2 marker: the header plus the references of the rank table and the
        manifest, and the lineage ranges when known."""
        data = self.table_bytes()
        listing = self.manifest_bytes()
        d: dict[str, Any] = {
            **self.header(),
            "version": SCHEMA_VERSION,
            "ranks": {
                "path": ranks_path(self.id),
                "bytes": len(data),
                "sha256": sha256(data),
                "shape": list(self._shape()),
                "encoding": self.ranks.encoding if self.ranks is not None else ranks_mod.ENCODING,
            },
            "manifest": {
                "path": manifest_mod.manifest_path(self.id),
                "bytes": len(listing),
                "sha256": sha256(listing),
            },
        }
        if self.lineage_ranges is not None:
            d["lineage"] = [list(r) for r in self.lineage_ranges]
        if self.planned_skips:
            d["skips"] = [list(r) for r in self.planned_skips]
        return _dump(d)

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "a commit marker") -> Commit:
        """Parse a version-1 marker from JSON (or a commit's header alone: what ranks
        other than 0 receive after a commit).

        Raises:
            LogCorrupted: naming ``where`` and the field, if a field is missing or mangled.
        """
        segs = items(d, "segments", where, default=[])
        states = items(d, "states", where, default=[])
        return cls(
            id=require(d, "id", str, where),
            step=require(d, "step", int, where, minimum=0),
            attempt=require(d, "attempt", int, where, minimum=0),
            parent=require(d, "parent", str, where, nullable=True),
            world_size=require(d, "world_size", int, where, minimum=1),
            created_at=require(d, "created_at", str, where),
            segments=tuple(_segment_ref(s, f"{where}, segment {i}") for i, s in enumerate(segs)),
            states=tuple(
                PipelineState.from_dict(s, f"{where}, state {i}") for i, s in enumerate(states)
            ),
            version=require(d, "version", int, where, default=1),
        )


def _segment_ref(d: Any, where: str) -> SegmentRef:
    return SegmentRef(
        rank=require(d, "rank", int, where, minimum=0),
        path=relative_path(d, "path", where),
        rows=require(d, "rows", int, where, minimum=0),
        bytes=require(d, "bytes", int, where, minimum=0),
        sha256=sha256_hex(d, "sha256", where),
    )


COMMIT_NAME = re.compile(r"^[0-9]+-[0-9]+\.json$")
"""Names of commit markers under ``commits/``; other files there are ignored."""


def new_commit(
    header: dict[str, Any], rows: np.ndarray, parent_ranges: manifest_mod.Ranges | None = None
) -> Commit:
    """A commit to write: ``header`` (``id, step, attempt, parent, world_size,
    created_at``) and its rank table's rows (:func:`ledger.ranks.from_rows` or
    :func:`ledger.ranks.build`). ``parent_ranges``: the parent's lineage ranges when the
    caller has them (else :func:`write_commit` reads the parent's marker)."""
    ranks = RankTable(rows, int(header["attempt"]))
    commit = Commit(**header, segments=_Lazy(ranks.segments), states=ranks, ranks=ranks)
    if parent_ranges is not None or header["parent"] is None:
        commit._extra["lineage"] = manifest_mod.extend(parent_ranges, commit.attempt, commit.step)
    return commit


def commit_from_rows(
    cid: str,
    step: int,
    attempt: int,
    parent: str | None,
    world_size: int,
    created_at: str,
    rows: np.ndarray,
    extra: dict[str, Any],
    head: int = ranks_mod.HEADS[ranks_mod.ENCODING],
) -> Commit:
    """A version-2 commit from its header fields, rank table rows (with ``head`` leading
    columns, :data:`ledger.ranks.HEADS`) and optional marker fields (``manifest``,
    ``lineage``, ``skips``), as a compaction's catalog holds them
    (:func:`ledger.compaction.catalogued`): no dict per commit."""
    ranks = RankTable(rows, attempt, head)
    return Commit(
        cid,
        step,
        attempt,
        parent,
        world_size,
        created_at,
        _Lazy(ranks.segments),
        ranks,
        ranks,
        2,
        [],
        extra,
    )


class _Lazy(Sequence[SegmentRef]):
    """A commit's segments, decoded on first use (rank 0 writes markers it never reads)."""

    def __init__(self, make: Callable[[], tuple[SegmentRef, ...]]) -> None:
        self._make = make
        self._refs: tuple[SegmentRef, ...] | None = None

    def _all(self) -> tuple[SegmentRef, ...]:
        if self._refs is None:
            self._refs = self._make()
        return self._refs

    def __len__(self) -> int:
        return len(self._all())

    def __getitem__(self, i: Any) -> Any:
        return self._all()[i]

    def __iter__(self) -> Iterator[SegmentRef]:
        return iter(self._all())

    def __eq__(self, other: object) -> bool:
        return self._all() == tuple(other) if isinstance(other, Sequence) else NotImplemented

    def __hash__(self) -> int:
        return hash(self._all())

    def __repr__(self) -> str:
        return repr(self._all())


def newest_segments(store: Store, head: Commit, world: int) -> list[SegmentRef | None]:
    """Per rank ``0..world-1``, the newest segment of the lineage of ``head``.

    Reads the head marker only for a version-2 head; walks the lineage for a version-1
    head (whose markers name only their own segments).
    """
    if head.ranks is not None:
        return [head.ranks.newest(r) for r in range(world)]
    found: list[SegmentRef | None] = [None] * world
    missing = set(range(world))
    for c in reversed(lineage(store, head.id, known={head.id: head})):
        for s in c.segments:
            if s.rank in missing and s.rows > 0:
                found[s.rank] = s
                missing.discard(s.rank)
        if not missing:
            break
    return found


def newest_segment(store: Store, head: Commit, rank: int) -> SegmentRef | None:
    """The newest segment of ``rank`` in the lineage of ``head`` (``None``: none).

    O(1) markers for a version-2 head (its table names it); a version-1 head's lineage
    is walked back until a segment of the rank is found.
    """
    if head.ranks is not None:
        return head.ranks.newest(rank)
    return newest_segments(store, head, rank + 1)[rank]


def commit_id(step: int, attempt: int) -> str:
    """Id of the commit of ``attempt`` at ``step``; ids sort by step, then attempt."""
    return f"{step:012d}-{attempt:04d}"


def marker_path(cid: str) -> str:
    """Path of the marker of commit ``cid``, relative to the root."""
    return f"commits/{cid}.json"


def ranks_path(cid: str) -> str:
    """Path of the per-rank table of a version-2 marker, relative to the root: in a
    folder of its own, so that listing ``commits/`` (which commits exist) reads one name
    per commit, not two. Readers follow the path the marker names: logs written before
    hold their rank tables beside the markers (``commits/<id>.ranks``) and read the same."""
    return f"ranks/{cid}.ranks"


def write_commit(store: Store, commit: Commit) -> None:
    """Write the rank table of ``commit``, then create its marker exclusively; only then
    are its segments history.

    Idempotent: writing the same commit again (a retry after a lost reply) succeeds.

    Note:
        A failure between the two writes leaves a rank table that no marker names yet; a
        retry overwrites it with the same bytes, and readers never read it without the
        marker (which names its SHA-256).

    The manifest (:mod:`ledger.manifest`) is written the same way, after the rank table:
    the marker names both with their SHA-256, so both are committed with it. The
    lineage ranges are the parent's extended; a commit built without them reads the
    parent's marker (and, once, walks a lineage written before ranges existed).

    Raises:
        CommitConflict: if a marker with this id and other contents exists already.
        StorageError: if the write fails. On an object store the marker may exist all the
            same (the reply was lost); :func:`marker_landed` tells, and a retry with the
            same ``commit`` succeeds either way.
        LogCorrupted: if the parent's marker (read only for a commit built without its
            parent's lineage ranges) is damaged.
    """
    if commit.lineage_ranges is None:
        commit._extra["lineage"] = _ranges_after(store, commit)
    data = commit.table_bytes()
    store.write_atomic(ranks_path(commit.id), data)
    store.write_atomic(manifest_mod.manifest_path(commit.id), commit.manifest_bytes())
    store.create_exclusive(marker_path(commit.id), commit.to_json())


def lineage_ranges(store: Store, head: Commit) -> manifest_mod.Ranges:
    """The lineage of ``head`` as ranges: its marker's, or computed by walking the chain
    (markers written before ranges existed)."""
    if head.lineage_ranges is not None:
        return head.lineage_ranges
    ranges: manifest_mod.Ranges | None = None
    for c in lineage(store, head.id, known={head.id: head}):
        ranges = manifest_mod.extend(ranges, c.attempt, c.step)
    assert ranges is not None
    return ranges


def _ranges_after(store: Store, commit: Commit) -> manifest_mod.Ranges:
    """The lineage ranges of ``commit``, from its parent's marker."""
    if commit.parent is None:
        return manifest_mod.extend(None, commit.attempt, commit.step)
    parent = read_commit(store, commit.parent)
    return manifest_mod.extend(lineage_ranges(store, parent), commit.attempt, commit.step)


def marker_landed(store: Store, commit: Commit) -> bool:
    """Whether the marker of ``commit`` exists with exactly this content.

    After a failed :func:`write_commit` the marker may exist all the same (the server
    stored it and the reply was lost): this tells the two apart. The content includes
    ``created_at``, so another writer's marker with the same id never compares equal.

    Raises:
        StorageError: if the storage cannot be read.
    """
    try:
        return store.read_bytes(marker_path(commit.id)) == commit.to_json()
    except FileNotFoundError:
        return False


_PARSED: contextvars.ContextVar[dict[tuple[str, str], Commit] | None] = contextvars.ContextVar(
    "ledger_parsed_markers", default=None
)


_SCOPE: contextvars.ContextVar[dict[Any, Any] | None] = contextvars.ContextVar(
    "ledger_command_cache", default=None
)


@contextlib.contextmanager
def no_cycles() -> Iterator[None]:
    """Pause Python's cyclic garbage collector while building many acyclic objects (the
    commits, segment references and pieces of a history of 10^4 commits): every few
    hundred new objects it would walk the process's objects, torch's included, which
    cost about a sixth of an audit of a compacted history of 10^4 commits. Reference
    counting still frees everything; collection resumes at the end of the block."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def command_cache() -> dict[Any, Any] | None:
    """A dict living as long as the current :func:`parse_once` block (``None`` outside
    one), for other files that never change once written (compaction pieces)."""
    return _SCOPE.get()


@contextlib.contextmanager
def parse_once() -> Iterator[None]:
    """Within the block, each marker is read and parsed once: later reads of the same
    commit (by :func:`read_commit`, :func:`list_commits`, :func:`lineage`) return the
    parsed :class:`Commit`. Markers are created exclusively and never change, so this is
    safe for one command; each command (CLI or audit entry point) opens its own block,
    so a later command sees markers written since. Nested blocks share the outer one."""
    if _PARSED.get() is not None:
        yield
        return
    token = _PARSED.set({})
    scope = _SCOPE.set({})
    try:
        yield
    finally:
        _SCOPE.reset(scope)
        _PARSED.reset(token)


def parsing_once(fn: F) -> F:
    """Decorator: run ``fn`` inside :func:`parse_once`."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with parse_once():
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


def read_commit(store: Store, cid: str, fetched: Fetched | None = None) -> Commit:
    """Read one commit marker (either version) and, for version 2, its rank table.

    Inside :func:`parse_once`, a marker already read is not read again. ``fetched``: the
    marker's and rank table's bytes when the caller read them already
    (:func:`read_commits`).

    Raises:
        CommitNotFound: if no marker ``cid`` exists under the root, or ``cid`` is not a
            commit id.
        LogCorrupted: if the marker is not JSON, of another version, lacks or mangles a
            field, or names another id; if its rank table is missing, altered (SHA-256)
            or malformed (the message names the file and the field).

    Inside :func:`parse_once`, a marker already read is not read again.
    """
    if not COMMIT_NAME.match(f"{cid}.json"):
        raise CommitNotFound(f"{cid!r} is not a commit id (STEP-ATTEMPT, e.g. 000000000040-0000)")
    parsed = _PARSED.get()
    if parsed is not None and (store.uri, cid) in parsed:
        return parsed[(store.uri, cid)]
    try:
        data = _load(store, marker_path(cid), fetched)
    except FileNotFoundError as e:
        raise CommitNotFound(f"commit {cid} does not exist under {store.uri}") from e
    if data["version"] == 1:
        commit = parse_marker_v1(store, cid, data)
    else:
        commit = parse_marker_v2(store, cid, data, fetched)
    if parsed is not None:
        parsed[(store.uri, cid)] = commit
    return commit


def read_commits(store: Store, cids: Sequence[str]) -> list[Commit]:
    """:func:`read_commit` of each of ``cids``, in order.

    An object store's markers, then their rank tables, are fetched concurrently
    (:meth:`Store.read_many`), 1,024 commits at a time: reading 10^4 commits one file
    after another waited on 2·10^4 round trips (~12 ms each to a local ``rclone serve
    s3``: 4 s for 100 commits). A local root's are read one by one.

    Raises:
        CommitNotFound, LogCorrupted: as :func:`read_commit`, for the first commit in
            ``cids`` that has them.
    """
    if store.is_local:
        return [read_commit(store, cid) for cid in cids]
    parsed = _PARSED.get()
    out: list[Commit] = []
    for lo in range(0, len(cids), _READ_AHEAD):
        chunk = cids[lo : lo + _READ_AHEAD]
        todo = [
            cid
            for cid in chunk
            if COMMIT_NAME.match(f"{cid}.json")
            and (parsed is None or (store.uri, cid) not in parsed)
        ]
        markers = [marker_path(cid) for cid in todo]
        fetched = dict(store.read_ahead(markers) or {})
        tables = []
        for rel in markers:
            data = _peek_json(fetched.get(rel))
            ref = data.get("ranks") if isinstance(data, dict) else None
            path = ref.get("path") if isinstance(ref, dict) else None
            if isinstance(path, str) and _RANKS_PATH.fullmatch(path):
                tables.append(path)  # checked again, field by field, when parsed
        fetched.update(store.read_ahead(tables) or {})
        out += [read_commit(store, cid, fetched) for cid in chunk]
    return out


_READ_AHEAD = 1024
"""Commits whose files :func:`read_commits` fetches at once from an object store."""

_RANKS_PATH = re.compile(r"ranks/[0-9]+-[0-9]+\.ranks")
"""A rank table's path as writers name it: what :func:`read_commits` fetches ahead."""


def _peek_json(raw: bytes | None) -> Any:
    """``raw`` as JSON, or ``None`` (the marker's parse names what is wrong with it)."""
    if raw is None:
        return None
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):
        return None


def parse_marker_v1(store: Store, cid: str, data: dict[str, Any]) -> Commit:
    """A version-1 marker: segments and states inline (JSON), no newest segments.

    Raises:
        LogCorrupted: naming the file and the field, if a field is missing or mangled,
            or the marker names another id.
    """
    where = store.full(marker_path(cid))
    commit = Commit.from_dict(data, where)
    if commit.id != cid:
        raise LogCorrupted(f"{where}: field 'id' is {commit.id!r}, its name says {cid!r}")
    return commit


def commit_ids(store: Store) -> list[str]:
    """Ids of every commit marker under the root, sorted (by step, then attempt); lists
    the ``commits/`` directory, reads no marker."""
    names = store.ls("commits", files=True)
    return [name[: -len(".json")] for name in names if COMMIT_NAME.match(name)]


def resolve_commit(store: Store, text: str) -> str:
    """The id of the commit a user names by its id, its step, or ``STEP-ATTEMPT``.

    ``"40"``, ``"40-1"`` and ``"000000000040-0001"`` name the same commit; a step alone is
    enough when one attempt committed at that step.

    Args:
        store: the log root.
        text: what the user typed.

    Returns:
        The full commit id (``f"{step:012d}-{attempt:04d}"``).

    Raises:
        CommitNotFound: if no commit or several match; the message names the nearest
            commits ("did you mean ...").
    """
    step_s, dash, attempt_s = text.strip().partition("-")
    if not step_s.isdigit() or (dash and not attempt_s.isdigit()):
        raise CommitNotFound(
            f"{text!r} is not a commit id: give STEP, STEP-ATTEMPT or the full id "
            "(e.g. 40, 40-1 or 000000000040-0001)"
        )
    step, attempt = int(step_s), int(attempt_s) if dash else None
    if attempt is not None and store.exists(marker_path(commit_id(step, attempt))):
        return commit_id(step, attempt)
    ids = commit_ids(store)
    parsed = [(int(i[:12]), int(i[13:]), i) for i in ids if len(i) == 17 and i[12] == "-"]
    matches = [i for s, a, i in parsed if s == step and attempt in (None, a)]
    if len(matches) == 1:
        return matches[0]
    if matches:
        raise CommitNotFound(
            f"{len(matches)} commits are at step {step} in {store.uri}: did you mean "
            f"{' or '.join(matches)}?"
        )
    wanted = text if attempt is None else commit_id(step, attempt)
    if not parsed:
        raise CommitNotFound(f"commit {wanted} does not exist: {store.uri} holds no commit")
    nearest = sorted(parsed, key=lambda p: (abs(p[0] - step), p[1] != attempt, p[1]))[:3]
    return_ids = " or ".join(i for _, _, i in sorted(nearest))
    raise CommitNotFound(
        f"commit {wanted} does not exist under {store.uri}: did you mean {return_ids}?"
    )


def parse_marker_v2(
    store: Store, cid: str, data: dict[str, Any], fetched: Fetched | None = None
) -> Commit:
    """A version-2 marker: the header in JSON, the per-rank table in its own file
    (from ``fetched`` when the caller read it already).

    Raises:
        LogCorrupted: naming the file and the field, if a field is missing or mangled,
            the marker names another id, or the rank table is missing, differs from the
            SHA-256 the marker names, or does not decode to the marker's shape.
    """
    where = store.full(marker_path(cid))
    fields = _v2_fields(data, cid)
    if fields is None:  # something is off: the field-by-field checks say what
        fields = _v2_fields_checked(data, cid, where)
    header, path, digest, shape, encoding = fields
    try:
        blob = store.read_known(path, fetched)
    except FileNotFoundError as e:
        raise LogCorrupted(
            f"{store.full(path)}, the rank table of commit {cid}, is missing: restore it"
        ) from e
    if (found := sha256(blob)) != digest:
        raise LogCorrupted(
            f"{store.full(path)} has SHA-256 {found}, but {where} names {digest}: the rank "
            "table was altered"
        )
    table = ranks_mod.decode(blob, shape, header["attempt"], store.full(path), encoding)
    if len(table) != header["world_size"]:
        raise LogCorrupted(
            f"{where}: world size {header['world_size']}, but its rank table holds "
            f"{len(table)} ranks"
        )
    return Commit(
        **header,
        segments=_Lazy(table.segments),
        states=table,
        ranks=table,
        version=2,
        _blob=[blob],
        _extra=_manifest_fields(data, cid, where),
    )


_Fields = tuple[dict[str, Any], str, str, tuple[int, int], str]
"""A version-2 marker's header, and its rank table's path, SHA-256, shape and encoding."""

_HEX64 = re.compile(r"[0-9a-f]{64}")


def _v2_fields(data: dict[str, Any], cid: str) -> _Fields | None:
    """The fields of a well-formed version-2 marker, checked at once (a history is 10^4
    markers; ``ledger verify`` parses each): ``None`` for anything else, which
    :func:`_v2_fields_checked` then names field by field. Accepts no marker that the
    field-by-field checks refuse, and gives the same values."""
    try:
        step, attempt, world = data["step"], data["attempt"], data["world_size"]
        parent, created, ref = data["parent"], data["created_at"], data["ranks"]
        if not (
            data["id"] == cid
            and type(step) is int
            and 0 <= step <= INT64_MAX
            and type(attempt) is int
            and 0 <= attempt <= INT64_MAX
            and type(world) is int
            and 1 <= world <= INT64_MAX
            and (parent is None or type(parent) is str)
            and type(created) is str
            and type(ref) is dict
        ):
            return None
        path, digest, shape = ref["path"], ref["sha256"], ref["shape"]
        if not (
            type(path) is str
            and path
            and not path.startswith("/")
            and "\\" not in path
            and ".." not in (parts := path.split("/"))
            and "" not in parts
            and type(digest) is str
            and _HEX64.fullmatch(digest)
            and type(shape) is list
            and len(shape) == 2
            and type(shape[0]) is int
            and type(shape[1]) is int
            and 0 <= shape[0] <= INT64_MAX
            and 0 <= shape[1] <= INT64_MAX
            and ref["encoding"] in ranks_mod.HEADS
        ):
            return None
    except (KeyError, TypeError):  # a field missing, or not an object
        return None
    header = {
        "id": cid,
        "step": step,
        "attempt": attempt,
        "parent": parent,
        "world_size": world,
        "created_at": created,
    }
    return header, path, digest, (shape[0], shape[1]), ref["encoding"]


def _v2_fields_checked(data: dict[str, Any], cid: str, where: str) -> _Fields:
    """:func:`_v2_fields`, each field checked on its own.

    Raises:
        LogCorrupted: naming ``where`` and the first field that is missing or mangled.
    """
    header = {
        "id": require(data, "id", str, where),
        "step": require(data, "step", int, where, minimum=0),
        "attempt": require(data, "attempt", int, where, minimum=0),
        "parent": require(data, "parent", str, where, nullable=True),
        "world_size": require(data, "world_size", int, where, minimum=1),
        "created_at": require(data, "created_at", str, where),
    }
    if header["id"] != cid:
        raise LogCorrupted(f"{where}: field 'id' is {header['id']!r}, its name says {cid!r}")
    ref = obj(require(data, "ranks", dict, where), f"{where}, field 'ranks'")
    inner = f"{where}, field 'ranks'"
    path = relative_path(ref, "path", inner)
    digest = sha256_hex(ref, "sha256", inner)
    shape = items(ref, "shape", inner)
    if len(shape) != 2 or not all(_is_int(x) and 0 <= x <= INT64_MAX for x in shape):
        raise LogCorrupted(f"{inner}: 'shape' is {shape!r}, not two integers")
    encoding = require(ref, "encoding", str, inner)
    if encoding not in ranks_mod.HEADS:
        raise LogCorrupted(
            f"{inner}: encoding {encoding!r} is not one of {sorted(ranks_mod.HEADS)!r}"
        )
    return header, path, digest, (shape[0], shape[1]), encoding


def _usual_fields(data: dict[str, Any], cid: str) -> dict[str, Any] | None:
    """:func:`_manifest_fields` of a marker whose ``manifest`` and ``lineage`` fields are
    well-formed and that plans no skips, checked at once; ``None`` for any other, which
    :func:`_manifest_fields` then checks field by field (same values, its messages)."""
    extra: dict[str, Any] = {}
    if "skips" in data:
        return None
    if "manifest" in data:
        ref = data["manifest"]
        if type(ref) is not dict:
            return None
        path, digest, size = ref.get("path"), ref.get("sha256"), ref.get("bytes")
        if path != manifest_mod.manifest_path(cid) or type(digest) is not str:
            return None
        if type(size) is not int or not 0 <= size <= INT64_MAX:
            return None
        if not _HEX64.fullmatch(digest):
            return None
        extra["manifest"] = (path, digest)
    if "lineage" in data:
        lineage = data["lineage"]
        if type(lineage) is not list or not lineage:
            return None
        ranges = []
        for r in lineage:
            if type(r) is not list or len(r) != 3:
                return None
            a, b, c = r
            if not (type(a) is int and type(b) is int and type(c) is int):
                return None
            if not (0 <= a <= INT64_MAX and 0 <= b <= INT64_MAX and 0 <= c <= INT64_MAX):
                return None
            ranges.append((a, b, c))
        extra["lineage"] = tuple(ranges)
    return extra


def _manifest_fields(data: dict[str, Any], cid: str, where: str) -> dict[str, Any]:
    """The optional ``manifest``, ``lineage`` and ``skips`` fields of a version-2 marker."""
    extra = _usual_fields(data, cid)
    return _extra_fields_checked(data, cid, where) if extra is None else extra


def _extra_fields_checked(data: dict[str, Any], cid: str, where: str) -> dict[str, Any]:
    """:func:`_manifest_fields`, each field checked on its own.

    Raises:
        LogCorrupted: naming ``where`` and the first field that is mangled.
    """
    extra: dict[str, Any] = {}
    if "manifest" in data:
        ref = obj(data["manifest"], f"{where}, field 'manifest'")
        inner = f"{where}, field 'manifest'"
        path = relative_path(ref, "path", inner)
        if path != manifest_mod.manifest_path(cid):
            raise LogCorrupted(f"{inner}: path {path!r} is not {manifest_mod.manifest_path(cid)}")
        require(ref, "bytes", int, inner, minimum=0)
        extra["manifest"] = (path, sha256_hex(ref, "sha256", inner))
    if "lineage" in data:
        ranges = []
        for r in items(data, "lineage", where):
            if not (
                isinstance(r, list)
                and len(r) == 3
                and all(_is_int(v) and 0 <= v <= INT64_MAX for v in r)
            ):
                raise LogCorrupted(f"{where}: field 'lineage' holds {r!r}, not 3 integers")
            ranges.append((r[0], r[1], r[2]))
        if not ranges:
            raise LogCorrupted(f"{where}: field 'lineage' is empty")
        extra["lineage"] = tuple(ranges)
    if "skips" in data:
        planned = []
        for r in items(data, "skips", where):
            if not (
                isinstance(r, list)
                and len(r) == 3
                and _is_int(r[0])
                and _is_int(r[1])
                and 0 <= r[0] < r[1]
                and isinstance(r[2], str)
            ):
                raise LogCorrupted(
                    f"{where}: field 'skips' holds {r!r}, not [start, stop, reason] with "
                    "0 <= start < stop"
                )
            planned.append((r[0], r[1], r[2]))
        extra["skips"] = tuple(planned)
    return extra


def list_commits(store: Store, *, catalog: bool = True) -> list[Commit]:
    """Every commit marker under the root, sorted by (attempt, step).

    Files under ``commits/`` whose names are not commit ids are ignored. The listing of
    ``commits/`` says which commits exist; a commit that a compaction's catalog holds
    (:func:`ledger.compaction.catalogued`) is taken from it instead of its marker and
    rank table (the same contents: markers never change), so a compacted history costs
    one file, not two per commit.

    Inside :func:`parse_once`, the root is listed once: later calls of the same command
    return the same commits (markers written meanwhile are left to the next command).

    Args:
        store: the log root.
        catalog: ``False`` reads every marker itself (``ledger verify``).

    Raises:
        LogCorrupted: if a marker is damaged (see :func:`read_commit`), or a catalog.
    """
    cache = _SCOPE.get()
    key = ("list_commits", store.uri, catalog)
    if cache is not None and key in cache:  # one listing per command: one snapshot
        return list(cache[key])
    known: dict[str, Commit] = {}
    if catalog:
        from ledger.compaction import catalogued  # compaction imports this module

        known = catalogued(store)
    with no_cycles():
        names = _commit_names(store.ls("commits", files=True))
        read = iter(read_commits(store, [cid for cid in names if cid not in known]))
        out = [known.get(cid) or next(read) for cid in names]
    out.sort(key=operator.attrgetter("attempt", "step"))
    if cache is not None:
        cache[key] = tuple(out)
    return out


_COMMIT_IDS = re.compile(r"^([0-9]+-[0-9]+)\.json$", re.MULTILINE)


def _commit_names(names: list[str]) -> list[str]:
    """The commit ids among file names (those :data:`COMMIT_NAME` matches), by one
    regular-expression pass over all of them (10^4 commits: 10^4 names, twice as many
    in logs written before rank tables moved to ``ranks/``)."""
    joined = "\n".join(names)
    if joined.count("\n") == max(len(names) - 1, 0):  # no name holds a line break
        return _COMMIT_IDS.findall(joined)
    return [n[: -len(".json")] for n in names if COMMIT_NAME.match(n)]


def default_head(commits: list[Commit]) -> Commit | None:
    """The newest commit (largest step) of the newest attempt that has commits."""
    return max(commits, key=lambda c: (c.attempt, c.step), default=None)


def lineage(
    store: Store, head: str, known: dict[str, Commit] | None = None, *, checked: bool = True
) -> list[Commit]:
    """The chain of commits from the first one to ``head`` (inclusive), oldest first.

    Args:
        store: the log root.
        head: id of the head commit.
        known: already-read markers by id (avoids re-reading them).
        checked: compare the chain with the lineage ranges the head's marker records
            (:func:`ledger.manifest.check_chain`); ``False`` for ``ledger verify``, which
            reports a mismatch as a failed check of its own.

    Raises:
        CommitNotFound: if ``head`` does not exist.
        LogCorrupted: if a parent named by a marker is missing, the chain loops, or
            (``checked``) it is not the lineage the head's marker records.
    """
    known = dict(known or {})
    chain: list[Commit] = []
    seen: set[str] = set()
    cid: str | None = head
    while cid is not None:
        if cid in seen:
            raise LogCorrupted(f"commit chain loops at {cid}")
        seen.add(cid)
        if cid not in known:
            try:
                known[cid] = read_commit(store, cid)
            except CommitNotFound as e:
                if chain:
                    raise LogCorrupted(
                        f"commit {chain[-1].id} names parent {cid}, which does not exist"
                    ) from e
                raise
        chain.append(known[cid])
        cid = known[cid].parent
    chain.reverse()
    if checked:
        manifest_mod.check_chain(
            head, chain[-1].lineage_ranges, [c.attempt for c in chain], [c.step for c in chain]
        )
    return chain
