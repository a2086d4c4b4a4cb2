"""ledger.audit.queries and scan against ground truth: the batches a real loader handed
out (map-style and packed streams), and rows written by hand."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from conftest import Augmented
from logfactory import LogFactory, batch

import ledger
from ledger.audit import summarize
from ledger.audit.queries import materialize, reconstruct, show, where
from ledger.digest import batch_digest
from ledger.errors import LogCorrupted
from ledger.stream import Packer, SampleContext, ShardedSource, Stream


@pytest.fixture
def shards(tmp_path: Path) -> str:
    """Two JSONL shards of 9 and 6 documents of 1 to 30 bytes."""
    d = tmp_path / "shards"
    d.mkdir()
    k = 0
    for s, n in enumerate((9, 6)):
        with open(d / f"part-{s}.jsonl", "w") as f:
            for i in range(k, k + n):
                f.write(json.dumps({"text": f"doc{i} " + "xyz" * (i % 9)}) + "\n")
        k += n
    return str(d)


def augment(record: dict, ctx: SampleContext) -> np.ndarray:
    """Byte tokens, reversed on a coin flip drawn from the sample's seed (and recorded)."""
    tokens = np.frombuffer(record["text"].encode(), np.uint8).astype(np.int64) + 1
    flip = int(ctx.rng.integers(0, 2))
    ctx.record(flip=flip)
    return tokens[::-1].copy() if flip else tokens


def stream(shards: str, packed: bool) -> Stream:
    return Stream(
        ShardedSource(f"{shards}/*"),
        transform=augment,
        shuffle_buffer=4,
        packer=Packer(seq_len=16) if packed else None,
    )


def _pad(items: list[np.ndarray]) -> torch.Tensor:
    out = torch.zeros(len(items), 40, dtype=torch.int64)
    for i, x in enumerate(items):
        out[i, : len(x)] = torch.from_numpy(x)
    return out


def test_materialize_every_batch_of_a_map_style_run(tmp_path: Path) -> None:
    root = str(tmp_path / "log")
    loader = ledger.DataLoader(
        Augmented(22), batch_size=4, shuffle=True, seed=5, log=root, num_workers=2
    )
    received = [b for _ in range(2) for b in loader]  # two epochs, last batches short
    loader.state_dict()
    for b, got in enumerate(received):
        made = materialize(root, b, Augmented(22))
        assert made.matches and made.digest == batch_digest(got)
        assert all(torch.equal(made.data[k], got[k]) for k in got)
        assert made.record.sample_ids.tolist() == got["id"].tolist()


@pytest.mark.parametrize("packed", [False, True])
def test_materialize_and_reconstruct_a_stream(shards: str, tmp_path: Path, packed: bool) -> None:
    root = str(tmp_path / "log")
    collate = None if packed else _pad
    loader = ledger.DataLoader(
        stream(shards, packed), batch_size=3, shuffle=True, seed=2, log=root,
        num_workers=2, collate_fn=collate,
    )  # fmt: skip
    received = list(loader)
    commit = loader.state_dict()["commit"]
    for b, got in enumerate(received):
        made = materialize(root, b, stream(shards, packed), collate_fn=collate)
        assert made.matches, b
        if packed:
            assert torch.equal(made.data["tokens"], got["tokens"])
        else:
            assert torch.equal(made.data, got)
    out = tmp_path / "seen.parquet"
    reconstruct(root, commit, out)
    seen = pq.read_table(out)
    if not packed:
        return
    # Ground truth for packing: per sequence, the runs of each sample's tokens.
    expected = []
    for b, got in enumerate(received):
        for row in got["sample_ids"].tolist():
            runs: list[list[int]] = []
            for sid in row:
                if sid < 0:
                    continue
                if runs and runs[-1][0] == sid:
                    runs[-1][1] += 1
                else:
                    runs.append([sid, 1])
            expected += [(b, sid, n) for sid, n in runs]
    got_rows = [
        (r["batch"], r["sample_id"], r["token_end"] - r["token_start"]) for r in seen.to_pylist()
    ]
    assert got_rows == expected
    assert seen["ordinal"].to_pylist() == list(range(seen.num_rows))
    # Every token of every document was seen exactly once in the epoch.
    per_doc: dict[int, int] = {}
    for r in seen.to_pylist():
        per_doc[r["sample_id"]] = per_doc.get(r["sample_id"], 0) + r["token_end"] - r["token_start"]
        assert per_doc[r["sample_id"]] <= r["length"]
    assert len(per_doc) == 15
    assert all(per_doc[r["sample_id"]] == r["length"] for r in seen.to_pylist())


def test_materialize_detects_a_changed_transform(shards: str, tmp_path: Path) -> None:
    root = str(tmp_path / "log")
    loader = ledger.DataLoader(stream(shards, True), batch_size=2, log=root)
    list(loader)
    loader.state_dict()

    def other(record: dict, ctx: SampleContext) -> np.ndarray:
        return augment(record, ctx)[:-1]  # one token shorter

    changed = Stream(
        ShardedSource(f"{shards}/*"), transform=other, shuffle_buffer=4, packer=Packer(16)
    )
    with pytest.raises(ledger.errors.LedgerError, match="the data or the transform changed"):
        materialize(root, 0, changed)


def test_where_and_show_see_uncommitted_batches(tmp_path: Path) -> None:
    root = str(tmp_path / "log")
    loader = ledger.DataLoader(Augmented(12), batch_size=3, shuffle=True, seed=1, log=root)
    it = iter(loader)
    next(it)
    loader.state_dict()
    lost = next(it)["id"].tolist()  # consumed, journaled, never committed
    h = where(root, lost[0])
    assert [(c.batch, c.commit_id, c.in_lineage) for c in h.consumptions] == [(1, None, False)]
    assert h.commits == ()
    with pytest.raises(ledger.errors.CommitNotFound, match="no batch 1 of rank 0"):
        show(root, 1)


def test_scan_rejects_an_id_outside_the_dataset(tmp_path: Path) -> None:
    f = LogFactory(tmp_path)  # a dataset of 10 samples
    f.attempt(0, None)
    f.commit(0, 1, None, batch(0, 0, 0, 0, ids=[1, 10, 2]), (0, 1))
    with pytest.raises(LogCorrupted, match="sample id 10, outside the dataset's"):
        summarize(str(tmp_path))
