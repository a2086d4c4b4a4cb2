"""Logs written before the version-2 marker (tests/fixtures/v1, by the ledger of 18e54ae)
still resume exactly, resume elastically, take new commits and audit."""

from __future__ import annotations

import json
import os
import shutil
import sys

import pytest
from click.testing import CliRunner
from conftest import count_decodes, packed_stream

import ledger
from ledger.audit import connect
from ledger.cli import main
from ledger.commits import list_commits, read_commit
from ledger.compaction import compact
from ledger.store import Store
from ledger.testing import take

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
sys.path.insert(0, FIXTURES)
import make_v1  # noqa: E402


# The fixtures were written when per-sample seeding was the default: rng='sample' now.
def map_loader(root, rank=0, world_size=1):
    return ledger.DataLoader(
        make_v1.Ids(23),
        batch_size=4,
        shuffle=True,
        seed=7,
        log=root,
        rank=rank,
        world_size=world_size,
        rng="sample",
    )


def stream_loader(root, rank=0, world_size=1):
    return ledger.DataLoader(
        packed_stream(os.path.join(make_v1.HERE, "shards"), shuffle_buffer=3),
        batch_size=2,
        shuffle=True,
        seed=5,
        log=root,
        num_workers=2,
        rank=rank,
        world_size=world_size,
        rng="sample",
    )


@pytest.fixture
def v1(tmp_path):
    """Copy of the version-1 fixtures with root and shard paths relocated; returns a
    function ``name -> (root, tokens, batches)``."""
    base = tmp_path / "v1"
    shutil.copytree(os.path.join(FIXTURES, "v1"), base)

    def load(name: str):
        root = str(base / name)
        run = os.path.join(root, "run.json")
        with open(run) as f:
            text = f.read()
        with open(run, "w") as f:
            f.write(text.replace("@SHARDS@", str(base / "shards")))
        with open(os.path.join(root, "tokens.json")) as f:
            tokens = {int(k): v for k, v in json.load(f).items()}
        for t in tokens.values():
            t["root"] = root
        batches = None
        if os.path.exists(os.path.join(root, "batches.json")):
            with open(os.path.join(root, "batches.json")) as f:
                batches = json.load(f)
        return root, tokens, batches

    return load


def _shards_moved(monkeypatch, tmp_path):
    # stream_loader reads the shards next to make_v1.py: point it at the copy.
    monkeypatch.setattr(make_v1, "HERE", str(tmp_path / "v1"))


def as_lists(batch):
    return {k: v.tolist() for k, v in sorted(batch.items())}


def test_fixture_is_version_1():
    store = Store(os.path.join(FIXTURES, "v1", "map"))
    markers = [n for n in os.listdir(os.path.join(store.uri, "commits"))]
    assert markers and all(n.endswith(".json") for n in markers)  # no rank tables
    commits = list_commits(store)
    assert {c.version for c in commits} == {1} and all(c.ranks is None for c in commits)


@pytest.mark.parametrize("after", [2, 4, 6, 7, 9, 11])
def test_map_log_resumes_exactly(v1, after):
    root, tokens, batches = v1("map")
    loader = map_loader(root)
    loader.load_state_dict(tokens[after])
    got = [as_lists(b) for b in take(loader, 14 - after)]
    assert got == batches[after:]


def test_new_commits_on_an_old_log_carry_the_old_segments(v1):
    root, tokens, batches = v1("map")
    loader = map_loader(root)
    loader.load_state_dict(tokens[11])  # attempt 1's head: a version-1 marker
    got = [as_lists(b) for b in take(loader, 1)]
    token = loader.state_dict()  # the first version-2 marker, parent version 1
    head = read_commit(Store(root), token["commit"])
    assert head.version == 2 and read_commit(Store(root), head.parent).version == 1
    assert head.ranks is not None and head.ranks.newest(0) == head.segments[0]
    resumed = map_loader(root)
    resumed.load_state_dict(token)
    got += [as_lists(b) for b in take(resumed, 1)]
    assert got == batches[11:13]
    # A commit with no new segment names the rank's newest one (carried forward).
    again = map_loader(root)
    again.load_state_dict(token)
    assert again.state_dict()["commit"] == token["commit"]


@pytest.mark.parametrize("after", [1, 3])
def test_two_rank_map_log_resumes_on_one_rank(v1, after):
    # 23 samples, batch 4 on 2 ranks: 3 batches per rank per epoch. One rank continues
    # the epoch's order where the two stopped, so it serves what the one-rank run serves.
    root, tokens, _ = v1("map2")
    _, _, batches = v1("map")
    loader = map_loader(root)
    loader.load_state_dict(tokens[after])
    start = {1: 2, 3: 6}[after]  # one-rank batches covering the positions consumed
    got = [as_lists(b) for b in take(loader, 12 - start)]
    assert got == batches[start:12]


@pytest.mark.parametrize("after", [2, 4, 6])
def test_stream_log_resumes_exactly(v1, monkeypatch, tmp_path, after):
    _shards_moved(monkeypatch, tmp_path)
    root, tokens, batches = v1("stream")
    loader = stream_loader(root)
    loader.load_state_dict(tokens[after])
    got = [as_lists(b) for b in take(loader, 10 - after)]
    assert got == batches[after:]


def test_two_rank_stream_log_resumes_on_one_rank(v1, monkeypatch, tmp_path):
    _shards_moved(monkeypatch, tmp_path)
    root, tokens, _ = v1("stream2")
    loader = stream_loader(root)
    loader.load_state_dict(tokens[4])
    assert [b["tokens"].shape[1] for b in take(loader, 3)] == [16, 16, 16]
    token = loader.state_dict()
    again = stream_loader(root)
    again.load_state_dict(token)
    assert [as_lists(b) for b in take(again, 2)] == [as_lists(b) for b in take(loader, 2)]


@pytest.mark.parametrize("name", ["map", "map2", "stream", "stream2"])
def test_old_logs_verify_and_audit(v1, name):
    root, _, _ = v1(name)
    runner = CliRunner()
    verify = runner.invoke(main, ["verify", root])
    assert verify.exit_code == 0, verify.output
    audit = runner.invoke(main, ["audit", root, "--check", "coverage", "--check", "duplicates"])
    assert audit.exit_code == 0, audit.output


def test_old_log_audits_the_same_lineage(v1):
    root, _, batches = v1("map")
    con = connect(root, head="000000000011-0001")
    ids = [
        r[0]
        for r in con.sql(
            "select sample_id from lineage where kind = 'sample' order by batch, position"
        ).fetchall()
    ]
    assert ids == [i for b in batches[:11] for i in b["id"]]


# ---------------------------------------------------------------- rank-table layout 1
# tests/fixtures/ranks1 (by the ledger of e9bb53c): version-2 markers whose rank tables
# record no fingerprint of each rank's final batch, and a compaction catalog from then.


@pytest.fixture
def ranks1(tmp_path):
    """Copy of the layout-1 log: ``(root, tokens, batches)``."""
    root = str(tmp_path / "map")
    shutil.copytree(os.path.join(FIXTURES, "ranks1", "map"), root)
    with open(os.path.join(root, "tokens.json")) as f:
        tokens = {int(k): v for k, v in json.load(f).items()}
    for t in tokens.values():
        t["root"] = root
    with open(os.path.join(root, "batches.json")) as f:
        batches = json.load(f)
    return root, tokens, batches


def test_ranks1_fixture_has_layout_1():
    import pyarrow.parquet as pq

    from ledger import ranks

    root = os.path.join(FIXTURES, "ranks1", "map")
    for name in sorted(os.listdir(os.path.join(root, "commits"))):
        if name.endswith(".json"):
            with open(os.path.join(root, "commits", name)) as f:
                assert json.load(f)["ranks"]["encoding"] == ranks.ENCODING_V1
    (catalog,) = [n for n in os.listdir(os.path.join(root, "compactions")) if "commits" in n]
    assert "head" not in pq.read_schema(os.path.join(root, "compactions", catalog)).names
    commits = list_commits(Store(root))
    assert len(commits) == 5 and all(c.ranks.head == 26 for c in commits)
    assert all(c.ranks.final_batch(0) is None for c in commits)


@pytest.mark.parametrize("after", [2, 4, 6, 8])
def test_layout1_log_resumes_exactly_by_decoding(ranks1, monkeypatch, after):
    root, tokens, batches = ranks1
    decoded = count_decodes(monkeypatch)
    loader = make_v1.map_loader(root)
    loader.load_state_dict(tokens[after])
    if after == 8:  # a segment of its own (2, 4 and 6 sit in the compacted file)
        assert decoded == [5]  # the final batch's 4 samples and its digest row
    got = [as_lists(b) for b in take(loader, 11 - after)]
    assert got == batches[after:11]


def test_layout2_commit_on_a_layout1_log_resumes_by_the_marker(ranks1, monkeypatch):
    from ledger import ranks

    root, tokens, batches = ranks1
    loader = make_v1.map_loader(root)
    loader.load_state_dict(tokens[8])
    got = [as_lists(b) for b in take(loader, 2)]
    token = loader.state_dict()  # layout 2, its parent layout 1
    head = read_commit(Store(root), token["commit"])
    assert head.ranks.encoding == ranks.ENCODING and head.ranks.final_batch(0) is not None
    assert read_commit(Store(root), head.parent).ranks.head == 26
    decoded = count_decodes(monkeypatch)
    resumed = make_v1.map_loader(root)
    resumed.load_state_dict(token)
    assert decoded == []  # checked by the marker's fingerprint, not by decoding
    got += [as_lists(b) for b in take(resumed, 1)]
    assert got == batches[8:11]
    runner = CliRunner()
    verify = runner.invoke(main, ["verify", root])
    assert verify.exit_code == 0, verify.output
    compacted = compact(root, target_rows=1 << 20)  # a catalog of both layouts
    assert compacted.segments >= 2
    verify = runner.invoke(main, ["verify", root])
    assert verify.exit_code == 0, verify.output
    commits = list_commits(Store(root))
    assert sorted(c.ranks.head for c in commits) == [26] * 5 + [28]
    again = make_v1.map_loader(root)
    again.load_state_dict(token)
    assert [as_lists(b) for b in take(again, 1)] == batches[10:11]


@pytest.fixture
def carry1(tmp_path):
    """Copy of ``fixtures/carry1/stream`` (a change of worker count dealt round robin, by
    the ledger of 701e7b8), shard paths relocated; returns ``(root, shards, tokens,
    batches)``."""
    shards = str(tmp_path / "shards")
    shutil.copytree(os.path.join(FIXTURES, "v1", "shards"), shards)
    root = str(tmp_path / "stream")
    shutil.copytree(os.path.join(FIXTURES, "carry1", "stream"), root)
    run = os.path.join(root, "run.json")
    with open(run) as f:
        text = f.read()
    with open(run, "w") as f:
        f.write(text.replace("@SHARDS@", shards))
    with open(os.path.join(root, "tokens.json")) as f:
        tokens = {int(k): v for k, v in json.loads(f.read().replace("@ROOT@", root)).items()}
    with open(os.path.join(root, "batches.json")) as f:
        batches = json.load(f)
    return root, shards, tokens, batches


@pytest.mark.parametrize("after", [3, 6])
def test_a_log_dealt_round_robin_resumes_as_it_was_served(carry1, after):
    """The log's change of shape was dealt round robin: resuming it (the change itself, or
    a commit inside the epoch it carried) serves what that ledger served, not what
    ``row-blocks-v1`` would deal."""
    root, shards, tokens, batches = carry1
    with open(os.path.join(root, "run.json")) as f:
        assert "carry" not in json.load(f)["config"]
    loader = ledger.DataLoader(
        packed_stream(shards, shuffle_buffer=3), batch_size=2, shuffle=True, seed=5,
        log=root, num_workers=3, rng="sample",
    )  # fmt: skip
    loader.load_state_dict(tokens[after])
    got = [as_lists(b) for b in take(loader, 18 - after)]
    assert got == batches[after - 3 :]
