"""Phases other than a mixture's weights: a new batch size (map-style datasets, streams,
mixtures), new and removed mixture sources; exact resumes inside the phase and audits."""

from __future__ import annotations

import os
import zlib

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from conftest import Augmented, Based, packed_stream

import ledger
from ledger.audit import connect, write_report
from ledger.audit.checks import check
from ledger.cli import main
from ledger.commits import read_attempt
from ledger.errors import ConfigMismatch
from ledger.mixture import Mixture
from ledger.order import EpochOrder, derive_key
from ledger.store import Store
from ledger.testing import batches_equal, take

N = 23


def _map_loader(root, batch_size, workers=0, drop_last=False):
    return ledger.DataLoader(
        Augmented(N), batch_size=batch_size, shuffle=True, seed=3, log=root,
        num_workers=workers, drop_last=drop_last,
    )  # fmt: skip


def _resumes_exactly(make, tokens, after):
    """Each ``(done, token)`` resumed by a fresh ``make()`` continues ``after[done:]``."""
    for done, token in tokens:
        resumed = make()
        resumed.load_state_dict(token)
        rest = list(take(resumed, len(after) - done))
        assert len(rest) == len(after) - done
        for i, (got, want) in enumerate(zip(rest, after[done:], strict=True)):
            assert batches_equal(got, want), f"resumed after {done}: batch {done + i} differs"


def _phases(root):
    store = Store(root)
    return [read_attempt(store, a)["phase"] for a in sorted(os.listdir(f"{root}/attempts"))]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_new_batch_size_rebatches_from_the_next_unconsumed_position(root, workers):
    early = _map_loader(root, 4)
    before = list(take(early, 3))  # positions [0, 12) of epoch 0
    boundary = early.state_dict()
    with pytest.raises(ConfigMismatch, match=r"batch_size.*new_phase=True"):
        _map_loader(root, 6).load_state_dict(boundary)  # without new_phase: refused
    late = _map_loader(root, 6, workers)
    late.load_state_dict(boundary, new_phase=True)
    after, tokens = [], []
    for batch in take(late, 9):  # [12, 23) in 2 batches, then epochs 1 and 2 in 4 each...
        after.append(batch)
        tokens.append((len(after), late.state_dict()))
    # The definition: the order of epoch 0 from position 12 cut into batches of 6 (the
    # last short), then every later epoch from position 0 in batches of 6.
    want: list[list[int]] = []
    for epoch, start in ((0, 12), (1, 0), (2, 0)):
        ids = EpochOrder(N, 3, epoch, True).sample_ids(np.arange(start, N)).tolist()
        want += [ids[k : k + 6] for k in range(0, len(ids), 6)]
    assert [b["id"].tolist() for b in before] == [
        EpochOrder(N, 3, 0, True).sample_ids(np.arange(k, k + 4)).tolist() for k in (0, 4, 8)
    ]
    assert [b["id"].tolist() for b in after] == want[:9]
    # Resumes inside the phase are exact with any workers, and need its batch size.
    _resumes_exactly(lambda: _map_loader(root, 6, 2 - workers), tokens, after)
    with pytest.raises(ConfigMismatch, match="batch_size"):
        _map_loader(root, 4).load_state_dict(tokens[-1][1])
    phases = _phases(root)
    assert phases[0] is None and phases[1]["number"] == 1 and phases[1]["start"] == 12
    assert phases[1]["config"]["batch_size"] == 6
    # The audits read the lineage across both phases: every epoch once, no duplicate.
    results = {r.check: r for r in check(root, ["coverage", "duplicates", "skips"])}
    assert all(r.ok for r in results.values()), results
    assert results["coverage"].detail.startswith("2 finished epochs cover all 23 samples")
    out = CliRunner().invoke(main, ["audit", root])
    assert out.exit_code == 0, out.output
    assert "Rank" in write_report(root, os.path.join(root, "..", "r.html")).read_text()


def test_a_new_phase_with_drop_last_skips_the_tail_it_cannot_serve(root):
    early = _map_loader(root, 4)
    list(take(early, 5))  # positions [0, 20): 3 left, fewer than a batch of 4
    boundary = early.state_dict()
    late = _map_loader(root, 4, drop_last=True)
    late.load_state_dict(boundary, new_phase=True)
    first = next(iter(late))
    late.state_dict()
    assert first["id"].tolist() == EpochOrder(N, 3, 1, True).sample_ids(np.arange(4)).tolist()
    con = connect(root)
    tail = con.sql("select sample_id from lineage where kind = 'skip' order by position")
    want = EpochOrder(N, 3, 0, True).sample_ids(np.arange(20, 23)).tolist()
    assert [i for (i,) in tail.fetchall()] == want
    assert all(r.ok for r in check(root, ["coverage", "skips"])), check(root, ["skips"])


def test_a_phase_cannot_change_the_seed(root):
    early = _map_loader(root, 4)
    list(take(early, 2))
    token = early.state_dict()
    other = ledger.DataLoader(Augmented(N), batch_size=4, shuffle=True, seed=4, log=root)
    with pytest.raises(ConfigMismatch, match=r"seed.*batch size"):
        other.load_state_dict(token, new_phase=True)


def _source_seed(name: str, seed: int) -> int:
    return derive_key(seed, zlib.crc32(name.encode()))


def _mix(sources, batch_size, workers=0):
    datasets = {"code": Based(13, 0), "prose": Based(29, 1000), "web": Based(17, 2000)}
    mixture = Mixture(
        {name: datasets[name] for name in sources},
        weights={name: 1.0 for name in sources},
        epoch_size=100,
    )
    return mixture, batch_size, workers


def _mix_loader(root, sources, batch_size, workers=0):
    mixture, _, _ = _mix(sources, batch_size)
    return ledger.DataLoader(
        mixture, batch_size=batch_size, shuffle=True, seed=6, log=root, num_workers=workers,
        verify_data=True,  # the last batch of the old phase holds a source now removed
    )  # fmt: skip


def test_a_new_phase_adds_and_removes_mixture_sources(root):
    early = _mix_loader(root, ("code", "prose"), 10)
    before = [b["id"] for b in take(early, 13)]  # positions [0, 130): epoch 1 underway
    boundary = early.state_dict()
    with pytest.raises(ConfigMismatch, match="mixture"):
        _mix_loader(root, ("code", "web"), 10).load_state_dict(boundary)
    late = _mix_loader(root, ("code", "web"), 8)  # prose out, web in, batches of 8
    late.load_state_dict(boundary, new_phase=True)
    after, tokens = [], []
    for batch in take(late, 20):  # positions [130, 290)
        after.append(batch)
        if len(after) % 3 == 0:
            tokens.append((len(after), late.state_dict()))
    assert [len(b["id"]) for b in after[:9]] == [8] * 8 + [6]  # epoch 1 ends at 200
    new = torch.cat([b["id"] for b in after]).numpy()
    old = torch.cat(before).numpy()
    assert not np.any((new >= 1000) & (new < 2000))  # prose removed
    assert np.any(new >= 2000) and not np.any(old >= 2000)  # web added
    # Every source continues its own order: code across the boundary, web from its 0.
    for name, got, n in (
        ("code", [int(i) for i in np.concatenate([old, new]) if i < 1000], 13),
        ("web", [int(i) - 2000 for i in new if i >= 2000], 17),
        ("prose", [int(i) - 1000 for i in old if 1000 <= i < 2000], 29),
    ):
        want = [
            int(EpochOrder(n, _source_seed(name, 6), k // n, True).sample_ids(k % n))
            for k in range(len(got))
        ]
        assert got == want, name
    _resumes_exactly(lambda: _mix_loader(root, ("code", "web"), 8, 2), tokens, after)
    phase = _phases(root)[1]
    assert phase["start"] == 130
    assert phase["config"]["batch_size"] == 8
    assert len(phase["base"]) == 2 and phase["base"][1] == 0  # web starts at 0
    # Shares per phase against each phase's targets (prose 0 in phase 1, web 0 before).
    result = check(root, ["mixture"])[0]
    assert result.ok and "in each of 2 phases" in result.detail, result.detail
    assert "web" in result.detail and "prose" in result.detail
    out = CliRunner().invoke(main, ["audit", root])
    assert out.exit_code == 0 and "Shares per phase" in out.output, out.output


def test_a_phase_keeps_a_kept_sources_length_and_the_epoch_size(root):
    early = _mix_loader(root, ("code", "prose"), 10)
    list(take(early, 2))
    token = early.state_dict()
    bigger = Mixture(
        {"code": Based(14, 0), "prose": Based(29, 1000)}, weights={"code": 1, "prose": 1},
        epoch_size=100,
    )  # fmt: skip
    with pytest.raises(ConfigMismatch, match="mixture source 'code' length"):
        ledger.DataLoader(bigger, batch_size=10, shuffle=True, seed=6, log=root).load_state_dict(
            token, new_phase=True
        )
    other_size = Mixture(
        {"code": Based(13, 0), "web": Based(17, 2000)}, weights={"code": 1, "web": 1}
    )
    with pytest.raises(ConfigMismatch, match="mixture epoch_size"):
        ledger.DataLoader(
            other_size, batch_size=10, shuffle=True, seed=6, log=root
        ).load_state_dict(token, new_phase=True)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_stream_takes_a_new_batch_size_where_each_worker_stood(tmp_path, workers):
    shards = tmp_path / "shards"
    shards.mkdir()
    for s in range(4):
        (shards / f"p{s}.jsonl").write_text(
            "".join(f'{{"text": "doc {s}-{i} {"x" * (i % 5)}"}}\n' for i in range(6))
        )

    def make(root, batch_size):
        return ledger.DataLoader(
            packed_stream(str(shards), 3, seq_len=8), batch_size=batch_size, seed=2,
            log=str(tmp_path / root), num_workers=workers,
        )  # fmt: skip

    # Uninterrupted with batches of 3: each worker's stream of sequences.
    ref = make("ref", 3)
    whole = list(ref)
    early = make("log", 3)
    before = list(take(early, 4))
    boundary = early.state_dict()
    late = make("log", 1)
    late.load_state_dict(boundary, new_phase=True)
    after, tokens = [], []
    for batch in late:  # the rest of epoch 0 in batches of one sequence
        after.append(batch)
        tokens.append((len(after), late.state_dict()))
    # The same sequences as the uninterrupted run, per worker and in order: a new batch
    # size changes how each worker's stream is cut, nothing else.
    seqs = lambda batches: [  # noqa: E731
        s for b in batches for s in b["tokens"].numpy().tolist()
    ]
    assert seqs(before) == seqs(whole[:4])
    assert sorted(map(tuple, seqs(after))) == sorted(map(tuple, seqs(whole[4:])))
    if workers == 0:
        assert seqs(after) == seqs(whole[4:])
    assert all(len(b["tokens"]) == 1 for b in after)
    _resumes_exactly(lambda: make("log", 1), tokens[:-1], after)
    assert _phases(str(tmp_path / "log"))[1]["config"]["batch_size"] == 1
