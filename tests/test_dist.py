"""Real multi-process groups (torchrun, gloo): collective commits, same-shape resume."""

from __future__ import annotations

import json
import os

import conftest
import pytest

from ledger.audit import summarize
from ledger.commits import list_commits
from ledger.store import Store

CHILD = os.path.join(os.path.dirname(__file__), "dist_child.py")
TOTAL = 14


def torchrun(nproc: int, *args: str) -> int:
    """``torchrun --nproc_per_node=NPROC dist_child.py ARGS``: 0, or 1 when a rank failed."""
    return conftest.torchrun(nproc, CHILD, *args)


def streams(out, nproc):
    result = []
    for rank in range(nproc):
        lines = {}
        with open(os.path.join(out, f"stream-{rank}.txt")) as f:
            for line in f:
                step, rest = line.split(" ", 1)
                lines[int(step)] = rest
        result.append([lines[s] for s in sorted(lines)])
    return result


@pytest.mark.parametrize(
    "nproc",
    [
        pytest.param(2, marks=pytest.mark.xdist_group("two_rank_reference")),
        pytest.param(3, marks=pytest.mark.long),  # 3 ranks: also in the elastic tests
    ],
)
def test_collective_commits_and_same_shape_resume(tmp_path, request, nproc):
    if nproc == 2:  # the uninterrupted job test_s3's two-rank test compares with too
        ref_log, ref = request.getfixturevalue("two_rank_reference")
    else:
        ref_log, ref = str(tmp_path / "ref-log"), str(tmp_path / "ref")
        os.mkdir(ref)
        assert torchrun(nproc, ref_log, ref, str(TOTAL)) == 0
    commits = list_commits(Store(ref_log))
    assert [c.step for c in commits] == [3, 6, 9, 12]
    for c in commits:  # one marker per step naming every rank's segment and state
        assert sorted(s.rank for s in c.segments) == list(range(nproc))
        assert [s.rank for s in c.states] == list(range(nproc))
    # 3 batches of 4 per rank in the first commit (61 samples: every rank's batches are
    # full until the last global step of the epoch), each with its digest event
    assert [s.rows for s in commits[0].segments] == [3 * 4 + 3] * nproc
    reference = streams(ref, nproc)
    for rank in range(1, nproc):
        assert reference[rank] != reference[0]  # ranks take different samples

    # The audit's per-rank progress and skew, against the streams the ranks received.
    def ids(line):
        return [int(x) for x in line.split("]")[0][1:].split(",") if x.strip()]

    summary = summarize(ref_log)
    assert [a.world_size for a in summary.attempts] == [nproc]
    committed = [sum(len(ids(line)) for line in reference[r][:12]) for r in range(nproc)]
    assert [r.samples for r in summary.ranks] == committed
    assert [r.behind for r in summary.ranks] == [max(committed) - c for c in committed]
    spreads = []
    for step in (3, 6, 9, 12):
        seen = [sum(len(ids(line)) for line in reference[r][:step]) for r in range(nproc)]
        spreads.append(max(seen) - min(seen))
    assert summary.skew is not None and summary.skew.samples == max(spreads)

    # Rank 1 dies after writing its segment of step 9: no marker for step 9 may exist.
    run = tmp_path / "run"
    run.mkdir()
    log = str(tmp_path / "log")
    rc = torchrun(nproc, log, str(run), str(TOTAL), "--die-after-segment", "9")
    assert rc != 0
    assert [c.step for c in list_commits(Store(log))] == [3, 6]
    orphan = os.path.join(log, "events", "attempt=0", "rank=1", f"seg-{9:012d}.parquet")
    assert os.path.exists(orphan)
    for rank in range(nproc):
        with open(run / f"ckpt-{rank}.json") as f:
            assert json.load(f)["commit"] == "000000000006-0000"
    assert torchrun(nproc, log, str(run), str(TOTAL), "--resume") == 0
    assert streams(run, nproc) == reference
    assert [c.id for c in list_commits(Store(log))][-1] == "000000000012-0001"


@pytest.mark.parametrize(
    "shapes,drop_last",
    [
        # 2 -> 1 -> 3 ranks: the long tier (2 -> 1 -> 2 map-style in test_example_dist and
        # 2 -> 1 -> 3 of a packed stream and of a stream mixture below run in CI)
        pytest.param([(2, 6), (1, 21), (3, 27)], False, marks=pytest.mark.long),
        ([(1, 9), (2, 18), (3, 27)], True),  # 1 -> 2 -> 3 ranks
    ],
)
def test_elastic_resume_consumes_each_sample_once(tmp_path, shapes, drop_last):
    """61 samples, batch 4; (ranks, last step) per shape, each ending on a commit."""
    log = str(tmp_path / "log")
    extra = ["--drop-last"] if drop_last else []
    for i, (nproc, total) in enumerate(shapes):
        out = tmp_path / f"shape{i}"
        out.mkdir()
        resume = ["--resume-from", str(tmp_path / f"shape{i - 1}" / "ckpt-0.json")] if i else []
        assert torchrun(nproc, log, str(out), str(total), *resume, *extra) == 0
    store = Store(log)
    commits = list_commits(store)
    assert [(c.attempt, c.world_size) for c in commits][-1] == (2, 3)
    assert sorted({(c.attempt, c.world_size) for c in commits}) == [
        (i, n) for i, (n, _) in enumerate(shapes)
    ]
    # Ground truth from the streams the ranks received, in the order of the shapes.
    seen = []
    for i, (nproc, _) in enumerate(shapes):
        for rank_stream in streams(tmp_path / f"shape{i}", nproc):
            seen.extend(int(x) for line in rank_stream for x in line.split("]")[0][1:].split(","))
    from ledger.audit import connect

    con = connect(log)
    rows = con.execute(
        "SELECT epoch, count(*), count(DISTINCT sample_id) FROM lineage "
        "WHERE kind = 'sample' GROUP BY 1 ORDER BY 1"
    ).fetchall()
    skips = dict(
        con.execute("SELECT epoch, count(*) FROM lineage WHERE kind = 'skip' GROUP BY 1").fetchall()
    )
    assert sum(n for _, n, _ in rows) == len(seen)
    for epoch, n, distinct in rows:
        assert n == distinct  # exactly once
        if epoch < rows[-1][0]:  # every finished epoch: each sample served or skipped
            assert n + skips.get(epoch, 0) == 61
    assert sorted(seen) == sorted(
        con.execute("SELECT sample_id FROM lineage WHERE kind = 'sample'")
        .fetchnumpy()["sample_id"]
        .tolist()
    )


def test_packed_stream_on_two_ranks_resumes_exactly(tmp_path):
    # 5 shards over 2 ranks x 2 workers: one worker gets two
    shards = conftest.text_shards(tmp_path / "shards", 5, 4, "q", 5)
    extra = ["--shards", str(shards)]
    ref = tmp_path / "ref"
    ref.mkdir()
    assert torchrun(2, str(tmp_path / "ref-log"), str(ref), str(TOTAL), *extra) == 0
    run = tmp_path / "run"
    run.mkdir()
    log = str(tmp_path / "log")
    rc = torchrun(2, log, str(run), str(TOTAL), "--die-after-segment", "9", *extra)
    assert rc != 0
    assert [c.step for c in list_commits(Store(log))] == [3, 6]
    assert torchrun(2, log, str(run), str(TOTAL), "--resume", *extra) == 0
    assert streams(run, 2) == streams(ref, 2)
    # Every token of every document once per completed epoch of each rank.
    from ledger.audit import connect

    con = connect(log)
    bad = con.execute(
        """
        SELECT rank, epoch, sample_id FROM lineage WHERE kind = 'span'
        GROUP BY ALL HAVING sum(token_end - token_start) > any_value(length)
            OR count(*) FILTER (WHERE token_start = 0) > 1
        """
    ).fetchall()
    assert bad == []


def test_elastic_packed_stream_two_to_one_to_three_ranks(tmp_path):
    """Buffers and packing remainders in flight at each change of world size."""
    shards = conftest.text_shards(tmp_path / "shards", 6, 3, "w", 4)
    extra = ["--shards", str(shards)]
    log = str(tmp_path / "log")
    for i, (nproc, total) in enumerate([(2, 6), (1, 18), (3, 48)]):
        out = tmp_path / f"shape{i}"
        out.mkdir()
        resume = ["--resume-from", str(tmp_path / f"shape{i - 1}" / "ckpt-0.json")] if i else []
        rc = torchrun(nproc, log, str(out), str(total), *resume, *extra)
        assert rc == 0
    from ledger.audit import connect

    con = connect(log)
    head = list_commits(Store(log))[-1]
    assert head.world_size == 3
    done = min(s.epoch for s in head.states)  # epochs every rank has finished
    assert done >= 2
    rows = con.execute(
        """
        SELECT epoch, sample_id, sum(token_end - token_start), any_value(length),
               min(token_start), max(token_end)
        FROM lineage WHERE kind = 'span' AND epoch < ? GROUP BY 1, 2 ORDER BY 1, 2
        """,
        [done],
    ).fetchall()
    total_docs = sum(3 + s for s in range(6))
    for epoch in range(done):
        docs = [r for r in rows if r[0] == epoch]
        assert [r[1] for r in docs] == list(range(total_docs)), epoch
        for _, sid, tokens, length, lo, hi in docs:
            assert (tokens, lo, hi) == (length, 0, length), (epoch, sid)


def test_distributed_checkpoint_restores_every_rank(tmp_path):
    child = os.path.join(os.path.dirname(__file__), "dcp_child.py")
    rc = conftest.torchrun(2, child, str(tmp_path / "log"), str(tmp_path / "dcp"), str(tmp_path))
    assert rc == 0  # the ranks' stderr is in the captured output
    verdicts = {p.name: p.read_text() for p in sorted(tmp_path.glob("rank*.txt"))}
    assert verdicts == {"rank0.txt": "ok", "rank1.txt": "ok"}


@pytest.mark.long  # mixtures resume elastically in the two tests below, too
def test_elastic_resume_of_a_mixture_two_to_one_rank(tmp_path):
    """A mixture resumed with another world size continues the prefix of its positions:
    the samples served are exactly the mixture's order, position by position."""
    import numpy as np
    from conftest import Based

    import ledger

    log = str(tmp_path / "log")
    for i, (nproc, total) in enumerate([(2, 6), (1, 21)]):  # 6 steps of 2 x 4, then 15 of 4
        out = tmp_path / f"shape{i}"
        out.mkdir()
        resume = ["--resume-from", str(tmp_path / "shape0" / "ckpt-0.json")] if i else []
        assert torchrun(nproc, log, str(out), str(total), "--mixture", *resume) == 0
    seen = []
    for i, nproc in enumerate([2, 1]):
        for rank_stream in streams(tmp_path / f"shape{i}", nproc):
            seen.extend(int(x) for line in rank_stream for x in line.split("]")[0][1:].split(","))
    mix = ledger.Mixture(
        {"a": Based(13, 0), "b": Based(40, 1000)}, weights={"a": 0.6, "b": 0.4}, epoch_size=61
    )
    # 48 positions on two ranks, then 15 steps of 4 on one (epoch 0's last is short).
    from ledger.audit import connect

    con = connect(log)
    rows = con.execute(
        "SELECT epoch, position, CAST(source AS VARCHAR), sample_id FROM lineage "
        "WHERE kind = 'sample' ORDER BY epoch, position"
    ).fetchall()
    positions = np.array([e * 61 + p for e, p, _, _ in rows])
    assert positions.tolist() == list(range(len(rows)))  # each position once, a prefix
    logged = mix.join([s for _, _, s, _ in rows], np.array([i for _, _, _, i in rows]))
    assert np.array_equal(logged, mix.flat_ids(5, True, positions))  # the mixture's order
    served = [(1000 if s == "b" else 0) + i for _, _, s, i in rows]  # Based's ids
    assert sorted(seen) == sorted(served)


def test_elastic_stream_mixture_two_to_one_to_three_ranks(tmp_path):
    """A mixture of packed streams resumed with other world sizes: every position of each
    finished mixture epoch once, of the source the mixture's function gives, and every
    token of every sample once (buffers, lanes and packed samples in flight)."""

    import ledger

    shards = tmp_path / "shards"
    for name, count in (("a", 4), ("b", 3)):
        (shards / name).mkdir(parents=True)
        for s in range(count):
            with open(shards / name / f"part-{s}.jsonl", "w") as f:
                for i in range(2 + s):
                    f.write(json.dumps({"text": f"{name} {s} {i} " + "w" * (3 * i)}) + "\n")
    log = str(tmp_path / "log")
    for i, (nproc, total) in enumerate([(2, 6), (1, 15), (3, 30)]):
        out = tmp_path / f"shape{i}"
        out.mkdir()
        resume = ["--resume-from", str(tmp_path / f"shape{i - 1}" / "ckpt-0.json")] if i else []
        assert (
            torchrun(nproc, log, str(out), str(total), "--stream-mixture", str(shards), *resume)
            == 0
        )
    from ledger.stream import ShardedSource, Stream

    head = list_commits(Store(log))[-1]
    assert head.world_size == 3
    done = min(s.epoch for s in head.states)
    assert done >= 2
    size = 14 + 9  # rows of "a" and "b": the mixture epoch
    mix = ledger.Mixture(
        {n: Stream(ShardedSource(str(shards / n / "*"))) for n in ("a", "b")},
        weights={"a": 0.7, "b": 0.3},
    )
    _each_position_once_of_its_source(log, mix, done, size)


@pytest.mark.slow  # one torchrun of 2 ranks x 2 workers
def test_elastic_mixture_of_a_map_style_source_and_a_stream_two_to_one_rank(tmp_path):
    """A map-style source beside a packed stream, 2 ranks of 2 workers under torchrun,
    resumed on 1 rank without workers (in this process): every position of each finished
    mixture epoch once, of its source; every token of every sample once; a resume inside
    the new shape is exact; --check mixture passes."""
    from conftest import MapTokens, packed_stream

    import ledger
    from ledger.stream import ShardedSource, Stream

    shards = tmp_path / "shards"
    (shards / "b").mkdir(parents=True)
    for s in range(3):
        with open(shards / "b" / f"part-{s}.jsonl", "w") as f:
            for i in range(2 + s):
                f.write(json.dumps({"text": f"b {s} {i} " + "w" * (3 * i)}) + "\n")
    log = str(tmp_path / "log")
    out = tmp_path / "shape0"
    out.mkdir()
    assert torchrun(2, log, str(out), "5", "--stream-mixture", str(shards), "--map-a", "14") == 0
    token = json.loads((out / "ckpt-0.json").read_text())
    assert token["world_size"] == 2

    def one_rank() -> ledger.DataLoader:
        mix = ledger.Mixture(
            {"a": MapTokens(14), "b": packed_stream(str(shards / "b"), shuffle_buffer=2)},
            weights={"a": 0.7, "b": 0.3},
        )
        return ledger.DataLoader(mix, batch_size=2, shuffle=True, seed=5, log=log, world_size=1)

    from ledger.testing import batches_equal, take

    first = one_rank()
    first.load_state_dict(token)
    list(take(first, 3))
    inside = first.state_dict()
    reference = list(take(first, 18))
    first.state_dict()
    again = one_rank()
    again.load_state_dict(inside)
    assert all(batches_equal(a, b) for a, b in zip(take(again, 18), reference, strict=True))
    head = list_commits(Store(log))[-1]
    assert head.world_size == 1
    done = min(s.epoch for s in head.states)
    assert done >= 1
    size = 14 + 9
    mix = ledger.Mixture(
        {"a": MapTokens(14), "b": Stream(ShardedSource(str(shards / "b" / "*")))},
        weights={"a": 0.7, "b": 0.3},
    )
    _each_position_once_of_its_source(log, mix, done, size)
    from click.testing import CliRunner

    from ledger.cli import main

    out = CliRunner().invoke(main, ["audit", log, "--check", "mixture"])
    assert out.exit_code == 0, out.output


@pytest.mark.slow  # two torchruns of 2 ranks
def test_a_planned_skip_is_skipped_by_both_ranks_and_survives_a_resume(tmp_path):
    """skip(steps=range(4, 7)) planned on both ranks at the start; rank 1 dies after its
    segment of step 9, so the resume starts at commit 3, before the range, and skips it
    again from the plan in the commit's marker (a resume does not plan it again)."""
    from ledger.audit import connect

    log, out = str(tmp_path / "log"), tmp_path / "out"
    out.mkdir()
    assert torchrun(2, log, str(out), "12", "--skip-steps", "4:7", "--die-after-segment", "9")
    assert [c.step for c in list_commits(Store(log))] == [3]
    assert [tuple(r[:2]) for r in list_commits(Store(log))[0].planned_skips] == [(4, 7)]
    killed = [_lines(out, rank) for rank in range(2)]
    assert torchrun(2, log, str(out), "12", "--skip-steps", "4:7", "--resume") == 0
    lines = [_lines(out, rank) for rank in range(2)]
    for rank in range(2):
        first = dict(killed[rank])
        again = dict(lines[rank][len(killed[rank]) :])
        # Rank 1 died at its commit of step 9; rank 0, which waits for it only there, may
        # have been stopped before (at least after batch 3: step 3 was committed).
        steps = [s for s, _ in killed[rank]]
        assert steps == [0, 1, 2, 3, 7, 8][: len(steps)] and len(steps) >= 4 + 2 * rank, steps
        assert sorted(again) == [3, 7, 8, 9, 10, 11]  # from commit 3, the range skipped
        assert all(again[s] == first[s] for s in steps[3:]), rank  # the same batches
    con = connect(log)
    rolled = con.execute(
        "SELECT rank, batch, count(*), min(value) FROM lineage WHERE kind = 'rollback' "
        "GROUP BY ALL ORDER BY 1, 2"
    ).fetchall()
    positions = con.execute(
        "SELECT position FROM lineage WHERE epoch = 0 AND kind IN ('sample', 'rollback')"
    ).fetchall()
    con.close()
    assert [r[:3] for r in rolled] == [(r, b, 4) for r in (0, 1) for b in (4, 5, 6)]
    assert all(json.loads(r[3])["reason"] == "loss spike" for r in rolled)
    # Epoch 0 (61 samples, 8 steps of 2 x 4): each position once, served or skipped.
    assert sorted(p for (p,) in positions) == list(range(61))


def _lines(out, rank):
    """``(step, rest)`` of each line a rank wrote, in order (runs append)."""
    with open(os.path.join(out, f"stream-{rank}.txt")) as f:
        return [(int(s), rest) for s, rest in (line.split(" ", 1) for line in f)]


def _each_position_once_of_its_source(log: str, mix, done: int, size: int) -> None:
    """Every position of each of the lineage's first ``done`` mixture epochs (of ``size``
    positions, seed 5) was served once, by the source the mixture's definition gives it,
    and every token of its sample once (packed: spans cover ``[0, length)``)."""
    import numpy as np

    from ledger.audit import connect

    con = connect(log)
    rows = con.execute(
        """
        SELECT epoch, position, any_value(CAST(source AS VARCHAR)), count(DISTINCT sample_id),
               sum(token_end - token_start), any_value(length), min(token_start),
               max(token_end)
        FROM lineage WHERE kind = 'span' AND epoch < ? GROUP BY 1, 2 ORDER BY 1, 2
        """,
        [done],
    ).fetchall()
    con.close()
    for epoch in range(done):
        mine = [r for r in rows if r[0] == epoch]
        assert [r[1] for r in mine] == list(range(size)), epoch
        truth = mix.sources_at(5, np.arange(size) + epoch * size)
        assert [r[2] for r in mine] == [mix.names[s] for s in truth.tolist()]
        for _, p, _, ids, tokens, length, lo, hi in mine:
            assert (ids, tokens, lo, hi) == (1, length, 0, length), (epoch, p)


def _elastic_resumer(monkeypatch, tmp_path, token, n, seed, world):
    """A function ``rank -> (state, segments read)`` resuming ``token`` as rank ``rank`` of
    ``world`` (a map-style ``Augmented(n)``, batch 4), in this process: a 1-process gloo
    group stands for the job (a resume issues no collective). Destroy the group after."""
    import torch.distributed as dist
    from conftest import Augmented

    import ledger
    from ledger import segments

    read: list[str] = []
    opened = segments.CheckedLater.__init__

    def spy(self, store, rel, **kw):
        read.append(rel)
        opened(self, store, rel, **kw)

    monkeypatch.setattr(segments.CheckedLater, "__init__", spy)

    def resume(rank):
        read.clear()
        new = ledger.DataLoader(
            Augmented(n), batch_size=4, shuffle=True, seed=seed, log=token["root"], rank=rank,
            world_size=world,
        )  # fmt: skip
        new.load_state_dict(token)
        return new.state, list(read)

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    return resume


@pytest.mark.xdist_group("two_rank_reference")  # reuses test_dist's 2-rank job
def test_an_elastic_resume_reads_its_share_of_the_old_ranks_segments(
    tmp_path, two_rank_reference, monkeypatch
):
    """2 -> 3 ranks: new rank r decodes and checks old rank r's newest segment (r < 2) and
    takes the other old rank's state from the marker's fingerprint, so the job reads each
    old segment once, not once per new rank. The states equal those of a resume that
    decodes every old segment (the torchrun tests above compare elastic streams); a
    damaged old segment is refused by the new rank that reads it, and a fingerprint that
    disagrees with its segment by the others."""
    import shutil

    import torch.distributed as dist

    import ledger.replay
    from ledger.commits import read_commit
    from ledger.errors import LogCorrupted
    from ledger.ranks import RankTable

    ref_log, ref_out = two_rank_reference
    root = str(tmp_path / "log")
    shutil.copytree(ref_log, root)
    with open(os.path.join(ref_out, "ckpt-0.json")) as f:
        token = {**json.load(f), "root": root}
    head = read_commit(Store(root), token["commit"])
    newest = [head.ranks.newest(r).path for r in range(2)]
    resume = _elastic_resumer(monkeypatch, tmp_path, token, 61, 5, 3)
    try:
        got = [resume(rank) for rank in range(3)]
        assert [read for _, read in got] == [newest[:1], newest[1:], []]  # rank 2 reads none
        with monkeypatch.context() as m:  # every old segment decoded, by every new rank
            m.setattr(ledger.replay, "_final_batch", lambda plan, state: None)
            assert [resume(rank) for rank in range(3)] == [(state, newest) for state, _ in got]
        assert got[0][0].epoch_start == got[1][0].epoch_start > 0  # the new shape: mid-epoch
        with monkeypatch.context() as m:
            m.setattr(RankTable, "final_batch", lambda self, rank: 12345)
            with pytest.raises(LogCorrupted, match="fingerprint of rank 1's final batch"):
                resume(0)
        with open(os.path.join(root, newest[1]), "r+b") as f:
            f.seek(100)
            f.write(b"\x00altered\x00")
        resume(0)
        resume(2)  # neither reads old rank 1's segment
        with pytest.raises(LogCorrupted, match=r"altered|SHA-256"):
            resume(1)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("batches", [3, 4, 8])  # inside epoch 0; at its end; at epoch 1's
def test_an_elastic_resume_takes_a_state_at_an_epoch_boundary_from_its_fingerprint(
    tmp_path, monkeypatch, batches
):
    """1 -> 2 ranks from a commit inside an epoch or right after its last batch (the state
    then names the next epoch; the final batch is the last of the one before): new rank 1
    reads no segment, new rank 0 the old one's, and both states equal those of a resume
    that decodes it."""
    import torch.distributed as dist
    from conftest import Augmented

    import ledger
    import ledger.replay
    from ledger.testing import take

    root = str(tmp_path / "log")
    loader = ledger.DataLoader(Augmented(16), batch_size=4, shuffle=True, seed=3, log=root)
    list(take(loader, batches))  # 4 batches an epoch
    token = loader.state_dict()
    loader.close()
    resume = _elastic_resumer(monkeypatch, tmp_path, token, 16, 3, 2)
    try:
        got = [resume(0), resume(1)]
        assert [len(read) for _, read in got] == [1, 0]
        with monkeypatch.context() as m:  # decode the old rank's segment on every new rank
            m.setattr(ledger.replay, "_final_batch", lambda plan, state: None)
            assert [resume(0), resume(1)] == [(state, got[0][1]) for state, _ in got]
    finally:
        dist.destroy_process_group()
