"""The log on a real S3 server (``rclone serve s3``, or ``LEDGER_S3_ENDPOINT``): exact
resume, exclusive creates, commits that fail and are retried, orphans, audits."""

from __future__ import annotations

import csv
import io
import json
import os
import signal
import threading
import time
from dataclasses import replace
from urllib.parse import urlparse

import pytest
from click.testing import CliRunner
from conftest import Augmented
from faultproxy import FaultProxy
from test_sigkill import _effective_stream, _run

import ledger
from ledger.audit import connect, summarize
from ledger.cli import main
from ledger.commits import (
    Commit,
    PipelineState,
    list_commits,
    newest_segments,
    ranks_path,
    write_commit,
)
from ledger.errors import CommitConflict, StorageError
from ledger.manifest import manifest_path
from ledger.segments import orphans
from ledger.store import Store, _precondition_failed
from ledger.testing import assert_resume_exact, batches_equal, take

MARKER_PUT = r"/commits/\d{12}-\d{4}\.json$"  # a marker, not a claim object for one
SEGMENT_PUT = r"/events/attempt(=|%3D)\d+/rank(=|%3D)\d+/seg-\d{12}\.parquet$"  # = is %3D


def _loader(root, storage_options=None, n=23, **kw):
    return ledger.DataLoader(
        Augmented(n),
        batch_size=4,
        shuffle=True,
        seed=5,
        log=root,
        storage_options=storage_options,
        **kw,
    )


def _named(store):
    return {s.path for c in list_commits(store) for s in c.segments}


def test_resume_exact_on_s3(s3):
    root = s3.new_root("resume")
    checked = assert_resume_exact(lambda: _loader(root), batches=9, every=2)
    assert checked == 4
    store = Store(root)
    commits = list_commits(store)
    # 4 checkpoints of the reference run, then each resume starts an attempt and commits
    # at the end of its batches.
    assert [c.step for c in commits if c.attempt == 0] == [2, 4, 6, 8]
    assert orphans(store, _named(store)) == []


def test_resume_exact_on_s3_with_workers(s3):
    root = s3.new_root("workers")
    assert (
        assert_resume_exact(lambda: _loader(root, num_workers=2), batches=7, every=3, resume_at=[3])
        == 1
    )


# ---------------------------------------------------------------------- exclusivity


def test_probe_tells_whether_the_server_enforces_if_none_match(s3):
    store = Store(s3.new_root("probe"))
    key = store.full("k")
    store.fs.pipe_file(key, b"1", mode="create")
    try:
        store.fs.pipe_file(key, b"2", mode="create")
        enforced = False
    except Exception as e:
        enforced = _precondition_failed(e) == 412
    assert store._probe_conditional_put() is enforced
    assert store._exclusive_mode() == ("conditional" if enforced else "claim")


def _modes(store):
    """The exclusivity modes this server can be trusted with."""
    return ["claim", "conditional"] if store._probe_conditional_put() else ["claim"]


def test_exclusive_create_is_idempotent_and_refuses_others(s3):
    base = Store(s3.new_root("excl"))
    for mode in _modes(base):
        store = Store(base.uri, exclusive=mode)
        store.create_exclusive(f"{mode}/a.json", b"mine")
        store.create_exclusive(f"{mode}/a.json", b"mine")  # a retry after a lost reply
        with pytest.raises(CommitConflict, match="another writer created it first"):
            store.create_exclusive(f"{mode}/a.json", b"theirs")
        assert store.read_bytes(f"{mode}/a.json") == b"mine"
        assert store.ls(mode) == ["a.json"]  # no claim or probe object is left in sight


@pytest.mark.parametrize("writers", [2, 6])
def test_racing_writers_of_one_marker_one_wins(s3, writers):
    base = Store(s3.new_root("race"))
    for mode in _modes(base):
        for trial in range(3):
            barrier = threading.Barrier(writers)
            outcome: dict[int, str] = {}
            markers = [
                Commit(f"000000000003-{trial:04d}", 3, trial, None, 1, f"writer {w}")
                for w in range(writers)
            ]

            def write(w, markers=markers, barrier=barrier, outcome=outcome, mode=mode):
                store = Store(base.uri, exclusive=mode)
                barrier.wait()
                try:
                    write_commit(store, markers[w])
                    outcome[w] = "won"
                except CommitConflict:
                    outcome[w] = "conflict"

            threads = [threading.Thread(target=write, args=(w,)) for w in range(writers)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            winners = [w for w, o in outcome.items() if o == "won"]
            assert len(winners) == 1, (mode, outcome)
            assert sorted(outcome.values()) == ["conflict"] * (writers - 1) + ["won"]
            stored = base.read_bytes(f"commits/{markers[0].id}.json")
            assert stored == markers[winners[0]].to_json()


def test_two_writers_claiming_the_same_attempt(s3):
    """Two processes resuming one run at once: each gets its own attempt, never the same;
    a writer that claims an attempt record another created gets CommitConflict."""
    root = s3.new_root("attempts")
    config = {"dataset_len": 4}
    ledgers = [ledger.Ledger(root) for _ in range(4)]
    for lg in ledgers:
        lg.open(config)
    barrier = threading.Barrier(len(ledgers))
    got: list[int] = []

    def start(lg):
        barrier.wait()
        got.append(lg.start(None))

    threads = [threading.Thread(target=start, args=(lg,)) for lg in ledgers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(got) == [0, 1, 2, 3]
    store = Store(root)
    assert store.ls("attempts") == ["0000.json", "0001.json", "0002.json", "0003.json"]
    with pytest.raises(CommitConflict):
        store.create_exclusive("attempts/0002.json", b'{"attempt": 2}')
    # A process that wrongly believes it owns attempt 1 (split brain) cannot commit over
    # the owner's marker.
    owner = next(lg for lg in ledgers if lg.attempt == 1)
    intruder = next(lg for lg in ledgers if lg.attempt == 2)
    intruder.attempt = 1
    assert owner.commit(PipelineState()).id == "000000000000-0001"
    with pytest.raises(CommitConflict):
        intruder.commit(PipelineState())
    assert [c.attempt for c in list_commits(store)] == [1]


def test_a_crashed_creators_claim_delays_but_does_not_block(monkeypatch):
    """Claim mode on an in-memory filesystem: a leftover claim (its creator died between
    claim and create) makes others lose rounds until it is older than the lease; a
    creator then takes it for stale, removes it and creates the file."""
    import ledger.store as store_module

    monkeypatch.setattr(store_module, "CLAIM_LEASE_S", 0.3)
    store = Store(f"memory://claims-{os.getpid()}-{id(monkeypatch)}")
    leftover = store.full("_claims/run.json/crashed")
    store.fs.pipe_file(leftover, b"")
    store.create_exclusive("run.json", b"new run")
    assert store.read_bytes("run.json") == b"new run"
    assert not store.fs.exists(leftover)
    with pytest.raises(CommitConflict):
        store.create_exclusive("run.json", b"another run")


def test_a_leftover_claim_does_not_block_a_creator_whose_listing_is_slow(monkeypatch):
    """A creator whose tries each take 0.4 s of a 1 s lease still outlasts a claim left just
    before it started: its patience (two leases) leaves a try after the claim turned stale
    (with one lease, the try begun at ~0.9 s saw the claim live and ended past patience)."""
    import ledger.store as store_module

    monkeypatch.setattr(store_module, "CLAIM_LEASE_S", 1.0)
    store = Store(f"memory://slow-claims-{os.getpid()}-{id(monkeypatch)}")
    store.fs.pipe_file(store.full("_claims/run.json/crashed"), b"")
    listing = store.fs.ls

    def slow_ls(path, *args, **kwargs):
        time.sleep(0.4)
        return listing(path, *args, **kwargs)

    monkeypatch.setattr(store.fs, "ls", slow_ls)
    store.create_exclusive("run.json", b"new run")
    assert store.read_bytes("run.json") == b"new run"


def test_journal_of_a_remote_root_is_on_local_disk(s3, tmp_path):
    root = s3.new_root("journal")
    lg = ledger.Ledger(root)
    lg.open({"dataset_len": 3})
    lg.start(None)
    assert lg._journal is not None
    bucket, prefix = root[len("s3://") :].split("/", 1)
    expected = tmp_path / "journals" / "s3" / bucket / prefix / "journal/attempt=0/rank=0.msgpack"
    assert lg._journal.path == str(expected) and expected.exists()
    chosen = ledger.Ledger(root, journal_dir=str(tmp_path / "mine"))
    chosen.open({"dataset_len": 3})
    chosen.start(None)
    assert chosen._journal is not None
    assert chosen._journal.path.startswith(str(tmp_path / "mine" / "s3" / bucket))
    assert Store(root).ls("journal") == []  # nothing remote until a later attempt uploads


# ---------------------------------------------------------------------- faults


@pytest.fixture
def proxy(s3_server):
    url = urlparse(s3_server.endpoint)
    p = FaultProxy((url.hostname, url.port))
    yield p
    p.close()


def _through(s3, proxy, attempts=10, read_timeout=1.0):
    """Options for a client that talks to the server through the fault proxy."""
    return s3.storage_options(
        proxy.endpoint,
        retries={"max_attempts": attempts, "mode": "standard"},
        connect_timeout=1,
        read_timeout=read_timeout,
    )


def _sample_ids(store, head=None):
    """Sample ids of the lineage's 'sample' events, in order."""
    con = connect(store.uri, head=head)
    rows = con.sql(
        "SELECT sample_id FROM lineage WHERE kind = 'sample' ORDER BY batch, position"
    ).fetchall()
    return [r[0] for r in rows]


def test_resume_exact_with_faults_injected(s3, proxy):
    root = s3.new_root("chaos")
    options = _through(s3, proxy)
    proxy.delay = 1.5  # above the 1 s read timeout: the client retries, the request lands
    kinds = ("http500", "http503", "drop", "drop_after", "drop_after", "delay")
    proxy.chaos(0.2, seed=3, kinds=kinds)
    assert assert_resume_exact(lambda: _loader(root, options), batches=9, every=2) == 4
    faults = proxy.faults()
    proxy.calm()
    assert len(faults) >= 10 and set(faults) == set(kinds), faults
    store = Store(root)
    assert [c.step for c in list_commits(store) if c.attempt == 0] == [2, 4, 6, 8]
    reference = [b["id"].tolist() for b in take(_loader(s3.new_root("calm")), 9)]
    assert _sample_ids(store, head="000000000008-0000") == [i for b in reference[:8] for i in b]


def test_slowdown_is_retried_with_backoff(s3, proxy):
    root = s3.new_root("slowdown")
    loader = _loader(root, _through(s3, proxy, attempts=4))
    consumed = [b["id"].tolist() for b in take(loader, 2)]
    proxy.inject("slowdown", 2, method="PUT", path=SEGMENT_PUT)
    assert loader.state_dict()["step"] == 2
    assert proxy.faults() == ["slowdown", "slowdown"]
    assert _sample_ids(Store(root)) == [i for b in consumed for i in b]


def test_failed_segment_put_keeps_events_and_the_next_commit_loses_nothing(s3, proxy):
    root = s3.new_root("segfail")
    loader = _loader(root, _through(s3, proxy, attempts=1))
    consumed = [b["id"].tolist() for b in take(loader, 2)]
    proxy.inject("http503", 1000, method="PUT", path=SEGMENT_PUT)
    with pytest.raises(StorageError, match="could not write"):
        loader.state_dict()
    store = Store(root)
    assert list_commits(store) == []
    consumed += [b["id"].tolist() for b in take(loader, 1)]
    proxy.calm()
    token = loader.state_dict()
    assert token["step"] == 3
    assert [c.step for c in list_commits(store)] == [3]
    assert _sample_ids(store) == [i for b in consumed for i in b]
    assert orphans(store, _named(store)) == []


@pytest.mark.parametrize("retry", ["at_once", "after_more_batches"])
def test_marker_put_whose_reply_is_lost_is_neither_lost_nor_duplicated(s3, proxy, retry):
    """The marker PUT lands but every reply is lost: the commit raises; its marker exists.
    Retried at once, the same PUTs succeed; retried later, the marker becomes the head
    and the next commit holds only the batches after it."""
    root = s3.new_root("unknown")
    loader = _loader(root, _through(s3, proxy, attempts=1))
    consumed = [b["id"].tolist() for b in take(loader, 2)]
    proxy.inject("drop_after", 1000, method="PUT", path=MARKER_PUT)
    with pytest.raises(StorageError):
        loader.state_dict()
    assert "drop_after" in proxy.faults()
    store = Store(root)
    assert [c.id for c in list_commits(store)] == ["000000000002-0000"]  # it landed
    proxy.calm()
    if retry == "after_more_batches":
        consumed += [b["id"].tolist() for b in take(loader, 1)]
    token = loader.state_dict()
    commits = list_commits(store)
    if retry == "at_once":
        assert token["commit"] == "000000000002-0000"
        assert [c.id for c in commits] == ["000000000002-0000"]
    else:
        assert token["commit"] == "000000000003-0000"
        assert [(c.id, c.parent) for c in commits] == [
            ("000000000002-0000", None),
            ("000000000003-0000", "000000000002-0000"),
        ]
        per_commit = (
            connect(root)
            .sql(
                "SELECT commit_id, list(sample_id ORDER BY batch, position) FROM events "
                "WHERE kind = 'sample' GROUP BY 1 ORDER BY 1"
            )
            .fetchall()
        )
        assert per_commit == [
            ("000000000002-0000", consumed[0] + consumed[1]),
            ("000000000003-0000", consumed[2]),
        ]
    assert _sample_ids(store) == [i for b in consumed for i in b]
    resumed = _loader(root)
    resumed.load_state_dict(token)
    reference = [b["id"].tolist() for b in take(_loader(s3.new_root("ref")), 5)]
    assert [b["id"].tolist() for b in take(resumed, 5 - len(consumed))] == reference[
        len(consumed) :
    ]


def test_orphan_of_a_crash_between_segment_and_marker_is_ignored(s3, proxy):
    """A process dies after its segment PUT and before its marker: replay from the last
    checkpoint ignores the orphan segment; the stream continues exactly."""
    root = s3.new_root("orphan")
    reference = list(take(_loader(s3.new_root("ref")), 6))
    dying = _loader(root, _through(s3, proxy, attempts=1))
    list(take(dying, 2))
    token = dying.state_dict()
    list(take(dying, 2))
    proxy.inject("http503", 1000, method="PUT", path=MARKER_PUT)
    with pytest.raises(StorageError):
        dying.state_dict()  # the segment is written, the marker never: then it "dies"
    del dying
    store = Store(root)
    assert orphans(store, _named(store)) == ["events/attempt=0/rank=0/seg-000000000004.parquet"]
    resumed = _loader(root)
    resumed.load_state_dict(token)
    rest = list(take(resumed, 4))
    assert all(batches_equal(a, b) for a, b in zip(rest, reference[2:], strict=True))
    resumed.state_dict()
    ids = [b["id"].tolist() for b in reference]
    assert _sample_ids(store) == [i for b in ids for i in b]
    assert orphans(store, _named(store)) == ["events/attempt=0/rank=0/seg-000000000004.parquet"]


# ---------------------------------------------------------------------- SIGKILL


def _lines(path):
    with open(path) as f:
        return [line.split(" ", 1) for line in f]


@pytest.mark.slow
# Inside a commit, its PUTs in flight (line 10, just after one, is the long tier's).
@pytest.mark.parametrize("kill_after_line", [pytest.param(10, marks=pytest.mark.long), 19])
def test_sigkill_on_s3_then_resume_gives_the_uninterrupted_stream(
    s3, tmp_path, sigkill_reference, kill_after_line
):
    """The resumed stream on S3 equals the uninterrupted one (the same loader's, whose
    stream does not depend on the store: ``sigkill_reference``, run on disk)."""
    total = 25
    root = s3.new_root("killed")
    out, ckpt = tmp_path / "run.txt", tmp_path / "ck.json"
    args = [root, str(out), str(ckpt), str(total)]
    assert _run(args, kill_after_line=kill_after_line) == -signal.SIGKILL
    killed = _lines(out)
    assert _run([*args, "--resume"]) == 0
    reference, resumed = sigkill_reference, _effective_stream(out)
    assert len(reference) == len(resumed) == total
    assert [i for i, (a, b) in enumerate(zip(reference, resumed, strict=True)) if a != b] == []
    # The resumed process uploaded the killed one's journal: the audit sees what attempt 0
    # consumed after its last commit (each journaled batch is written to OUT just after).
    store = Store(root)
    last = max(c.step for c in list_commits(store) if c.attempt == 0)
    lost = [
        sorted(json.loads(rest.rsplit(" ", 1)[0])) for step, rest in killed if int(step) >= last
    ]
    rows = (
        connect(root)
        .sql(
            "SELECT batch, list(sample_id ORDER BY sample_id) FROM uncommitted WHERE attempt = 0 "
            "GROUP BY batch ORDER BY batch"
        )
        .fetchall()
    )
    assert [r[0] for r in rows] == list(range(last, last + len(rows)))
    assert len(lost) <= len(rows) <= len(lost) + 1
    assert [r[1] for r in rows[: len(lost)]] == lost
    assert summarize(root).attempts[0].uncommitted_batches == len(rows)
    assert os.listdir(tmp_path / "journals") != []  # attempt 1's own journal stays local


# ---------------------------------------------------------------------- audit


def _scenario(root):
    """Commits at 2 and 4 and 5, then a resume from 2 that commits at 4: an abandoned
    branch of two commits."""
    loader = _loader(root)
    list(take(loader, 2))
    token = loader.state_dict()
    list(take(loader, 2))
    loader.state_dict()
    list(take(loader, 1))
    loader.state_dict()
    resumed = _loader(root)
    resumed.load_state_dict(token)
    list(take(resumed, 2))
    resumed.state_dict()


def test_audit_of_an_s3_root_equals_the_audit_of_the_same_run_on_disk(s3, tmp_path):
    root, local = s3.new_root("audit"), str(tmp_path / "local")
    _scenario(root)
    _scenario(local)
    remote_summary, local_summary = summarize(root), summarize(local)
    assert remote_summary.abandoned_commits == 2
    assert replace(remote_summary, run_id="") == replace(local_summary, run_id="")
    query = (
        "SELECT attempt, epoch, count(*) AS samples, sum(sample_id) AS ids FROM lineage "
        "WHERE kind = 'sample' GROUP BY ALL ORDER BY ALL"
    )
    runner = CliRunner()
    remote = runner.invoke(main, ["audit", root, "--sql", query, "--format", "csv"])
    on_disk = runner.invoke(main, ["audit", local, "--sql", query, "--format", "csv"])
    assert remote.exit_code == 0, remote.output
    assert remote.output == on_disk.output
    assert remote.output.splitlines()[0] == "attempt,epoch,samples,ids"
    assert len(remote.output.splitlines()) == 3  # attempt 0 and attempt 1, epoch 0


def test_a_damaged_s3_root_is_named_as_the_same_damage_on_disk(s3, tmp_path):
    """verify and audit read an object store's markers, rank tables, manifests and
    segments many at a time (Store.read_many): a missing or altered file among them is
    named exactly as it is on a local disk, where they are read one by one."""
    root, local = s3.new_root("damaged"), str(tmp_path / "local")
    stores = [Store(root), Store(local)]
    for store in stores:
        _scenario(store.uri)
        commits = list_commits(store)
        assert len(commits) == 4
        store.fs.rm(store.full(commits[0].segments[0].path))
        store.fs.pipe_file(store.full(commits[2].segments[0].path), b"PAR1 altered PAR1")
        store.fs.rm(store.full(manifest_path(commits[1].id)))
    runner = CliRunner()
    outputs = []
    for store in stores:
        result = runner.invoke(main, ["verify", store.uri, "--format", "csv"])
        assert result.exit_code == 3, result.output
        outputs.append(result.output.replace(store.path, "ROOT"))
    assert outputs[0] == outputs[1]
    checks = {row["check"]: row for row in csv.DictReader(io.StringIO(outputs[0]))}
    assert "is missing" in checks["segments"]["detail"]
    assert "SHA-256" in checks["segments"]["detail"] or "bytes" in checks["segments"]["detail"]
    assert "the manifest of commit" in checks["manifest"]["detail"]
    errors = []
    for store in stores:
        store.fs.rm(store.full(ranks_path(list_commits(store)[3].id)))
        result = runner.invoke(main, ["audit", store.uri])
        assert result.exit_code == 1, result.output
        errors.append(result.stderr.replace(store.path, "ROOT"))
    assert errors[0] == errors[1]
    assert "the rank table of commit" in errors[0] and "is missing" in errors[0]


# ---------------------------------------------------------------------- ranks


@pytest.mark.slow
@pytest.mark.xdist_group("two_rank_reference")  # with test_dist's, which makes it
def test_two_ranks_on_s3_one_killed_between_segment_and_marker(s3, tmp_path, two_rank_reference):
    """torchrun, 2 ranks, collective commits to S3: rank 1 is SIGKILLed after its segment
    PUT of step 9, so no marker for step 9 exists; the resumed job's streams equal those of
    a job that never stopped (``two_rank_reference``, on disk: the stream does not depend
    on the store), and the audit reports the orphans and passes verify."""
    from test_dist import TOTAL, streams, torchrun

    _, ref = two_rank_reference
    run = tmp_path / "run"
    run.mkdir()
    root = s3.new_root("dist")
    rc = torchrun(2, root, str(run), str(TOTAL), "--die-after-segment", "9")
    assert rc != 0
    store = Store(root)
    assert [c.step for c in list_commits(store)] == [3, 6]
    # rank 1's segment of step 9, and rank 0's if it was PUT before torchrun stopped it
    left = orphans(store, _named(store))
    seg9 = [f"events/attempt=0/rank={r}/seg-000000000009.parquet" for r in (0, 1)]
    assert seg9[1] in left and set(left) <= set(seg9)
    assert torchrun(2, root, str(run), str(TOTAL), "--resume") == 0
    assert streams(run, 2) == streams(ref, 2)
    assert [c.id for c in list_commits(store)][-1] == "000000000012-0001"
    runner = CliRunner()
    checks = ["--check", "coverage", "--check", "duplicates", "--check", "skew"]
    checked = runner.invoke(main, ["audit", root, *checks])
    assert checked.exit_code == 0, checked.output
    verified = runner.invoke(main, ["verify", root, "--format", "ndjson"])
    assert verified.exit_code == 0, verified.output
    rows = {r["check"]: r for r in map(json.loads, verified.output.splitlines())}
    assert all(r["ok"] for r in rows.values())
    assert rows["orphans"]["detail"] == (
        f"{len(left)} orphan segments, ignored by replay ({left[0]} ...)"
    )


def test_an_elastic_stream_resume_on_s3_fetches_the_old_ranks_segments_at_once(
    s3, tmp_path, monkeypatch
):
    """A packed stream of 2 ranks (torchrun, on disk) resumed by 1 rank from a copy of its
    log on S3: the new rank needs every old rank's shuffle buffer and fetches the old
    ranks' newest segments in one ``read_many`` (not one GET after another), and serves
    the same batches as the same resume from the log on disk."""
    from conftest import packed_stream, text_shards
    from test_dist import torchrun

    shards = text_shards(tmp_path / "shards", 4, 5, "v", 3)
    log, out = tmp_path / "log", tmp_path / "out"
    out.mkdir()
    assert torchrun(2, str(log), str(out), "6", "--shards", str(shards)) == 0
    token = json.loads((out / "ckpt-0.json").read_text())
    head = list_commits(Store(str(log)))[-1]
    assert head.world_size == 2
    assert all(any(w.rows_read > w.emitted for w in s.workers) for s in head.states)  # buffers
    root = s3.new_root("elastic-stream")
    remote = Store(root)
    for path in sorted(p for p in log.rglob("*") if p.is_file()):
        remote.write_atomic(str(path.relative_to(log)), path.read_bytes())

    def resumed(root):
        loader = ledger.DataLoader(
            packed_stream(str(shards), shuffle_buffer=3), batch_size=2, shuffle=True, seed=5,
            log=root, num_workers=2,
        )  # fmt: skip
        loader.load_state_dict(token)
        return list(take(loader, 8))

    fetched: list[list[str]] = []
    read_many = Store.read_many

    def spy(self, rels):
        if not self.is_local and any("/seg-" in r for r in rels):
            fetched.append(list(rels))
        return read_many(self, rels)

    monkeypatch.setattr(Store, "read_many", spy)
    on_disk = resumed(str(log))
    assert fetched == []  # a local root reads as it goes
    on_s3 = resumed(root)
    assert len(on_s3) == len(on_disk) == 8
    assert all(batches_equal(a, b) for a, b in zip(on_s3, on_disk, strict=True))
    assert fetched == [[ref.path for ref in newest_segments(remote, head, 2)]]
