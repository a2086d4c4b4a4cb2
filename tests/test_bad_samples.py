"""on_error="skip": bad samples left out of their batch, logged, deterministic, exact."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import ledger
from ledger.audit import connect
from ledger.audit.queries import materialize
from ledger.errors import SampleError
from ledger.order import EpochOrder
from ledger.testing import assert_resume_exact, batches_equal, take

BAD = {3, 10, 11, 17}
N, B = 23, 4


class Flaky:
    """Map-style dataset whose samples in ``bad`` raise; the others draw from torch's RNG
    (so a failure that shifted the draws of its batch-mates would show)."""

    def __init__(self, n: int = N, bad: set[int] = BAD) -> None:
        self.n, self.bad = n, bad

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        x = torch.rand(2)
        if i in self.bad:
            raise ValueError(f"corrupt record {i}")
        return {"id": torch.tensor(i), "x": x}


class FlakyBatched(Flaky):
    """The same with a batched ``__getitems__`` (as HF datasets): one bad id fails it all."""

    def __getitems__(self, ids: list[int]) -> list[dict[str, torch.Tensor]]:
        return [self[i] for i in ids]


def _loader(root, dataset=None, **kw):
    kw = {"batch_size": B, "shuffle": True, "seed": 7, "log": root, "on_error": "skip", **kw}
    return ledger.DataLoader(dataset if dataset is not None else Flaky(), **kw)


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("dataset", [Flaky, FlakyBatched])
def test_bad_samples_are_left_out_and_logged(root, workers, dataset):
    loader = _loader(root, dataset(), num_workers=workers)
    batches = list(take(loader, 12))  # two epochs of 6 batches
    loader.state_dict()
    for epoch in range(2):
        order = EpochOrder(N, 7, epoch, True).sample_ids(np.arange(N))
        for k in range(6):
            want = [i for i in order[k * B : (k + 1) * B].tolist() if i not in BAD]
            assert batches[epoch * 6 + k]["id"].tolist() == want
    con = connect(root)
    rows = con.sql(
        "select epoch, batch, position, sample_id, value from lineage where kind = 'error' "
        "order by batch, position"
    ).fetchall()
    assert sorted((e, s) for e, _, _, s, _ in rows) == [
        (e, s) for e in range(2) for s in sorted(BAD)
    ]
    for epoch, batch, position, sid, value in rows:
        assert EpochOrder(N, 7, epoch, True).sample_ids(np.array([position]))[0] == sid
        assert batch == epoch * 6 + position // B
        assert json.loads(value) == {"type": "ValueError", "message": f"corrupt record {sid}"}


@pytest.mark.parametrize("workers", [0, 2])
def test_a_failed_getitems_is_retried_under_the_batch_seed(tmp_path, workers):
    """A batched ``__getitems__`` that raises is retried one sample at a time after
    re-seeding as before the batched call: the good samples draw what they draw without
    ``__getitems__`` (the per-sample fetch), not what follows the failed call's draws."""
    plain = list(take(_loader(str(tmp_path / "a"), Flaky(), num_workers=workers), 6))
    batched = list(take(_loader(str(tmp_path / "b"), FlakyBatched(), num_workers=workers), 6))
    assert any(len(b["id"]) < B for b in plain)  # some batch held a bad sample
    assert len(plain) == len(batched) == 6
    for p, q in zip(plain, batched, strict=True):
        assert batches_equal(p, q)


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_is_exact_with_bad_samples(tmp_path, workers):
    root = str(tmp_path / "log")
    checked = assert_resume_exact(
        # verify_data: each resume re-creates its last batch, bad samples and all
        lambda: _loader(root, FlakyBatched(), num_workers=workers, verify_data=True),
        batches=14,
        every=3,
    )
    assert checked == 4


def test_same_draws_on_every_run(tmp_path):
    a = list(take(_loader(str(tmp_path / "a")), 6))
    b = list(take(_loader(str(tmp_path / "b"), num_workers=2), 6))
    assert all(batches_equal(x, y) for x, y in zip(a, b, strict=True))


def test_raise_is_the_default(root):
    loader = ledger.DataLoader(Flaky(), batch_size=B, shuffle=False, seed=7, log=root)
    with pytest.raises(ValueError, match="corrupt record 3"):
        list(loader)


def test_a_batch_of_bad_samples_raises_sample_error(root):
    loader = _loader(root, Flaky(bad={4, 5, 6, 7}), shuffle=False)
    with pytest.raises(
        SampleError, match=r"every sample of batch 1 .*ValueError: corrupt record 4"
    ):
        list(loader)


@pytest.mark.parametrize("dataset", [Flaky, FlakyBatched])
def test_materialize_recreates_a_batch_with_a_bad_sample(root, dataset):
    loader = _loader(root, dataset())
    batches = list(take(loader, 6))
    loader.state_dict()
    con = connect(root)
    errors = con.sql("select distinct batch from lineage where kind = 'error'").fetchall()
    assert len(errors) == 3  # 10 and 11 share a batch
    for (batch,) in errors:  # bad samples first, last and in the middle of their batch
        made = materialize(root, batch, dataset(), rank=0)
        assert made.matches
        assert torch.equal(made.data["x"], batches[batch]["x"])


STREAM_ROWS, STREAM_BAD = 29, {0, 4, 5, 13, 26, 27, 28}


@pytest.fixture
def stream_shards(tmp_path):
    """Three JSONL shards of 29 rows in all; the rows in ``STREAM_BAD`` are corrupt."""
    d = tmp_path / "shards"
    d.mkdir()
    k = 0
    for s, n in enumerate((11, 10, 8)):
        with open(d / f"part-{s}.jsonl", "w") as f:
            for i in range(k, k + n):
                f.write(json.dumps({"id": i, "text": f"doc {i} " + "xyz"[: i % 4]}) + "\n")
        k += n
    return str(d)


def _stream_transform(record, ctx):
    if record["id"] in STREAM_BAD:
        raise ValueError(f"corrupt record {record['id']}")
    ctx.record(flip=int(ctx.rng.integers(0, 2)))
    return np.frombuffer(record["text"].encode(), np.uint8).astype(np.int64) + 1


def _flaky_stream(shards: str, packing: bool, transform=_stream_transform, buffer: int = 5):
    from ledger.stream import Packer, ShardedSource, Stream

    def item(record, ctx):  # unpacked: the id and the tokens
        return {"id": torch.tensor(record["id"]), "n": torch.tensor(len(transform(record, ctx)))}

    return Stream(
        ShardedSource(f"{shards}/*"),
        transform=transform if packing else item,
        shuffle_buffer=buffer,
        packer=Packer(seq_len=8) if packing else None,
    )


def _stream_loader(root, shards, packing, workers, **kw):
    return ledger.DataLoader(
        _flaky_stream(shards, packing), batch_size=3, shuffle=True, seed=5, log=root,
        num_workers=workers, on_error="skip", **kw,
    )  # fmt: skip


def _served_ids(batch, packing):
    if packing:
        owners = batch["sample_ids"].numpy()
        return sorted(set(owners[owners >= 0].tolist()))
    return batch["id"].tolist()


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("packing", [False, True])
def test_a_stream_leaves_out_bad_samples_and_logs_them(tmp_path, stream_shards, workers, packing):

    root = str(tmp_path / "log")
    loader = _stream_loader(root, stream_shards, packing, workers)
    epochs = [[b for b in loader] for _ in range(2)]
    loader.state_dict()
    good = set(range(STREAM_ROWS)) - STREAM_BAD
    for batches in epochs:
        served = [i for b in batches for i in _served_ids(b, packing)]
        if not packing:  # full batches but the last of each worker: failed ones replaced
            assert sorted(served) == sorted(good)
            assert sum(len(b["id"]) < 3 for b in batches) <= max(workers, 1)
        else:
            assert set(served) == good
    # The same stream without failures, with the bad ids removed: the same ids, in order
    # per logical worker (a failure takes no place in the shuffled stream).
    clean = ledger.DataLoader(
        _flaky_stream(stream_shards, packing, transform=_tokens_of_all), batch_size=3,
        shuffle=True, seed=5, log=str(tmp_path / "clean"), num_workers=workers,
    )  # fmt: skip
    want = [b for b in clean]
    clean.state_dict()
    con, con_clean = connect(root), connect(str(tmp_path / "clean"))
    got = _per_worker(con, epochs[0], packing)
    expected = _per_worker(con_clean, want, packing)
    assert got.keys() == expected.keys()
    for w, ids in expected.items():
        assert got[w] == [i for i in ids if i not in STREAM_BAD]
    rows = con.sql(
        "select epoch, worker, sample_id, position, value from lineage where kind = 'error' "
        "order by epoch, sample_id"
    ).fetchall()
    assert [(e, s) for e, _, s, _, _ in rows] == [
        (e, s) for e in range(2) for s in sorted(STREAM_BAD)
    ]
    # At the position the sample has in the epoch's plan (the clean run's, for epoch 0).
    kind = "span" if packing else "sample"
    clean_positions = dict(
        con_clean.sql(
            f"select sample_id, min(position) from lineage where kind = '{kind}' group by 1"
        ).fetchall()
    )
    for epoch, _, sid, position, value in rows:
        assert json.loads(value) == {"type": "ValueError", "message": f"corrupt record {sid}"}
        if epoch == 0:
            assert position == clean_positions[sid]


def _per_worker(con, batches, packing):
    """Epoch 0's samples in the order each logical worker served them (a packed sample
    once, where it begins)."""
    workers = dict(
        con.sql(
            "select distinct batch, worker from lineage where epoch = 0 and kind in "
            "('sample', 'span')"
        ).fetchall()
    )
    out: dict[int, list[int]] = {}
    for k, batch in enumerate(batches):
        ids = out.setdefault(workers[k], [])
        if packing:
            for i in batch["sample_ids"].reshape(-1).tolist():
                if i >= 0 and i not in ids:
                    ids.append(i)
        else:
            ids.extend(batch["id"].tolist())
    return out


def _tokens_of_all(record, ctx):
    ctx.record(flip=int(ctx.rng.integers(0, 2)))
    return np.frombuffer(record["text"].encode(), np.uint8).astype(np.int64) + 1


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("packing", [False, True])
def test_a_stream_resumes_exactly_with_bad_samples(tmp_path, stream_shards, workers, packing):
    root = str(tmp_path / "log")
    checked = assert_resume_exact(
        lambda: _stream_loader(root, stream_shards, packing, workers, verify_data=True),
        batches=16,
        every=2,
    )
    assert checked == 8


@pytest.mark.parametrize("packing", [False, True])
def test_failures_after_a_workers_last_good_sample_ride_with_its_last_batch(
    tmp_path, stream_shards, packing
):
    root = str(tmp_path / "log")

    def make():
        return ledger.DataLoader(
            # 22 good samples: the last of 11 batches of 2 is full, so the failures
            # after it are found only when the worker looks for a 12th
            _flaky_stream(stream_shards, packing, buffer=0), batch_size=2, shuffle=False,
            seed=5, log=root, on_error="skip", verify_data=True,
        )  # fmt: skip

    loader = make()
    batches = list(loader)
    loader.state_dict()
    served = list(dict.fromkeys(i for b in batches for i in _served_ids(b, packing)))
    assert served == sorted(set(range(STREAM_ROWS)) - STREAM_BAD)  # in order: no shuffle
    last = len(batches) - 1
    rows = (
        connect(root)
        .sql("select batch, sample_id from lineage where kind = 'error' order by sample_id")
        .fetchall()
    )
    assert rows[0] == (0, 0) and rows[-3:] == [(last, 26), (last, 27), (last, 28)]
    assert assert_resume_exact(make, batches=2 * len(batches), every=1) == 2 * len(batches)


def test_a_stream_whose_rest_all_fails_raises_sample_error(tmp_path, stream_shards):
    from ledger.stream import ShardedSource, Stream

    def broken(record, ctx):
        raise OSError("unreadable")

    loader = ledger.DataLoader(
        Stream(ShardedSource(f"{stream_shards}/*"), transform=broken), batch_size=3,
        seed=1, log=str(tmp_path / "log"), on_error="skip", collate_fn=lambda x: x,
    )  # fmt: skip
    with pytest.raises(SampleError, match="every sample left to worker 0 in epoch 0"):
        list(loader)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_transforms_stop_iteration_is_a_bad_sample_under_skip(tmp_path, stream_shards, workers):
    """With ``on_error="skip"`` a transform that raises StopIteration (which would end a
    worker's rows early, unnamed) loses that sample only, logged with the reason; the rest
    of the epoch is served."""
    from ledger.stream import ShardedSource, Stream

    def stops(record, ctx):
        if record["id"] in STREAM_BAD:
            raise StopIteration
        return record["id"]

    root = str(tmp_path / "log")
    loader = ledger.DataLoader(
        Stream(ShardedSource(f"{stream_shards}/*"), transform=stops, shuffle_buffer=5),
        batch_size=3, shuffle=True, seed=5, log=root, num_workers=workers, on_error="skip",
    )  # fmt: skip
    served = [i for b in loader for i in b.tolist()]
    loader.state_dict()
    assert sorted(served) == sorted(set(range(STREAM_ROWS)) - STREAM_BAD)
    rows = _error_rows(root)
    assert [s for s, _ in rows] == sorted(STREAM_BAD)
    for sid, failure in rows:
        assert failure["message"].startswith(f"the transform raised StopIteration for sample {sid}")


def _error_rows(root: str) -> list[tuple[int, dict]]:
    """The lineage's ``error`` events of ``root``: (sample id, its value as JSON), by id."""
    rows = (
        connect(root)
        .sql("select sample_id, value from lineage where kind = 'error' order by sample_id")
        .fetchall()
    )
    return [(sid, json.loads(value)) for sid, value in rows]


def test_the_audit_lists_a_streams_bad_samples(tmp_path, stream_shards):
    from click.testing import CliRunner

    from ledger.cli import main

    root = str(tmp_path / "log")
    loader = _stream_loader(root, stream_shards, True, 0)
    list(loader)
    loader.state_dict()
    checked = CliRunner().invoke(main, ["audit", root, "--check", "coverage"])
    assert checked.exit_code == 0, checked.output  # bad samples are accounted for
    out = CliRunner().invoke(main, ["audit", root, "--format", "json"])
    assert out.exit_code == 0, out.output
    listed = json.loads(out.output)["bad_samples"]
    assert sorted(b["sample_id"] for b in listed) == sorted(STREAM_BAD)


def test_on_error_is_validated(root):
    with pytest.raises(ValueError, match="on_error must be"):
        ledger.DataLoader(Flaky(), batch_size=B, seed=1, log=root, on_error="ignore")


def test_a_mixture_leaves_out_bad_samples_of_a_source(tmp_path):
    from ledger.mixture import Mixture

    def make():
        mix = Mixture({"good": Flaky(11, set()), "bad": FlakyBatched(13, {2, 7})},
                      weights={"good": 0.5, "bad": 0.5})  # fmt: skip
        return _loader(str(tmp_path / "log"), mix, num_workers=2, verify_data=True)

    assert assert_resume_exact(make, batches=10, every=3) == 3
    con = connect(str(tmp_path / "log"))
    rows = con.sql(
        "select source, sample_id, value from lineage where kind = 'error' order by batch"
    ).fetchall()
    assert {(s, i) for s, i, _ in rows} == {("bad", 2), ("bad", 7)}
    assert all(json.loads(v)["message"] == f"corrupt record {i}" for _, i, v in rows)


@pytest.mark.parametrize("packing", [False, True])
def test_a_stream_with_bad_samples_resumes_elastically(tmp_path, stream_shards, packing):
    root = str(tmp_path / "log")
    run = _stream_loader(root, stream_shards, packing, 2)
    first = list(take(run, 3))
    token = run.state_dict()
    resumed = _stream_loader(root, stream_shards, packing, 0)  # 2 logical workers -> 1
    resumed.load_state_dict(token)
    rest = list(resumed)  # the rest of epoch 0
    resumed.state_dict()
    served = [i for b in first + rest for i in _served_ids(b, packing)]
    good = set(range(STREAM_ROWS)) - STREAM_BAD
    if packing:  # a sample split across batches shows in both
        assert set(served) == good
    else:
        assert sorted(served) == sorted(good)  # every good sample once
    errors = (
        connect(root)
        .sql("select sample_id from lineage where kind = 'error' and epoch = 0 order by 1")
        .fetchall()
    )
    assert [s for (s,) in errors] == sorted(STREAM_BAD)  # every bad one once


def _damaged_shards(tmp_path, stream_shards):
    """The rows of ``stream_shards`` with the lines of ``STREAM_BAD`` damaged (a torn
    object, a JSON list, bytes that are not UTF-8) instead of transforms that raise."""
    d = tmp_path / "damaged"
    d.mkdir()
    damage = [b'{"id": 1, "text": "torn', b"[1, 2]", b"\xff\xfe"]
    for k, path in enumerate(sorted((tmp_path / "shards").iterdir())):
        lines = path.read_bytes().splitlines()
        for i, line in enumerate(lines):
            if json.loads(line)["id"] in STREAM_BAD:
                lines[i] = damage[(k + i) % len(damage)]
        (d / path.name).write_bytes(b"\n".join(lines) + b"\n")
    return str(d)


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("packing", [False, True])
def test_a_jsonl_line_that_is_no_json_object_is_a_bad_sample_under_skip(
    tmp_path, stream_shards, workers, packing
):
    """With ``on_error="skip"`` a damaged JSONL line fails its sample's loading like a
    transform that raises: left out, logged as an ``error`` event whose value is the
    DataError naming the file, the line and the sample id, and every resume is exact;
    with the default ``on_error="raise"`` it stops the run with that DataError."""
    from ledger.errors import DataError
    from ledger.stream import Packer, ShardedSource, Stream

    shards = _damaged_shards(tmp_path, stream_shards)

    def item(record, ctx):
        return {"id": torch.tensor(record["id"]), "n": torch.tensor(len(record["text"]))}

    def make(log: str, **kw) -> ledger.DataLoader:
        stream = Stream(
            ShardedSource(f"{shards}/*"),
            transform=_tokens_of_all if packing else item,
            shuffle_buffer=5,
            packer=Packer(seq_len=8) if packing else None,
        )
        return ledger.DataLoader(
            stream, batch_size=3, shuffle=True, seed=5, log=log, num_workers=workers, **kw
        )

    root = str(tmp_path / "log")
    loader = make(root, on_error="skip")
    batches = list(loader)
    loader.state_dict()
    served = [i for b in batches for i in _served_ids(b, packing)]
    good = set(range(STREAM_ROWS)) - STREAM_BAD
    assert set(served) == good
    if not packing:
        assert len(served) == len(good)
    rows = _error_rows(root)
    assert [s for s, _ in rows] == sorted(STREAM_BAD)
    for sid, failure in rows:
        assert failure["type"] == "ledger.errors.DataError"
        assert f"(sample id {sid}) is " in failure["message"]
        assert "a JSONL shard holds one JSON object per line" in failure["message"]
    # The same stream with transforms that raise for those rows serves the same batches.
    twin = ledger.DataLoader(
        _flaky_stream(stream_shards, packing, buffer=5), batch_size=3, shuffle=True, seed=5,
        log=str(tmp_path / "twin"), num_workers=workers, on_error="skip",
    )  # fmt: skip
    if packing:  # the twin's transform is _stream_transform: the same tokens and draws
        assert batches_equal(batches, list(twin))
    else:
        assert [b["id"].tolist() for b in batches] == [b["id"].tolist() for b in twin]
    resumed = assert_resume_exact(
        lambda: make(str(tmp_path / "resumed"), on_error="skip", verify_data=True),
        batches=len(batches) + 4,
        every=2,
    )
    assert resumed == (len(batches) + 4) // 2
    with pytest.raises(DataError, match=r"line \d+ \(sample id \d+\) is "):
        list(make(str(tmp_path / "raise")))
