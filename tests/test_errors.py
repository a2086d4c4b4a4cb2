"""Bad input gets a typed error naming both values; nothing committed is lost."""

from __future__ import annotations

import json
import os
import re
import sys

import fsspec.registry  # noqa: F401  (the module, patched below)
import numpy as np
import pytest
import torch
from click.testing import CliRunner
from conftest import Augmented

import ledger
from ledger.cli import main
from ledger.commits import read_commit
from ledger.errors import (
    CommitNotFound,
    ConfigMismatch,
    DataError,
    LedgerError,
    LogCorrupted,
    ResumeMismatch,
    StorageError,
    TokenError,
    UnsupportedArgument,
    WrongRoot,
)
from ledger.store import Store
from ledger.stream import Packer, ShardedSource, Stream
from ledger.stream.source import BadRecord
from ledger.testing import take


def _token(root, **kw):
    args = dict(batch_size=4, shuffle=True, seed=0, drop_last=False)
    args.update(kw)
    loader = ledger.DataLoader(Augmented(20), log=root, **args)
    list(take(loader, 3))
    return loader.state_dict()


@pytest.mark.parametrize(
    "field,kwargs,dataset_len,expected,found",
    [
        ("dataset_len", {}, 21, 20, 21),
        ("seed", {"seed": 5}, 20, 0, 5),
        ("batch_size", {"batch_size": 5}, 20, 4, 5),
        ("drop_last", {"drop_last": True}, 20, False, True),
        ("shuffle", {"shuffle": False}, 20, True, False),
    ],
)
def test_changed_config_is_refused_naming_both_values(
    root, field, kwargs, dataset_len, expected, found
):
    token = _token(root)
    args = dict(batch_size=4, shuffle=True, seed=0, drop_last=False)
    args.update(kwargs)
    resumed = ledger.DataLoader(Augmented(dataset_len), log=root, **args)
    with pytest.raises(ConfigMismatch) as info:
        resumed.load_state_dict(token)
    err = info.value
    assert (err.field, err.expected, err.found) == (field, expected, found)
    msg = str(err)
    assert f"{field}={expected!r}" in msg and f"{field}={found!r}" in msg
    assert "Resume with" in msg or "resume with" in msg


def test_token_from_another_root_is_refused(tmp_path):
    token = _token(str(tmp_path / "a"))
    other = ledger.DataLoader(Augmented(20), batch_size=4, shuffle=True, log=str(tmp_path / "b"))
    with pytest.raises(WrongRoot, match="pass log="):
        other.load_state_dict(token)


def test_token_of_a_recreated_root_is_refused(root, tmp_path):
    token = _token(root)
    os.rename(root, str(tmp_path / "old"))
    _token(root)  # a new run under the same path
    fresh = ledger.DataLoader(Augmented(20), batch_size=4, shuffle=True, seed=0, log=root)
    with pytest.raises(WrongRoot, match="recreated"):
        fresh.load_state_dict(token)


def test_malformed_tokens(root):
    loader = ledger.DataLoader(Augmented(20), batch_size=4, seed=0, log=root)
    with pytest.raises(TokenError):
        loader.load_state_dict({"version": 1})
    token = _token(root, shuffle=False)
    with pytest.raises(TokenError, match="version 99"):
        loader.load_state_dict({**token, "version": 99})
    with pytest.raises(CommitNotFound):
        loader.load_state_dict({**token, "commit": "000000009999-0000"})


def _damage(root, token, where):
    seg = os.path.join(root, read_commit(Store(root), token["commit"]).segments[0].path)
    if where == "missing":
        os.unlink(seg)
        return
    with open(seg, "r+b") as f:
        f.seek(-20, os.SEEK_END) if where == "footer" else f.seek(8)
        f.write(b"\0" * 4)


_DAMAGE_MESSAGES = {
    "footer": "sha256",
    "first row group": "sha256",
    "missing": r"seg-000000000003\.parquet named by a commit marker",
}


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("where", ["footer", "first row group", "missing"])
def test_damaged_newest_segment_is_raised_before_any_batch(root, where, workers):
    # A resume checks the final batch by the marker's fingerprint and hashes (reads) the
    # newest segment on a background thread, joined before the first batch is handed
    # out: load_state_dict returns, and the damage is raised by the first next(), by
    # every later one and by state_dict(); no batch reaches the loop, nothing is committed.
    token = _token(root)
    _damage(root, token, where)
    commits = sorted(os.listdir(os.path.join(root, "commits")))
    fresh = ledger.DataLoader(
        Augmented(20), batch_size=4, shuffle=True, seed=0, log=root, num_workers=workers
    )
    fresh.load_state_dict(token)
    handed: list = []
    for _ in range(2):
        with pytest.raises(LogCorrupted, match=_DAMAGE_MESSAGES[where]):
            handed.extend(take(fresh, 1))
    with pytest.raises(LogCorrupted, match=_DAMAGE_MESSAGES[where]):
        fresh.state_dict()
    with pytest.raises(LogCorrupted, match=_DAMAGE_MESSAGES[where]):
        fresh.skip(1, reason="test")
    assert handed == []
    assert sorted(os.listdir(os.path.join(root, "commits"))) == commits
    fresh.close()


@pytest.mark.parametrize("where", ["footer", "first row group", "missing"])
def test_damaged_segment_without_a_fingerprint_is_raised_by_load_state_dict(
    root, where, monkeypatch
):
    # A marker recording no fingerprint (rank-table layout 1, tests/test_compat.py) is
    # resumed by decoding the segment: the damage is raised by load_state_dict itself.
    from ledger.ranks import RankTable

    monkeypatch.setattr(RankTable, "final_batch", lambda self, rank: None)
    token = _token(root)
    _damage(root, token, where)
    fresh = ledger.DataLoader(Augmented(20), batch_size=4, shuffle=True, seed=0, log=root)
    with pytest.raises(LogCorrupted, match=_DAMAGE_MESSAGES[where]):
        fresh.load_state_dict(token)


def test_a_fingerprint_that_disagrees_with_its_segment_is_refused(root, monkeypatch):
    # The segment continues the log exactly but the marker's fingerprint of its final
    # batch differs: the marker and its segment disagree.
    from ledger.ranks import RankTable

    token = _token(root)
    monkeypatch.setattr(RankTable, "final_batch", lambda self, rank: 12345)
    fresh = ledger.DataLoader(Augmented(20), batch_size=4, shuffle=True, seed=0, log=root)
    with pytest.raises(LogCorrupted, match="fingerprint of rank 0's final batch"):
        fresh.load_state_dict(token)


def test_changed_order_is_caught_by_verification_not_config(root, monkeypatch):
    token = _token(root)
    # Same configuration, different order function (e.g. a changed algorithm that kept
    # its name): replay recomputes the last batch and refuses.
    monkeypatch.setattr(ledger.order, "ROUNDS", 4)
    fresh = ledger.DataLoader(Augmented(20), batch_size=4, shuffle=True, seed=0, log=root)
    with pytest.raises(ResumeMismatch, match="order puts sample"):
        fresh.load_state_dict(token)


def test_empty_epoch_configuration_is_refused(root):
    with pytest.raises(UnsupportedArgument, match="holds no batch"):
        ledger.DataLoader(Augmented(3), batch_size=4, drop_last=True, log=root)


class _Len:
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return i


class _LenRaises(_Len):
    """A dataset whose ``__len__`` raises what a lazy or streamed dataset may raise."""

    def __init__(self, error):
        super().__init__(0)
        self.error = error

    def __len__(self):
        raise self.error


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"seed": 1.5}, r"seed must be an integer in \[-2\*\*63, 2\*\*64\), got 1\.5"),
        ({"seed": "3"}, "seed must be an integer"),
        ({"seed": 2**64}, "seed must be an integer"),
        ({"rank": 2, "world_size": 2}, "rank=2 is outside world_size=2"),
        ({"rank": -1}, "rank must be an int >= 0, got -1"),
        ({"world_size": 0}, "world_size must be an int >= 1, got 0"),
        ({"world_size": 2}, "needs torch.distributed to be initialised"),
        ({"num_workers": 1.5}, "num_workers must be an int >= 0, got 1.5"),
        ({"num_workers": 2, "prefetch_factor": 0}, "prefetch_factor must be an int >= 1, got 0"),
        ({"num_workers": 2, "prefetch_factor": 1.5}, "prefetch_factor must be an int >= 1"),
        ({"prefetch_factor": 2}, "prefetch_factor=2 needs worker processes"),
        ({"timeout": -1}, "timeout must be a number of seconds >= 0, got -1"),
        ({"num_workers": 2, "timeout": float("nan")}, "timeout must be a number of seconds"),
        ({"log": None}, "log must be the log root .* got None"),
        ({"log": ""}, "log must be the log root .* an empty path would write"),
        ({"rng": "bogus"}, "rng must be one of"),
        ({"on_error": ["skip"]}, "on_error must be 'raise' or 'skip'"),
        ({"dataset": _Len(-1)}, r"len\(\) of the dataset \(_Len\) failed: __len__\(\) should"),
        ({"dataset": _Len(2.5)}, r"len\(\) of the dataset \(_Len\) failed"),
        ({"dataset": _Len(0)}, "an epoch of 0 samples holds no batch"),
        ({"dataset": _LenRaises(NotImplementedError("streamed"))}, "failed: streamed"),
        ({"dataset": _LenRaises(RuntimeError("not loaded"))}, "failed: not loaded"),
    ],
)
def test_a_bad_argument_is_refused_at_construction(root, kwargs, match):
    """Hostile arguments are an UnsupportedArgument (a ValueError) naming the argument,
    raised by the constructor, not a TypeError or OverflowError from deep inside torch."""
    args = {"dataset": Augmented(8), "batch_size": 2, "seed": 0, "log": root, **kwargs}
    with pytest.raises(UnsupportedArgument, match=match):
        ledger.DataLoader(args.pop("dataset"), **args)


def test_a_seed_of_2_63_or_more_resumes_and_audits(root):
    """torch.manual_seed takes seeds up to 2**64 - 1: such a run resumes, and the run view
    (BIGINT) shows the seed's int64 bits instead of failing the audit."""
    token = _token(root, seed=2**64 - 1)
    resumed = ledger.DataLoader(
        Augmented(20), batch_size=4, shuffle=True, seed=2**64 - 1, drop_last=False, log=root
    )
    resumed.load_state_dict(token)
    assert len(list(take(resumed, 1))) == 1
    result = CliRunner().invoke(
        main, ["audit", root, "--sql", "SELECT seed FROM run", "--format", "csv"]
    )
    assert result.exit_code == 0 and result.output == "seed\n-1\n", result.output


def test_token_loads_with_weights_only(root, tmp_path):
    token = _token(root)
    path = tmp_path / "ck.pt"
    torch.save({"data": token}, path)
    assert torch.load(path, weights_only=True)["data"] == token
    assert all(isinstance(v, (int, str)) for v in token.values())


def test_mangled_marker_is_a_typed_error(root):
    token = _token(root)
    path = os.path.join(root, "commits", f"{token['commit']}.json")
    with open(path) as f:
        marker = json.load(f)
    del marker["ranks"]  # the rank table's reference (states and segments)
    with open(path, "w") as f:
        json.dump(marker, f)
    fresh = ledger.DataLoader(Augmented(20), batch_size=4, shuffle=True, seed=0, log=root)
    with pytest.raises(LogCorrupted, match="ranks"):
        fresh.load_state_dict(token)
    with open(path, "w") as f:
        f.write("{not json")
    with pytest.raises(LogCorrupted, match="not valid JSON"):
        fresh.load_state_dict(token)


@pytest.mark.parametrize("size", [None, -1, "12", 1.5, True, 2**70])
def test_a_marker_whose_manifest_size_is_mangled_is_named(root, size):
    """The manifest reference's byte count is checked as its path and SHA-256 are:
    ``verify`` fails the marker and a resume from it names the field."""
    token = _token(root)
    path = os.path.join(root, "commits", f"{token['commit']}.json")
    with open(path) as f:
        marker = json.load(f)
    marker["manifest"]["bytes"] = size
    with open(path, "w") as f:
        json.dump(marker, f)
    result = CliRunner().invoke(main, ["verify", root, "--format", "json"])
    assert result.exit_code == 3
    markers = next(r for r in json.loads(result.output) if r["check"] == "markers")
    assert not markers["ok"] and "'bytes'" in markers["detail"]
    fresh = ledger.DataLoader(Augmented(20), batch_size=4, shuffle=True, seed=0, log=root)
    with pytest.raises(LogCorrupted, match="'bytes'"):
        fresh.load_state_dict(token)


def test_a_root_ledger_cannot_open_is_a_storage_error(monkeypatch):
    with pytest.raises(StorageError, match="Protocol not known: nope"):
        Store("nope://bucket/run")
    monkeypatch.setitem(sys.modules, "s3fs", None)  # s3fs not installed...
    monkeypatch.setattr(sys.modules["fsspec.registry"], "registry", {})  # ...nor loaded yet
    with pytest.raises(StorageError, match=r"s3fs.*pip install 'ledger\[s3\]'"):
        Store("s3://bucket/run")
    result = CliRunner().invoke(main, ["audit", "s3://bucket/run"])
    assert result.exit_code == 1
    assert result.stderr.startswith("Error: cannot open the log root s3://bucket/run")
    assert len(result.stderr.splitlines()) == 1


class _StopsAt3(_Len):
    def __getitem__(self, i):
        if i == 3:
            raise StopIteration  # torch re-raises it in the main process: the iterator's end
        return i


def test_a_workers_stop_iteration_is_not_a_short_epoch(root):
    """A dataset raising StopIteration in a worker ends torch's iteration early: refused,
    not an epoch ended short with every later iter(loader) empty."""
    loader = ledger.DataLoader(_StopsAt3(8), batch_size=2, seed=0, log=root, num_workers=1)
    with pytest.raises(LedgerError, match="ended after batch 1 of 4 of epoch 0: the dataset"):
        list(loader)


def test_a_stop_iteration_on_the_loops_thread_is_named(root, tmp_path):
    """At 0 workers Python turns a dataset's or a transform's StopIteration into a bare
    ``RuntimeError: generator raised StopIteration`` (PEP 479): ledger names the batch;
    the batches before it were served."""
    loader = ledger.DataLoader(_StopsAt3(8), batch_size=2, seed=0, log=root)
    served = []
    with pytest.raises(LedgerError, match="loading batch 1 of epoch 0 raised StopIteration"):
        for batch in loader:
            served.append(batch.tolist())
    assert served == [[0, 1]]

    def stops(row, ctx):
        if ctx.sample_id == 1:
            raise StopIteration
        return row["text"]

    stream = Stream(_stream_args(tmp_path), transform=stops)
    loader = ledger.DataLoader(stream, batch_size=1, seed=0, log=str(tmp_path / "log2"))
    with pytest.raises(LedgerError, match="the transform raised StopIteration for sample 1"):
        list(loader)


def _stream_args(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "s.parquet"
    pq.write_table(pa.table({"text": ["a", "b", "c"]}), path)
    return ShardedSource(str(path))


def _not_parquet(source: ShardedSource) -> str:
    path = os.path.join(os.path.dirname(source.files[0]), "bad.parquet")
    with open(path, "wb") as f:
        f.write(b"PAR1 not parquet PAR1")
    return path


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda s: Stream(s, shuffle_buffer=-1), "shuffle_buffer must be an int >= 0"),
        (lambda s: Stream(s, shuffle_buffer=1.5), "shuffle_buffer must be an int >= 0"),
        (lambda s: Stream("data/*.parquet"), "a Stream reads a ledger.stream.Shard"),
        (lambda s: Stream(s, transform=3), "transform must be callable"),
        (lambda s: Packer(seq_len=0), "seq_len must be an int >= 1, got 0"),
        (lambda s: ShardedSource(_not_parquet(s)), "bad.parquet is not a readable Parquet file"),
        (lambda s: ledger.Mixture({}, weights={}), "a non-empty dict of source name"),
        (lambda s: ledger.Mixture([Augmented(4)], weights=[1]), "a non-empty dict"),
        (lambda s: ledger.Mixture({"a": Augmented(4)}, weights={"a": -1}), "weight of 'a' is -1"),
        (lambda s: ledger.Mixture({"a": Augmented(4)}, weights={"a": None}), "weight of 'a' is"),
        (lambda s: ledger.Mixture({"a": Augmented(4)}, weights={"b": 1}), "name 'b', which is"),
        (lambda s: ledger.Mixture({"a": _Len(0)}, weights={"a": 1}), "source 'a' is empty"),
    ],
)
def test_a_bad_stream_packer_or_mixture_argument_is_refused(tmp_path, make, match):
    with pytest.raises(UnsupportedArgument, match=match):
        make(_stream_args(tmp_path))


@pytest.mark.parametrize(
    ("line", "match"),
    [
        ('{"text": "a"', r"line 4 \(sample id 2\) is not JSON \(Expecting"),
        ("[1, 2]", r"line 4 \(sample id 2\) is a JSON list, not an object"),
        ("\xff\xfe", r"line 4 \(sample id 2\) is not JSON"),
    ],
)
def test_a_jsonl_line_that_is_no_json_object_is_named(tmp_path, root, line, match):
    """A damaged line of a JSONL shard is a DataError naming the file, its line number
    (blank lines counted) and its sample id, not a bare JSONDecodeError or a list handed
    on as a row; the rows before it are served."""
    shard = tmp_path / "part-0.jsonl"
    shard.write_bytes(b'{"text": "x"}\n\n{"text": "y"}\n' + line.encode("latin-1") + b"\n")
    source = ShardedSource(str(shard))
    assert source.read([0, 1]) == [{"text": "x"}, {"text": "y"}]
    with pytest.raises(DataError, match="part-0.jsonl, " + match):
        source.read([2])
    # A stream's workers read with strict=False: the line is a BadRecord in its place,
    # which fails that sample's loading (on_error="skip" skips it).
    bad = source.read([1, 2], strict=False)
    assert bad[0] == {"text": "y"} and isinstance(bad[1], BadRecord)
    assert re.search("part-0.jsonl, " + match, bad[1].message)
    (block,) = source.iter_blocks(0, 1, strict=False)
    assert block[0] == {"text": "y"} and block[1] == bad[1]
    loader = ledger.DataLoader(Stream(source), batch_size=1, seed=0, log=root)
    with pytest.raises(DataError, match="part-0.jsonl, " + match):
        list(loader)


@pytest.mark.parametrize("tokens", [None, "abc", [0.5, 1.5], [2**70]])
def test_a_transform_giving_no_token_ids_is_named_before_it_is_packed(tmp_path, root, tokens):
    """With a packer, a transform's item must be integer token ids: floats would be
    truncated to other tokens without a word, None or a string fail deep in numpy."""
    stream = Stream(_stream_args(tmp_path), transform=lambda r, c: tokens, packer=Packer(seq_len=4))
    loader = ledger.DataLoader(stream, batch_size=1, seed=0, log=root)
    with pytest.raises(UnsupportedArgument, match=r"the transform gave sample 0 .* int token"):
        list(take(loader, 1))


@pytest.mark.parametrize("tokens", [[2**63 + 5], np.array([2**64 - 1, 1], np.uint64)])
def test_a_token_id_beyond_int64_is_refused_not_wrapped(tmp_path, root, tokens):
    """numpy holds a Python int in [2**63, 2**64) as uint64: cast to the packer's int64 it
    would become a negative token without a word."""
    stream = Stream(_stream_args(tmp_path), transform=lambda r, c: tokens, packer=Packer(seq_len=4))
    loader = ledger.DataLoader(stream, batch_size=1, seed=0, log=root)
    with pytest.raises(UnsupportedArgument, match="does not fit int64"):
        list(take(loader, 1))


class _Batched(_Len):
    def __getitems__(self, ids):
        return list(ids)[:-1]  # one item short


def test_a_getitems_returning_another_number_of_items_is_refused(root):
    """The log would name a sample the model never received."""
    loader = ledger.DataLoader(_Batched(8), batch_size=2, seed=0, log=root)
    with pytest.raises(UnsupportedArgument, match="__getitems__ returned 1 items for 2 ids"):
        list(take(loader, 1))


@pytest.mark.parametrize("workers", [0, 2])
def test_a_dataset_whose_length_changes_during_the_run_is_refused(root, workers):
    """Every epoch is a permutation of the length the run started with: a dataset that
    grew between epochs would leave its new samples out without a word (torch's samplers
    take len() anew each epoch), so the next iter(loader) refuses it; with the original
    length back the run goes on, and its log covers every epoch exactly."""
    data = _Len(10)
    loader = ledger.DataLoader(
        data, batch_size=4, shuffle=True, seed=3, log=root, num_workers=workers
    )
    first = [i for b in loader for i in b.tolist()]
    assert sorted(first) == list(range(10))
    data.n = 12
    with pytest.raises(ConfigMismatch, match=r"dataset_len=10, this loader has dataset_len=12"):
        iter(loader)
    data.n = 10
    second = [i for b in loader for i in b.tolist()]
    assert sorted(second) == list(range(10)) and second != first


def test_a_mapping_without_index_0_is_refused_and_a_dict_of_indices_is_taken(root):
    """A datasets.DatasetDict (splits by name) passed where one split belongs would fail
    at the first batch with KeyError: 0; it is refused naming its keys. A dict indexed
    0 .. n - 1 is a map-style dataset as torch takes it."""
    import datasets

    splits = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"x": [1, 2, 3]})})
    with pytest.raises(
        UnsupportedArgument, match=r"mapping without the key 0 \(its keys: 'train'\)"
    ):
        ledger.DataLoader(splits, batch_size=2, seed=0, log=root)
    served = list(ledger.DataLoader({0: 5, 1: 6, 2: 7}, batch_size=2, seed=0, log=root))
    assert sorted(i for b in served for i in b.tolist()) == [5, 6, 7]
