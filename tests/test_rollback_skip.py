"""Rollback skips (loss-spike recovery): resume from an older checkpoint, skip batches on
the record, and every later resume continues after them; audit, show and report list
them."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner
from conftest import Augmented
from test_bad_samples import Flaky

import ledger
from ledger.audit import summarize
from ledger.audit.checks import check
from ledger.audit.queries import materialize, show
from ledger.audit.report import write_report
from ledger.audit.summary import BadSample, SkippedBatches
from ledger.cli import main
from ledger.errors import BatchSkipped, LedgerError, SampleError
from ledger.testing import batches_equal, take

N, B = 23, 4  # drop_last: 5 batches per epoch, 3 samples skipped


def _make(root, workers=0, dataset=None, **kw):
    kw = {"shuffle": True, "drop_last": True, **kw}
    return ledger.DataLoader(
        dataset if dataset is not None else Augmented(N), batch_size=B, seed=5, log=root,
        num_workers=workers, **kw,
    )  # fmt: skip


def _same(got, want):
    return [i for i, (a, b) in enumerate(zip(got, want, strict=True)) if not batches_equal(a, b)]


@pytest.mark.parametrize("workers", [0, 2])
def test_skip_after_a_rollback_then_every_later_resume_is_exact(tmp_path, workers):
    reference = list(take(_make(str(tmp_path / "ref")), 20))
    root = str(tmp_path / "log")
    run = _make(root, workers)
    list(take(run, 6))
    older = run.state_dict()
    list(take(run, 6))  # the spike: these batches are rolled back (an abandoned branch)
    run.state_dict()
    resumed = _make(root, workers)
    resumed.load_state_dict(older, skip_batches=3, reason="loss spike at step 11")
    got, tokens = [], []
    for batch in take(resumed, 8):  # batches 9..16 of the data order (epoch 1 and 2)
        got.append(batch)
        tokens.append(resumed.state_dict())
    assert _same(got, reference[9:17]) == []
    assert [t["step"] for t in tokens] == list(range(10, 18))  # skipped batches keep indices
    for done, token in enumerate(tokens, start=1):  # the skip is committed history
        again = _make(root, workers)
        again.load_state_dict(token)
        assert _same(list(take(again, 20 - 9 - done)), reference[9 + done : 20]) == []


def test_skip_is_recorded_and_listed(tmp_path):
    root = str(tmp_path / "log")
    run = _make(root)
    list(take(run, 6))
    older = run.state_dict()
    list(take(run, 2))
    run.state_dict()
    resumed = _make(root)
    resumed.load_state_dict(older, skip_batches=3, reason="loss spike")
    token = resumed.state_dict()  # committed with no batch after it
    assert token["step"] == 9
    again = _make(root, verify_data=True)  # its last committed batch was skipped
    again.load_state_dict(token)
    reference = list(take(_make(str(tmp_path / "ref")), 12))
    assert _same(list(take(again, 3)), reference[9:12]) == []
    again.state_dict()

    s = summarize(root)
    assert s.skipped_batches == (SkippedBatches(0, 6, 8, 12, "loss spike", 1),)
    assert [(e.epoch, e.rolled_back) for e in s.epochs] == [(0, 0), (1, 12), (2, 0)]
    results = {r.check: r for r in check(root, ["coverage", "skips", "duplicates"])}
    assert all(r.ok for r in results.values()), results
    assert "3 batches skipped on purpose (loss spike)" in results["skips"].detail
    record = show(root, 7)
    assert record.skip_reason == "loss spike" and record.events.num_rows == 0
    assert show(root, 9).skip_reason is None
    with pytest.raises(BatchSkipped, match=r"was skipped \(loss spike\)"):
        materialize(root, 7, Augmented(N))

    out = CliRunner().invoke(main, ["audit", root])
    assert out.exit_code == 0, out.output
    assert "Skipped batches" in out.output and "6-8" in out.output and "loss spike" in out.output
    out = CliRunner().invoke(main, ["show", root, "--batch", "7"])
    assert "skipped on purpose: loss spike" in out.output
    page = write_report(root, tmp_path / "report.html").read_text()
    assert "Batches skipped on purpose" in page and "loss spike" in page


def test_skip_mid_run_invalidates_the_live_iterator(root):
    run = _make(root)
    it = iter(run)
    next(it)
    run.skip(2, reason="bad shard")
    with pytest.raises(LedgerError, match="invalidated"):
        next(it)
    assert run.state.batch == 3
    with pytest.raises(ValueError, match="reason"):
        run.skip(1, reason=" ")
    with pytest.raises(ValueError, match=">= 1"):
        run.skip(0, reason="x")
    with pytest.raises(ValueError, match="int number of batches"):
        run.skip(1.0, reason="x")
    run.skip(np.int64(1), reason="an int from numpy")  # as the constructor's ints
    assert run.state.batch == 4
    with pytest.raises(ValueError, match="reason"):
        run.load_state_dict(run.state_dict(), skip_batches=1)


def test_a_batch_that_cannot_load_is_skipped_without_reading_it(root):
    flaky = Flaky(N, bad={4, 5, 6, 7})  # batch 1 of the identity order: all bad
    run = _make(root, dataset=flaky, shuffle=False, on_error="skip", drop_last=False)
    with pytest.raises(SampleError, match="every sample of batch 1"):
        for _ in run:
            token = run.state_dict()
    resumed = _make(root, dataset=flaky, shuffle=False, on_error="skip", drop_last=False)
    resumed.load_state_dict(token, skip_batches=1, reason="batch 1 unreadable")
    assert [b["id"].tolist() for b in take(resumed, 2)] == [[8, 9, 10, 11], [12, 13, 14, 15]]
    resumed.state_dict()
    s = summarize(root)
    assert s.skipped_batches == (SkippedBatches(0, 1, 1, 4, "batch 1 unreadable", 1),)
    assert s.bad_samples == ()  # the skipped batch's samples were never loaded


def test_bad_samples_are_listed_by_audit(root):
    run = _make(root, dataset=Flaky(N, bad={3, 10}), shuffle=False, on_error="skip")
    list(take(run, 10))
    run.state_dict()
    s = summarize(root)
    assert s.bad_samples == (
        BadSample(0, 0, 0, 3, 3, "ValueError", "corrupt record 3"),
        BadSample(0, 0, 2, 10, 10, "ValueError", "corrupt record 10"),
        BadSample(0, 1, 5, 3, 3, "ValueError", "corrupt record 3"),
        BadSample(0, 1, 7, 10, 10, "ValueError", "corrupt record 10"),
    )
    assert [(e.errors, e.covered) for e in s.epochs] == [(2, N), (2, N)]
    results = check(root, ["coverage", "skips"])
    assert all(r.ok for r in results), results
    assert "4 bad samples left out" in results[1].detail
    out = CliRunner().invoke(main, ["audit", root])
    assert "Bad samples (4)" in out.output and "ValueError: corrupt record 10" in out.output
    out = CliRunner().invoke(main, ["show", root, "--batch", "2", "--format", "json"])
    kinds = [(e["sample_id"], e["kind"]) for e in json.loads(out.output)["events"]]
    assert kinds == [(8, "sample"), (9, "sample"), (10, "error"), (11, "sample")]
    page = write_report(root, str(root) + ".html").read_text()
    assert "Bad samples (4)" in page


@pytest.mark.parametrize("workers", [0, 2])
def test_a_packed_stream_skips_by_producing_the_batches(tmp_path, workers):
    from conftest import packed_stream

    shards = tmp_path / "shards"
    shards.mkdir()
    for k in range(2):
        rows = [json.dumps({"text": f"doc {k}.{i} " + "w" * (i % 7)}) for i in range(12)]
        (shards / f"part-{k}.jsonl").write_text("\n".join(rows) + "\n")

    def make(root):
        return ledger.DataLoader(
            packed_stream(str(shards), 3), batch_size=2, shuffle=True, seed=1, log=root,
            num_workers=workers,
        )  # fmt: skip

    reference = list(take(make(str(tmp_path / "ref")), 16))
    root = str(tmp_path / "log")
    run = make(root)
    list(take(run, 4))
    older = run.state_dict()
    list(take(run, 3))
    run.state_dict()
    resumed = make(root)
    resumed.load_state_dict(older, skip_batches=5, reason="spike")
    got, tokens = [], []
    for batch in take(resumed, 5):
        got.append(batch)
        tokens.append(resumed.state_dict())
    assert _same(got, reference[9:14]) == []
    for done, token in enumerate(tokens[:3], start=1):
        again = make(root)
        again.load_state_dict(token)
        assert _same(list(take(again, 2)), reference[9 + done : 11 + done]) == []
    s = summarize(root)
    assert [(r.first, r.last, r.reason) for r in s.skipped_batches] == [(4, 8, "spike")]
    assert show(root, 6).skip_reason == "spike"


def test_a_mixture_skips_by_its_positions(tmp_path):
    from ledger.mixture import Mixture

    def make(root):
        mix = Mixture({"a": Augmented(11), "b": Augmented(17)}, weights={"a": 0.3, "b": 0.7})
        return ledger.DataLoader(mix, batch_size=3, shuffle=True, seed=2, log=root)

    reference = list(take(make(str(tmp_path / "ref")), 14))
    root = str(tmp_path / "log")
    run = make(root)
    list(take(run, 3))
    token = run.state_dict()
    resumed = make(root)
    resumed.load_state_dict(token, skip_batches=4, reason="spike")
    assert _same(list(take(resumed, 3)), reference[7:10]) == []
    again = make(root)
    again.load_state_dict(resumed.state_dict())
    assert _same(list(take(again, 4)), reference[10:14]) == []
    assert summarize(root).skipped_batches == (SkippedBatches(0, 3, 6, 12, "spike", 1),)


# ---------------------------------------------------------------- planned ranges of steps


def _resume_each(make, tokens, expected):
    """Each ``(done, token)`` resumed by a fresh loader continues ``expected[done:]``."""
    for done, token in tokens:
        again = make()
        again.load_state_dict(token)
        rest = list(take(again, len(expected) - done))
        assert _same(rest, expected[done:]) == [], f"resumed after {done} served batches"


@pytest.mark.parametrize("workers", [0, 2])
def test_a_planned_range_of_steps_is_skipped_when_reached(tmp_path, workers):
    reference = list(take(_make(str(tmp_path / "ref")), 20))  # 5 batches per epoch
    root = str(tmp_path / "log")
    run = _make(root, workers)
    got = list(take(run, 2))
    older = run.state_dict()  # step 2: before the request
    got += list(take(run, 1))
    # Crosses into epoch 1 (batch 5); numpy's ints as a loss curve's argmax gives them.
    run.skip(steps=[(np.int64(4), np.int64(7))], reason="bad shard")
    tokens = [(3, run.state_dict())]
    for batch in take(run, 10):
        got.append(batch)
        tokens.append((len(got), run.state_dict()))
    # Served: batches 0..3, then 7..16 of the data order: the range was skipped, once.
    expected = reference[:4] + reference[7:16]
    assert _same(got, expected) == []
    assert [t["step"] for _, t in tokens] == [3, 4, *range(8, 17)]
    # Every later resume is exact: between the request and the range (3, 4: the range is
    # in the marker), and after it.
    _resume_each(lambda: _make(root, 2 - workers), tokens, expected)
    s = summarize(root)
    assert [(r.first, r.last, r.reason) for r in s.skipped_batches] == [(4, 6, "bad shard")]
    assert show(root, 5).skip_reason == "bad shard"
    # A checkpoint from before the request does not hold it: its lineage never asked.
    again = _make(root, workers)
    again.load_state_dict(older)
    assert _same(list(take(again, 6)), reference[2:8]) == []


def test_a_range_planned_at_a_resume_and_one_the_head_is_inside(root):
    reference = list(take(_make(root + "-ref"), 17))
    run = _make(root)
    list(take(run, 6))
    token = run.state_dict()
    # At the resume: a range ahead, and one the head (batch 6) is inside of.
    resumed = _make(root)
    resumed.load_state_dict(token, skip_steps=[(9, 11), (4, 8)], reason="loss spike")
    got, tokens = [], [(0, resumed.state_dict())]  # a commit at step 8 that plans [9, 11)
    for batch in take(resumed, 6):
        got.append(batch)
        tokens.append((len(got), resumed.state_dict()))
    expected = [reference[8], *reference[11:16]]
    assert _same(got, expected) == []
    assert [t["step"] for _, t in tokens] == [8, 9, 12, 13, 14, 15, 16]
    _resume_each(lambda: _make(root), tokens, expected)
    s = summarize(root)
    assert [(r.first, r.last, r.reason) for r in s.skipped_batches] == [
        (6, 7, "loss spike"),
        (9, 10, "loss spike"),
    ]


def test_planned_steps_are_checked(root):
    run = _make(root)
    list(take(run, 5))
    with pytest.raises(ValueError, match="passed already"):
        run.skip(steps=range(1, 5), reason="x")
    with pytest.raises(ValueError, match="empty"):
        run.skip(steps=[(9, 9)], reason="x")
    with pytest.raises(ValueError, match="not both or neither"):
        run.skip(2, steps=range(8, 9), reason="x")
    run.skip(steps=range(8, 12), reason="first")
    with pytest.raises(ValueError, match=r"overlap the planned skip \[8, 12\)"):
        run.skip(steps=[(11, 14)], reason="second")
    with pytest.raises(ValueError, match="range with step 1"):
        run.skip(steps=range(20, 30, 2), reason="x")


@pytest.mark.parametrize("workers", [0, 2])
def test_a_packed_stream_skips_a_planned_range(tmp_path, workers):
    from conftest import packed_stream

    shards = tmp_path / "shards"
    shards.mkdir()
    for k in range(2):
        rows = [json.dumps({"text": f"doc {k}.{i} " + "w" * (i % 7)}) for i in range(12)]
        (shards / f"part-{k}.jsonl").write_text("\n".join(rows) + "\n")

    def make(root):
        return ledger.DataLoader(
            packed_stream(str(shards), 3), batch_size=2, shuffle=True, seed=1, log=root,
            num_workers=workers,
        )  # fmt: skip

    reference = list(take(make(str(tmp_path / "ref")), 16))
    root = str(tmp_path / "log")
    run = make(root)
    got = list(take(run, 2))
    run.skip(steps=range(5, 8), reason="spike")
    tokens = [(2, run.state_dict())]
    for batch in take(run, 8):
        got.append(batch)
        tokens.append((len(got), run.state_dict()))
    expected = reference[:5] + reference[8:13]
    assert _same(got, expected) == []
    _resume_each(lambda: make(root), tokens[:-2], expected)
    assert [(r.first, r.last) for r in summarize(root).skipped_batches] == [(5, 7)]


def test_a_checkpoint_right_after_planning_at_a_resume_holds_the_plan(root):
    reference = list(take(_make(root + "-ref"), 12))
    run = _make(root)
    list(take(run, 6))
    token = run.state_dict()
    resumed = _make(root)
    resumed.load_state_dict(token, skip_steps=range(8, 10), reason="bad shard")
    planned = resumed.state_dict()  # no batch since: a commit of the new attempt, step 6
    assert planned["step"] == 6 and planned["commit"] != token["commit"]
    again = _make(root)
    again.load_state_dict(planned)
    assert _same(list(take(again, 4)), [*reference[6:8], *reference[10:12]]) == []
