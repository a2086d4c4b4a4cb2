"""Weighted mixtures (ledger.Mixture): exact resume, each source's own order and epochs,
realised shares against the ground truth, schedules, the source column and the audit."""

from __future__ import annotations

import os
import zlib

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from conftest import Based

import ledger
from ledger.audit import connect
from ledger.audit.checks import check
from ledger.audit.mixture import SourceShare
from ledger.audit.queries import where
from ledger.cli import CHECK_FAILED, main
from ledger.errors import UnsupportedArgument
from ledger.mixture import BLOCK, Mixture, Schedule
from ledger.order import EpochOrder, derive_key
from ledger.stream import ShardedSource, Stream
from ledger.testing import assert_resume_exact, take


def mixture(weights=None, epoch_size=None) -> Mixture:
    return Mixture(
        {"code": Based(13, 0), "prose": Based(29, 1000)},
        weights=weights or {"code": 0.6, "prose": 0.4},
        epoch_size=epoch_size,
    )


@pytest.mark.parametrize("workers", [0, 2])
def test_mixture_resumes_exactly_with_any_workers(root, workers) -> None:
    def make() -> ledger.DataLoader:
        return ledger.DataLoader(
            mixture(), batch_size=4, shuffle=True, seed=3, num_workers=workers, log=root
        )

    # 42 positions per mixture epoch: 25 batches cross two of them (and both sources'
    # epochs: 13 "code" samples run out after ~22 positions).
    assert assert_resume_exact(make, batches=25, every=4) == 6


def test_resume_after_a_finished_epoch_with_drop_last(root) -> None:
    def make() -> ledger.DataLoader:
        return ledger.DataLoader(
            mixture(), batch_size=5, shuffle=True, seed=1, drop_last=True, log=root
        )

    assert assert_resume_exact(make, batches=20, every=7) == 2
    con = connect(root)
    skipped = con.execute("SELECT count(*) FROM lineage WHERE kind = 'skip'").fetchone()
    assert skipped == (2,)  # 42 = 8 * 5 + 2 per epoch, two epochs finished


def _source_seed(name: str, seed: int) -> int:
    return derive_key(seed, zlib.crc32(name.encode()))


def test_each_source_keeps_its_own_order_and_epochs(root) -> None:
    loader = ledger.DataLoader(mixture(), batch_size=6, shuffle=True, seed=9, log=root)
    ids = torch.cat([b["id"] for b in take(loader, 30)]).tolist()  # 180 positions
    code = [i for i in ids if i < 1000]
    prose = [i - 1000 for i in ids if i >= 1000]
    for name, got, n in (("code", code, 13), ("prose", prose, 29)):
        # The k-th sample of a source is position k % n of its own epoch k // n.
        want = [
            int(EpochOrder(n, _source_seed(name, 9), k // n, True).sample_ids(k % n))
            for k in range(len(got))
        ]
        assert got == want
        for e in range(len(got) // n):  # every finished source epoch: each sample once
            assert sorted(got[e * n : (e + 1) * n]) == list(range(n))
    assert len(code) // 13 >= 7  # the small source repeated


def test_realised_shares_equal_the_ground_truth(root) -> None:
    mix = mixture({"code": 0.7, "prose": 0.3}, epoch_size=1500)
    loader = ledger.DataLoader(mix, batch_size=50, shuffle=True, seed=4, log=root)
    ids = torch.cat([b["id"] for b in take(loader, 50)])  # 2500 positions, two blocks and a half
    loader.state_dict()
    truth = mix.sources_at(4, np.arange(2500))
    assert ((ids.numpy() >= 1000).astype(int) == truth).all()
    # Whole blocks hold exactly the weights; the half block is a seeded draw of its slots.
    assert np.bincount(truth[: 2 * BLOCK], minlength=2).tolist() == [1400, 600]
    con = connect(root)
    logged = dict(
        con.execute(
            "SELECT CAST(source AS VARCHAR), count(*) FROM lineage WHERE kind = 'sample' GROUP BY 1"
        ).fetchall()
    )
    assert logged == {"code": int((truth == 0).sum()), "prose": int((truth == 1).sum())}
    # sample_id is the index in its source
    top = con.execute(
        "SELECT CAST(source AS VARCHAR), max(sample_id) FROM lineage WHERE kind = 'sample' "
        "GROUP BY 1 ORDER BY 1"
    ).fetchall()
    assert top == [("code", 12), ("prose", 28)]
    assert check(root, ["mixture"])[0].ok


def test_a_schedule_changes_the_weights_at_its_boundary(root) -> None:
    weights = Schedule({0: {"code": 0.9, "prose": 0.1}, 2 * BLOCK: {"code": 0.2, "prose": 0.8}})
    mix = mixture(weights, epoch_size=1000)
    truth = mix.sources_at(0, np.arange(4 * BLOCK))
    assert np.bincount(truth[: 2 * BLOCK], minlength=2).tolist() == [1800, 200]
    assert np.bincount(truth[2 * BLOCK :], minlength=2).tolist() == [400, 1600]
    loader = ledger.DataLoader(mix, batch_size=100, shuffle=True, seed=0, log=root)
    list(take(loader, 30))
    token = loader.state_dict()
    rest = [b["id"] for b in take(loader, 10)]
    resumed = ledger.DataLoader(mix, batch_size=100, shuffle=True, seed=0, log=root)
    resumed.load_state_dict(token)
    assert all(torch.equal(a["id"], b) for a, b in zip(take(resumed, 10), rest, strict=True))
    result = check(root, ["mixture"])[0]
    assert result.ok, result.detail


def test_the_mixture_check_fails_when_shares_are_off() -> None:
    assert SourceShare("a", 700, 700.0, 4 * 14.5 + 1, 0.7, 0.7).ok
    assert not SourceShare("a", 800, 700.0, 4 * 14.5 + 1, 0.8, 0.7).ok


def test_audit_reports_shares_and_fails_a_log_that_is_not_the_mixture(root) -> None:
    loader = ledger.DataLoader(
        mixture({"code": 0.5, "prose": 0.5}, 1000), batch_size=50, seed=2, log=root
    )
    list(take(loader, 20))
    loader.state_dict()
    runner = CliRunner()
    out = runner.invoke(main, ["audit", root])
    assert out.exit_code == 0, out.output
    assert "Shares over steps" in out.output and "50.00%" in out.output
    out = runner.invoke(main, ["audit", root, "--check", "mixture"])
    assert out.exit_code == 0, out.output
    # The same events under a configuration that claims other weights: the check fails.
    from conftest import rewrite_run

    rewrite_run(
        root, lambda run: run["config"]["mixture"].update(targets=[{"code": 0.8, "prose": 0.2}])
    )
    out = runner.invoke(main, ["audit", root, "--check", "mixture"])
    assert out.exit_code == CHECK_FAILED, out.output
    assert "off target" in out.output


def test_a_mixture_refuses_what_it_cannot_mix(tmp_path) -> None:
    (tmp_path / "a.jsonl").write_text('{"x": 1}\n')
    stream = Stream(ShardedSource([str(tmp_path / "a.jsonl")]))
    # A map-style dataset beside a stream is mixed (tests/test_mixture_streams.py); a
    # source that is neither is refused.
    assert Mixture({"a": Based(3, 0), "s": stream}, weights={"a": 1, "s": 1}).streams
    with pytest.raises(UnsupportedArgument, match="neither a map-style dataset"):
        Mixture({"a": Based(3, 0), "s": stream, "x": 42}, weights={"a": 1, "s": 1})
    with pytest.raises(ValueError, match="'c', which is not a source"):
        Mixture({"a": Based(3, 0)}, weights={"a": 1, "c": 1})
    with pytest.raises(ValueError, match="not a multiple of 1000"):
        Schedule({0: {"a": 1}, 1500: {"a": 1}})
    with pytest.raises(ValueError, match="weights sum to 0"):
        Mixture({"a": Based(3, 0)}, weights={"a": 0})
    with pytest.raises(ValueError, match="is empty"):
        Mixture({"a": Based(0, 0)}, weights={"a": 1})


def test_verify_data_recreates_a_mixture_batch_through_its_sources(root) -> None:
    from ledger.errors import ConfigMismatch

    def make(base: int) -> ledger.DataLoader:
        mix = Mixture(
            {"code": Based(13, 0), "prose": Based(29, base)}, weights={"code": 1, "prose": 1}
        )
        return ledger.DataLoader(mix, batch_size=4, seed=3, log=root, verify_data=True)

    loader = make(1000)
    list(take(loader, 5))
    token = loader.state_dict()
    make(1000).load_state_dict(token)  # batch 4 re-created from (source, id): same digest
    with pytest.raises(ConfigMismatch, match="dataset content"):
        make(2000).load_state_dict(token)  # "prose" changed under the same length


def test_coverage_and_duplicates_of_a_mixture_count_its_positions(root) -> None:
    loader = ledger.DataLoader(mixture(), batch_size=4, shuffle=True, seed=5, log=root)
    list(take(loader, 24))  # 42 positions per epoch: two finished epochs
    loader.state_dict()
    results = {r.check: r for r in check(root, ["coverage", "duplicates", "mixture"])}
    assert all(r.ok for r in results.values()), results
    assert results["coverage"].detail.startswith("2 finished epochs cover all 42 samples")


def test_where_and_show_name_the_source_of_a_mixture_sample(root) -> None:
    loader = ledger.DataLoader(mixture(), batch_size=4, shuffle=True, seed=5, log=root)
    ids = torch.cat([b["id"] for b in take(loader, 11)]).tolist()  # 44 positions
    loader.state_dict()
    runner = CliRunner()
    # Ids are per source: id 3 is one sample of "code" and another of "prose".
    want = {
        name: [p for p, i in enumerate(ids) if i - base == 3]
        for name, base in (("code", 0), ("prose", 1000))
    }
    assert want["code"] and want["prose"]
    for name, positions in want.items():
        h = where(root, 3, source=name)
        assert [c.epoch * 42 + c.position for c in h.consumptions] == positions
        assert {c.source for c in h.consumptions} == {name}
    for args, message in (
        ([], "sample ids are per source; name one"),
        (["--source", "web"], "'web' is not one"),
    ):
        out = runner.invoke(main, ["where", root, "--sample", "3", *args])
        assert out.exit_code == 2 and message in out.output, out.output
    out = runner.invoke(main, ["where", root, "--sample", "13", "--source", "code"])
    assert out.exit_code == 2 and "outside source 'code'" in out.output, out.output
    out = runner.invoke(main, ["show", root, "--batch", "0", "--format", "csv"])
    rows = [line.split(",") for line in out.output.splitlines()]
    assert rows[0][:3] == ["position", "source", "sample_id"]
    assert [(r[1], int(r[2]) + (1000 if r[1] == "prose" else 0)) for r in rows[1:]] == [
        ("prose" if i >= 1000 else "code", i) for i in ids[:4]
    ]


# ---------------------------------------------------------------- phases


def _loader(root, weights, batch_size=50, workers=0) -> ledger.DataLoader:
    return ledger.DataLoader(
        mixture(weights, epoch_size=1000),
        batch_size=batch_size,
        shuffle=True,
        seed=6,
        num_workers=workers,
        log=root,
    )


EARLY = {"code": 0.9, "prose": 0.1}
LATE = {"code": 0.1, "prose": 0.9}


def test_a_change_of_weights_needs_new_phase(root) -> None:
    from ledger.errors import ConfigMismatch

    loader = _loader(root, EARLY)
    list(take(loader, 3))
    token = loader.state_dict()
    with pytest.raises(ConfigMismatch, match="new_phase=True"):
        _loader(root, LATE).load_state_dict(token)
    other_seed = ledger.DataLoader(
        mixture(LATE, epoch_size=1000), batch_size=50, shuffle=True, seed=7, log=root
    )
    with pytest.raises(ConfigMismatch, match=r"Mixture's weights, schedule and sources"):
        other_seed.load_state_dict(token, new_phase=True)


def test_a_new_phase_continues_every_source_and_resumes_exactly(root) -> None:
    from ledger.errors import ConfigMismatch

    early = _loader(root, EARLY)
    before = [b["id"] for b in take(early, 12)]  # positions [0, 600)
    boundary = early.state_dict()
    late = _loader(root, LATE)
    late.load_state_dict(boundary, new_phase=True)
    after, tokens = [], []
    for batch in take(late, 30):  # positions [600, 2100): two epochs of the mixture
        after.append(batch["id"])
        if len(after) % 7 == 0:
            tokens.append((len(after), late.state_dict()))
    ids = torch.cat(before + after).numpy()
    is_prose = (ids >= 1000).astype(int)
    # The new phase's first block (positions 600..1599) holds exactly its weights.
    assert np.bincount(is_prose[600:1600], minlength=2).tolist() == [100, 900]
    assert np.bincount(is_prose[:600], minlength=2).tolist()[1] < 120  # the early weights
    # Every source continued its own order across the phase boundary.
    for name, got, n in (
        ("code", [int(i) for i in ids if i < 1000], 13),
        ("prose", [int(i) - 1000 for i in ids if i >= 1000], 29),
    ):
        want = [
            int(EpochOrder(n, _source_seed(name, 6), k // n, True).sample_ids(k % n))
            for k in range(len(got))
        ]
        assert got == want
    # Resumes inside the new phase continue it exactly (any worker count), and need its
    # configuration: the early weights are refused now.
    for done, token in tokens:
        for workers in (0, 2):
            resumed = _loader(root, LATE, workers=workers)
            resumed.load_state_dict(token)
            rest = [b["id"] for b in take(resumed, 30 - done)]
            assert all(torch.equal(a, b) for a, b in zip(rest, after[done:], strict=True))
    with pytest.raises(ConfigMismatch, match="mixture"):
        _loader(root, EARLY).load_state_dict(tokens[-1][1])
    # The audit reads each phase's targets: exact shares per phase, and the table.
    result = check(root, ["mixture"])[0]
    assert result.ok and "in each of 2 phases" in result.detail, result.detail
    out = CliRunner().invoke(main, ["audit", root])
    assert "Shares per phase" in out.output, out.output
    from ledger.audit import write_report

    page = write_report(root, os.path.join(root, "..", "report.html")).read_text()
    assert "Mixture: shares of the sources" in page and "Per phase" in page
    from ledger.commits import read_attempt
    from ledger.store import Store

    attempts = sorted(os.listdir(os.path.join(root, "attempts")))
    numbers = [read_attempt(Store(root), a)["phase"] for a in attempts]
    assert numbers[0] is None and {p["number"] for p in numbers[1:]} == {1}
    assert numbers[1]["start"] == 600  # where the ranks' positions reached


class _Plain:
    """A source without random draws: ``{"id": base + i}``."""

    def __init__(self, n: int, base: int) -> None:
        self.n, self.base = n, base

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"id": torch.tensor(self.base + i)}


class _Batched(_Plain):
    """The same with a batched ``__getitems__`` (as HF ``datasets``) that records its calls."""

    def __init__(self, n: int, base: int) -> None:
        super().__init__(n, base)
        self.calls: list[list[int]] = []

    def __getitems__(self, ids: list[int]) -> list[dict[str, torch.Tensor]]:
        self.calls.append(list(ids))
        return [self[i] for i in ids]


def test_a_source_with_getitems_is_fetched_a_batch_at_a_time(root) -> None:
    def make(batched: bool, log: str) -> tuple[ledger.DataLoader, _Plain]:
        web = _Batched(29, 1000) if batched else _Plain(29, 1000)
        mix = Mixture({"code": _Plain(13, 0), "web": web}, weights={"code": 0.4, "web": 0.6})
        loader = ledger.DataLoader(mix, batch_size=5, shuffle=True, seed=8, log=log, rng="off")
        return loader, web

    batched, web = make(True, root)
    got = [b["id"] for b in take(batched, 12)]
    plain, _ = make(False, root + "-plain")
    want = [b["id"] for b in take(plain, 12)]
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    # One call per batch that holds "web" samples, with exactly those, in batch order.
    assert isinstance(web, _Batched)
    per_batch = [[int(i) - 1000 for i in ids.tolist() if i >= 1000] for ids in got]
    assert web.calls == [ids for ids in per_batch if ids]
    assert len(web.calls) >= 10
