"""Pass/fail checks over a log: the named audits of ``ledger audit --check`` and
``ledger verify``, for gating a pipeline on the log's health.

Each check returns a :class:`CheckResult`; ``ok`` is ``False`` when the log shows the
problem the check is named after.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ledger import manifest
from ledger.audit.names import ALL_CHECKS, CHECKS
from ledger.audit.scan import Progress, ScanResult, scan_segments, segment_jobs
from ledger.commits import (
    ATTEMPT_NAME,
    Commit,
    default_head,
    lineage,
    list_commits,
    no_cycles,
    parsing_once,
    read_attempt,
    read_commit,
    read_run,
    run_changed,
    run_digest,
)
from ledger.compaction import catalogued
from ledger.errors import LogCorrupted
from ledger.history import read_history
from ledger.segments import orphans
from ledger.store import Store
from ledger.stream.source import row_group_records

if TYPE_CHECKING:  # imported where used: ``ledger verify`` needs none of them, and DuckDB,
    # pyarrow's datasets and pandas (which the views import) take ~0.5 s to import
    import duckdb

    from ledger.audit.summary import Summary


@dataclass(frozen=True, slots=True)
class CheckResult:
    """The outcome of one check.

    Attributes:
        check: the check's name.
        ok: ``True`` when the log passes it.
        detail: one line: what was found (the failing epochs, commits, ranks...).
    """

    check: str
    ok: bool
    detail: str


def _orphans(store: Store, named: pa.Table | None = None) -> list[str]:
    """Segment files no marker names; ``named``: the segments the markers name (a table
    with a ``path`` column; default: every commit's, from the columnar history)."""
    if named is None:
        history = read_history(store)
        if history is None:  # version-1 markers: their references
            return orphans(store, {s.path for c in list_commits(store) for s in c.segments})
        named = history.segments()
    return orphans(store, set(named["path"].to_pylist()))


def _epochs(epochs: list[int]) -> str:
    return ", ".join(str(e) for e in epochs[:10]) + (" ..." if len(epochs) > 10 else "")


@parsing_once
def check(
    root: str,
    names: Sequence[str] = CHECKS,
    *,
    head: str | None = None,
    max_skew: int | None = None,
    allow_uncommitted: int = 0,
    progress: Progress | None = None,
) -> list[CheckResult]:
    """Run the named checks on the lineage of ``head``.

    - ``coverage``: every epoch the head's ranks have all finished holds each sample
      of the dataset, consumed or skipped.
    - ``duplicates``: no sample is consumed twice in one epoch.
    - ``skips``: only ``drop_last`` skips samples, fewer than one global batch per epoch
      (``world_size * batch_size``), and never a sample it also consumed. Batches
      skipped on purpose (``rollback`` events) and bad samples (``error`` events) are on
      the record and named in the detail, not failed.
    - ``abandoned``: no sample was seen by a model that is not in the lineage: no commit
      off the lineage holds samples, no journal holds uncommitted batches, no orphan
      segment exists. Fails after any resume from an older checkpoint than the last
      commit, or any crash: the detail says how much work was lost.
      ``allow_uncommitted`` accepts crash tails: up to that many uncommitted batches per
      attempt.
    - ``progress``: along the lineage each rank's epoch and batch index never go back,
      and its epochs follow one another without a gap.
    - ``skew``: at every commit of the lineage, the ranks of an attempt are within
      ``max_skew`` samples of one another (default: the batch size).
    - ``mixture``: each source of a :class:`ledger.Mixture` got its target share of the
      lineage's samples, within 4 binomial standard deviations
      (:mod:`ledger.audit.mixture`); passes for a run that is not a mixture.

    Args:
        root: the log root.
        names: checks to run, from :data:`~ledger.audit.names.ALL_CHECKS`.
        head: head commit (default: the newest commit of the newest attempt).
        max_skew: the ``skew`` check's limit in samples.
        allow_uncommitted: batches per attempt that the ``abandoned`` check accepts in
            journals past the attempt's last commit (what a killed process consumed after
            its last checkpoint; the checkpoint interval accepts every crash).
        progress: called with ``(segments done, segments in all)`` during the scan.

    Returns:
        One result per name, in the order given. A damaged log (a marker, segment,
        journal or ``run.json`` that does not check, see :func:`ledger.audit.summarize`)
        fails every check, the detail naming the file.

    Raises:
        ValueError: if a name is not in :data:`~ledger.audit.names.ALL_CHECKS`.
        CommitNotFound: if ``root`` holds no run, or ``head`` names no commit.
    """
    from ledger.audit.mixture import check_mixture
    from ledger.audit.summary import summarize
    from ledger.audit.views import connect

    unknown = [n for n in names if n not in ALL_CHECKS]
    if unknown:
        raise ValueError(f"unknown check {unknown[0]!r}; the checks are {', '.join(ALL_CHECKS)}")
    store = Store(root)
    try:
        config = read_run(store)["config"]
        summary = summarize(root, head, progress)
    except LogCorrupted as e:  # a gate fails on a damaged log; it does not crash
        return [CheckResult(name, False, f"not checked, the log is damaged: {e}") for name in names]
    con = connect(root, summary.head)
    try:
        config = loosest(store, [a.attempt for a in summary.attempts], config)
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
                results.append(_progress(con))
            elif name == "mixture":
                results.append(CheckResult(name, *check_mixture(store, con, config)))
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
    finally:
        con.close()


def loosest(store: Store, attempts: Sequence[int], config: dict) -> dict:
    """``run.json``'s configuration with the largest batch size and ``drop_last`` of any
    phase the run's ``attempts`` served (``load_state_dict(new_phase=True)``): the limits
    of the ``skew`` and ``skips`` checks hold for every phase (as their world size is the
    largest of any attempt)."""
    configs = [config]
    for a in attempts:
        try:
            phase = read_attempt(store, f"{int(a):04d}.json")["phase"]
        except FileNotFoundError:
            continue
        if phase is not None:
            configs.append(phase["config"])
    if len(configs) == 1:
        return config
    return {
        **config,
        "batch_size": max(int(c.get("batch_size", 1)) for c in configs),
        "drop_last": any(bool(c.get("drop_last")) for c in configs),
    }


def coverage(s: Summary) -> CheckResult:
    """The ``coverage`` check on a summary: every finished epoch
    (:func:`ledger.audit.summary.finished_epochs`) holds every sample, consumed or skipped."""
    from ledger.audit.summary import finished_epochs, uncovered_epochs

    finished = finished_epochs(s)
    covered = {e.epoch: e for e in s.epochs}
    bad = uncovered_epochs(s)
    if bad:
        detail = "; ".join(
            f"epoch {e}: {s.dataset_len - (covered[e].covered if e in covered else 0)} "
            "samples neither consumed nor skipped"
            for e in bad[:5]
        )
        return CheckResult("coverage", False, detail)
    current = covered.get(finished)
    now = f"; epoch {finished} at {current.coverage:.2%}" if current else ""
    return CheckResult(
        "coverage", True, f"{finished} finished epochs cover all {s.dataset_len} samples{now}"
    )


def duplicates(s: Summary) -> CheckResult:
    """The ``duplicates`` check on a summary: no sample consumed twice in one epoch."""
    bad = [e for e in s.epochs if e.duplicates]
    detail = "; ".join(f"epoch {e.epoch}: {e.duplicates}" for e in bad[:10])
    return CheckResult(
        "duplicates",
        not bad,
        f"duplicate consumptions: {detail}"
        if bad
        else f"no sample consumed twice in {len(s.epochs)} epochs",
    )


def _skips(s: Summary, config: dict) -> CheckResult:
    world = max((r.world_size for r in s.attempts), default=1)
    limit = world * int(config.get("batch_size", 1)) - 1 if config.get("drop_last") else 0
    over = [e for e in s.epochs if e.skipped > limit]
    both = [e for e in s.epochs if e.skipped_distinct + e.distinct > e.covered]
    if over or both:
        parts = [f"epoch {e.epoch}: {e.skipped} skipped (limit {limit})" for e in over[:5]]
        parts += [
            f"epoch {e.epoch}: {e.skipped_distinct + e.distinct - e.covered} samples both "
            "skipped and consumed"
            for e in both[:5]
        ]
        return CheckResult("skips", False, "; ".join(parts))
    total = sum(e.skipped for e in s.epochs)
    detail = f"{total} samples skipped, at most {limit} per epoch"
    if s.skipped_batches:  # on purpose, on the record: listed, not failed
        batches = sum(r.last - r.first + 1 for r in s.skipped_batches)
        reasons = "; ".join(dict.fromkeys(r.reason for r in s.skipped_batches))
        detail += f"; {batches} batches skipped on purpose ({reasons})"
    errors = sum(e.errors for e in s.epochs)
    if errors:
        detail += f"; {errors} bad samples left out (see the summary)"
    return CheckResult("skips", True, detail)


def _abandoned(store: Store, s: Summary, allow_uncommitted: int = 0) -> CheckResult:
    tails = [a for a in s.attempts if 0 < a.uncommitted_batches <= allow_uncommitted]
    over = [a for a in s.attempts if a.uncommitted_batches > allow_uncommitted]
    lost = sum(a.uncommitted_samples for a in over)
    lost_batches = sum(a.uncommitted_batches for a in over)
    orphaned = _orphans(store)
    parts = []
    if s.abandoned_samples:
        parts.append(
            f"{s.abandoned_commits} commits off the lineage hold {s.abandoned_samples} samples"
        )
    if lost_batches:
        where = ", ".join(str(a.attempt) for a in over[:5])
        limit = f" (over the {allow_uncommitted} allowed)" if allow_uncommitted else ""
        parts.append(
            f"journals hold {lost_batches} uncommitted batches ({lost} samples) in "
            f"attempt(s) {where}{limit}"
        )
    if orphaned:
        parts.append(f"{len(orphaned)} orphan segments ({orphaned[0]} ...)")
    if parts:
        return CheckResult("abandoned", False, "; ".join(parts))
    if tails:
        batches = sum(a.uncommitted_batches for a in tails)
        return CheckResult(
            "abandoned",
            True,
            f"every committed sample is in the lineage; {len(tails)} crash tails of "
            f"{batches} uncommitted batches accepted (at most {allow_uncommitted} per attempt)",
        )
    return CheckResult("abandoned", True, "every sample a model saw is in the lineage")


def _progress(con: duckdb.DuckDBPyConnection) -> CheckResult:
    rows = con.execute(
        """
        WITH per AS (
            SELECT s.rank, c.step, c.attempt, c.commit_id, s.epoch, s.batch,
                   lag(s.epoch) OVER w AS prev_epoch, lag(s.batch) OVER w AS prev_batch
            FROM states AS s JOIN commits AS c USING (commit_id)
            WHERE c.in_lineage
            WINDOW w AS (PARTITION BY s.rank ORDER BY c.step, c.attempt)
        )
        SELECT rank, commit_id, prev_epoch, epoch, prev_batch, batch FROM per
        WHERE epoch < prev_epoch OR batch < prev_batch OR epoch > prev_epoch + 1
        ORDER BY step, attempt, rank LIMIT 5
        """
    ).fetchall()
    if rows:
        detail = "; ".join(
            f"rank {r} at {c}: epoch {pe} -> {e}, batch {pb} -> {b}" for r, c, pe, e, pb, b in rows
        )
        return CheckResult("progress", False, detail)
    head = con.execute(
        """
        SELECT count(*), min(s.epoch), max(s.epoch), min(s.batch), max(s.batch)
        FROM states AS s JOIN commits AS c USING (commit_id) WHERE c.is_head
        """
    ).fetchone()
    assert head is not None
    n, e0, e1, b0, b1 = head
    if not n:
        return CheckResult("progress", True, "no commit yet")
    epochs = f"epoch {e0}" if e0 == e1 else f"epochs {e0}-{e1}"
    batches = f"batch {b0}" if b0 == b1 else f"batches {b0}-{b1}"
    return CheckResult("progress", True, f"{n} ranks at {epochs}, {batches}; none went back")


# ---------------------------------------------------------------- verify


@dataclass(frozen=True, slots=True)
class Verification:
    """What :func:`verify` checked.

    Attributes:
        results: one per check: ``markers``, ``chain``, ``segments``, ``duplicates``,
            ``orphans`` (orphans are reported, not failures: replay ignores them),
            ``manifest``, and ``rowgroups`` for a log with row-group digest records.
        segments: segment files checked.
        events: rows in them.
        bytes: their total size (bytes).
    """

    results: tuple[CheckResult, ...]
    segments: int
    events: int
    bytes: int

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.results)


@parsing_once
def _check_attempts(store: Store, commits: list[Commit]) -> list[str]:
    """Every attempt record parses and names the SHA-256 ``run.json`` has (if it names
    one); the ones whose parent is no commit of the log, and the attempts that committed
    without a record.

    A loader claims its attempt's record (:func:`ledger.commits.claim_attempt`) before it
    writes anything, so an attempt with commits and no record lost it afterwards: the
    audit's ``attempts`` table would then not say which commit the attempt resumed from.

    Returns:
        One problem per attempt record that resumed from a commit without a marker, and
        per attempt with commits but no record (findings of the ``chain`` check, beside
        the commits whose parent is missing).

    Raises:
        LogCorrupted: naming the record and the field, if one does not parse, or naming
            ``run.json`` and the record, if they disagree.
    """
    ids = {c.id for c in commits}
    problems = []
    recorded: set[int] = set()
    digest = run_digest(store)
    for name in store.ls("attempts", files=True):
        if not ATTEMPT_NAME.match(name):
            continue  # a stray file, ignored by every reader
        try:
            record = read_attempt(store, name)
        except FileNotFoundError:
            continue  # removed since the listing
        if record["run_sha256"] not in (None, digest):
            raise run_changed(store, f"attempts/{name}")
        parent = record["parent"]
        recorded.add(int(name[: -len(".json")]))
        if parent is not None and parent not in ids:
            problems.append(
                f"{store.full(f'attempts/{name}')}: field 'parent' is {parent!r}, which no "
                "commit marker is: the attempt resumed from a commit the log no longer has"
            )
    unrecorded: dict[int, list[str]] = {}
    for c in commits:
        if c.attempt not in recorded:
            unrecorded.setdefault(c.attempt, []).append(c.id)
    for attempt, made in sorted(unrecorded.items()):
        problems.append(
            f"attempt {attempt} made {len(made)} commit{'s' if len(made) > 1 else ''} "
            f"({', '.join(sorted(made)[:2])}"
            f"{', ...' if len(made) > 2 else ''}) but its record "
            f"{store.full(f'attempts/{attempt:04d}.json')} is missing: it was removed after "
            "the attempt began"
        )
    return problems


def verify(root: str, progress: Progress | None = None) -> Verification:
    """Check the log's integrity: markers, commit chain, every segment, duplicates.

    - ``markers``: every commit marker, attempt record and ``run.json`` parse.
    - ``chain``: every parent exists (a commit's and an attempt record's), no chain
      loops, a child's step is not below its parent's, every rank of the world size has
      a state, every attempt that committed has its record.
    - ``segments``: every segment a marker names exists, has the marker's size, SHA-256
      and row count, is a readable Parquet file with the event schema, and holds only
      its own attempt and rank (Parquet statistics).
    - ``duplicates``: no sample consumed twice in an epoch of the default head's lineage.
    - ``orphans``: segment files no marker names (reported; replay ignores them).
    - ``manifest``: every manifest file a marker names (:mod:`ledger.manifest`) has the
      SHA-256 the marker names (hashed, not decoded), and the heads' manifests hold the
      rows of their markers' rank tables (decoded); every marker's lineage
      ranges extend its parent's; each attempt commits along one chain.
    - ``rowgroups`` (a log with records of a stream's Parquet shards only): every
      row-group digest record (``data/rowgroups/``) holds a digest of its algorithm (an
      empty one, which a power loss can leave, is reported and passes: the next read
      records it again).

    Args:
        root: the log root.
        progress: called with ``(segments done, segments in all)`` while hashing.

    Returns:
        The results; ``ok`` is ``False`` if any check failed.

    Raises:
        CommitNotFound: if ``root`` holds no run.
    """
    # The markers' objects are acyclic and freed by reference counting when this returns;
    # collecting while they are built walked them all again (~0.12 s at 10^4 commits).
    with no_cycles():
        return _verify(Store(root), progress)


def _verify(store: Store, progress: Progress | None) -> Verification:
    results: list[CheckResult] = []
    try:
        config = read_run(store)["config"]
        commits = list_commits(store, catalog=False)  # the markers themselves
        orphaned_attempts = _check_attempts(store, commits)
        differ = _differ_from_catalog(store, commits)
    except LogCorrupted as e:
        return Verification((CheckResult("markers", False, str(e)),), 0, 0, 0)
    results.append(
        CheckResult(
            "markers",
            False,
            f"{len(differ)} commit markers differ from the catalog of a compaction "
            f"({', '.join(differ[:3])})",
        )
        if differ
        else CheckResult("markers", True, f"{len(commits)} commit markers parse")
    )
    chained, walkable = _chain(commits, orphaned_attempts)
    results.append(chained)
    # One pass over the segments: each is read once, checked against its marker, and
    # (in the default head's lineage) counted for the duplicates check.
    chain: set[str] = set()
    head = default_head(commits)
    if walkable and head is not None:
        chain = {
            c.id for c in lineage(store, head.id, known={c.id: c for c in commits}, checked=False)
        }
    by_step = sorted(commits, key=lambda c: (c.step, c.attempt))
    counted = [c for c in by_step if c.id in chain]
    other = [c for c in by_step if c.id not in chain]
    problems: dict[int, str] = {}
    scanned: ScanResult | None = None
    jobs = segment_jobs(counted, other)
    try:
        scanned = scan_segments(
            store,
            jobs,
            dataset_len=int(config.get("dataset_len") or 0),
            packed=bool(config.get("packer")),
            progress=progress,
            problems=problems,
            key="position" if "mixture" in config else "sample_id",  # see summary.counts
            positions=False,
        )
        # In the words and order of the markers (by attempt, then step, then rank).
        key = {name: jobs[name].to_numpy() for name in ("attempt", "step", "rank")}
        order = sorted(problems, key=lambda i: (key["attempt"][i], key["step"][i], key["rank"][i]))
        bad = [problems[i] for i in order]
    except LogCorrupted as e:  # two markers name one segment
        bad = [str(e)]
    segments = jobs.num_rows
    events = int(pc.sum(jobs["rows"]).as_py() or 0)
    nbytes = int(pc.sum(jobs["bytes"]).as_py() or 0)
    results.append(
        CheckResult("segments", False, f"{len(bad)} bad: " + "; ".join(bad[:3]))
        if bad
        else CheckResult(
            "segments", True, f"{segments} segments match their markers ({events} events)"
        )
    )
    if walkable and not bad and scanned is not None:
        results.append(_duplicates(scanned))
    else:
        results.append(CheckResult("duplicates", False, "not checked: the log is damaged"))
    orphaned = _orphans(store, jobs)
    results.append(
        CheckResult(
            "orphans",
            True,
            f"{len(orphaned)} orphan segments, ignored by replay ({orphaned[0]} ...)"
            if orphaned
            else "no orphan segments",
        )
    )
    results.append(_manifest(store, commits))
    rowgroups = _row_group_records(store)
    if rowgroups is not None:
        results.append(rowgroups)
    return Verification(tuple(results), segments, events, nbytes)


def _row_group_records(store: Store) -> CheckResult | None:
    """The ``rowgroups`` check: every row-group digest record of a stream's shards holds
    a digest (:func:`ledger.stream.source.row_group_records`); ``None`` for a log that
    has none (no Parquet stream)."""
    records, damaged, empty = row_group_records(store)
    if not records:
        return None
    if damaged:
        return CheckResult("rowgroups", False, f"{len(damaged)} bad: " + "; ".join(damaged[:3]))
    detail = f"{records} row-group digest records hold digests"
    if empty:
        detail += (
            f"; {len(empty)} empty (a power loss after an unsynced write; recorded again at "
            f"the next read: {empty[0]}{' ...' if len(empty) > 1 else ''})"
        )
    return CheckResult("rowgroups", True, detail)


def _manifest(store: Store, commits: list[Commit]) -> CheckResult:
    """The ``manifest`` check: every manifest its marker names matches the marker, and
    every lineage's ranges select exactly its chain (:func:`ledger.manifest.check`)."""
    problems = manifest.check(store, commits)
    if problems:
        return CheckResult("manifest", False, f"{len(problems)} bad: " + "; ".join(problems[:3]))
    named = sum(c.manifest is not None for c in commits)
    older = f"; {len(commits) - named} older markers name none" if named < len(commits) else ""
    return CheckResult(
        "manifest", True, f"{named} manifests match their markers' rank tables{older}"
    )


def verify_data(
    root: str,
    dataset: Any,
    *,
    batches: range | None = None,
    rank: int = 0,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    head: str | None = None,
    progress: Progress | None = None,
) -> CheckResult:
    """The ``data`` check: re-create batches from the dataset and compare their digests.

    Each batch of ``batches`` of ``rank`` in the lineage is re-created with
    :func:`ledger.audit.queries.materialize` (the recorded ids and per-sample seeds) and
    its content digest compared with the one recorded when the model received it. A
    dataset whose content changed since (same length, other bytes) fails it.

    Args:
        root: the log root.
        dataset: the run's dataset, built as for training (map-style or a Stream).
        batches: per-rank batch indexes (default: every committed batch of ``rank``).
        rank: the rank whose batches are re-created.
        collate_fn: the run's collate function (default: torch's ``default_collate``).
        head: head commit (default: the newest commit of the newest attempt).
        progress: called with ``(batches done, batches in all)``.

    Returns:
        The check's result; the detail names the first batches that differ.

    Raises:
        CommitNotFound: if the lineage lacks a batch of the range.
        LogCorrupted: if a segment holding one is damaged.
    """
    from ledger.audit.queries import materialize

    if batches is None:
        store = Store(root)
        commits = list_commits(store)
        top = default_head(commits) if head is None else read_commit(store, head)
        batches = range(top.state(rank).batch if top is not None else 0)
    differ: list[int] = []
    unrecorded = 0
    for done, b in enumerate(batches, 1):
        made = materialize(root, b, dataset, rank=rank, collate_fn=collate_fn, head=head)
        if made.record.digest is None:
            unrecorded += 1
        elif not made.matches:
            differ.append(b)
        if progress is not None:
            progress(done, len(batches))
    if differ:
        shown = ", ".join(str(b) for b in differ[:10]) + (" ..." if len(differ) > 10 else "")
        return CheckResult(
            "data",
            False,
            f"{len(differ)} of {len(batches)} batches of rank {rank} re-created from the "
            f"dataset differ from what the model received: batches {shown}",
        )
    note = f" ({unrecorded} without a recorded digest, not compared)" if unrecorded else ""
    return CheckResult(
        "data",
        True,
        f"{len(batches) - unrecorded} batches of rank {rank} re-created with their "
        f"recorded digests{note}",
    )


def _differ_from_catalog(store: Store, commits: list[Commit]) -> list[str]:
    """Ids of the commits whose marker differs from its copy in a compaction's catalog
    (what the other commands read)."""
    by_id = {c.id: c for c in commits}
    differ = []
    for cid, copy in sorted(catalogued(store).items()):
        marker = by_id.get(cid)
        if marker is None:
            continue  # a deleted marker: the listing, not the catalog, says what exists
        header = (marker.step, marker.attempt, marker.parent, marker.world_size)
        same = header == (copy.step, copy.attempt, copy.parent, copy.world_size)
        same = same and marker.created_at == copy.created_at
        same = same and (marker.manifest, marker.lineage_ranges, marker.planned_skips) == (
            copy.manifest,
            copy.lineage_ranges,
            copy.planned_skips,
        )
        mine, theirs = marker.ranks, copy.ranks
        if not (same and mine and theirs and np.array_equal(mine.rows, theirs.rows)):
            differ.append(cid)
    return differ


def _duplicates(scanned: ScanResult) -> CheckResult:
    if scanned.error:
        return CheckResult("duplicates", False, f"not checked: {scanned.error}")
    dup = [e for e in scanned.epochs.values() if e.duplicates]
    return CheckResult(
        "duplicates",
        not dup,
        "; ".join(f"epoch {e.epoch}: {e.duplicates} duplicates" for e in dup[:5])
        if dup
        else f"no duplicates in {len(scanned.epochs)} epochs of the lineage",
    )


def _chain(commits: list[Commit], attempts: list[str]) -> tuple[CheckResult, bool]:
    """The ``chain`` check of the commits, with ``attempts``' findings added; and whether
    the commits' own chain holds (parents present, no loop: lineages can be walked)."""
    by_id = {c.id: c for c in commits}
    problems = []
    for c in commits:
        if c.parent is not None:
            parent = by_id.get(c.parent)
            if parent is None:
                problems.append(f"{c.id}: parent {c.parent} is missing")
            elif parent.step > c.step:
                problems.append(f"{c.id}: parent {c.parent} is at a later step")
        ranks = [s.rank for s in c.states] if c.ranks is None else list(range(len(c.states)))
        if sorted(ranks) != list(range(c.world_size)):
            problems.append(f"{c.id}: states of ranks {ranks} for world size {c.world_size}")
    # A loop: following parents comes back to a commit. Each commit is walked once
    # (O(C)): a walk stops at a commit an earlier walk finished.
    done: set[str] = set()
    for c in commits:
        path: list[str] = []
        on_path: set[str] = set()
        cur: Commit | None = c
        while cur is not None and cur.id not in done:
            if cur.id in on_path:
                problems.append(f"{c.id}: its chain loops at {cur.id}")
                break
            path.append(cur.id)
            on_path.add(cur.id)
            cur = by_id.get(cur.parent) if cur.parent is not None else None
        done.update(path)
    walkable = not problems
    problems += attempts  # after the commits': a missing marker names its children first
    if problems:
        return CheckResult("chain", False, "; ".join(problems[:3])), walkable
    return CheckResult("chain", True, "every parent exists, steps never go back"), walkable


__all__ = [
    "CHECKS", "CheckResult", "Verification", "check", "coverage", "duplicates", "verify",
    "verify_data",
]  # fmt: skip
