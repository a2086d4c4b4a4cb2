"""Drop-in with torch: torch's arguments in torch's order, samplers translated or refused
with what ledger does instead; tokens that resume on a log copied or moved elsewhere."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
import torch.utils.data as tud
from conftest import Augmented

import ledger
from ledger import torch_args
from ledger.errors import ConfigMismatch, UnsupportedArgument, WrongRoot
from ledger.testing import batches_equal, take


def _ids(loader, batches):
    return [b["id"].tolist() for b in take(loader, batches)]


def test_torch_positional_order(root, tmp_path):
    ds = Augmented(20)
    # dataset, batch_size, shuffle, sampler, batch_sampler, num_workers, collate_fn,
    # pin_memory, drop_last: torch's positions.
    positional = ledger.DataLoader(ds, 4, True, None, None, 0, None, False, True, seed=3, log=root)
    keywords = ledger.DataLoader(
        ds, batch_size=4, shuffle=True, drop_last=True, seed=3, log=str(tmp_path / "k")
    )
    assert (positional.batch_size, positional.shuffle, positional.drop_last) == (4, True, True)
    assert _ids(positional, 5) == _ids(keywords, 5)


def test_generator_is_the_seed_source(root, tmp_path):
    g = torch.Generator().manual_seed(7)
    state = g.get_state()
    loader = ledger.DataLoader(Augmented(20), 4, True, generator=g, log=root)
    assert loader.seed == 7
    seeded = ledger.DataLoader(Augmented(20), 4, True, seed=7, log=str(tmp_path / "s"))
    assert _ids(loader, 5) == _ids(seeded, 5)
    assert torch.equal(g.get_state(), state)  # nothing drawn from the user's generator
    with pytest.raises(UnsupportedArgument, match="seeds given differ"):
        ledger.DataLoader(Augmented(20), 4, True, generator=g, seed=8, log=str(tmp_path / "x"))


def test_shuffle_without_seed_follows_torch_manual_seed(tmp_path):
    torch.manual_seed(5)
    a = ledger.DataLoader(Augmented(20), 4, True, log=str(tmp_path / "a"))
    torch.manual_seed(6)
    b = ledger.DataLoader(Augmented(20), 4, True, log=str(tmp_path / "b"))
    explicit = ledger.DataLoader(Augmented(20), 4, True, seed=5, log=str(tmp_path / "c"))
    assert (a.seed, b.seed) == (5, 6)
    ids_a, ids_b = _ids(a, 5), _ids(b, 5)
    assert ids_a == _ids(explicit, 5)
    assert ids_a != ids_b


def test_resume_under_another_torch_seed_names_the_seed_to_pass(root):
    torch.manual_seed(5)
    loader = ledger.DataLoader(Augmented(20), 4, True, log=root)
    list(take(loader, 2))
    token = loader.state_dict()
    torch.manual_seed(6)
    resumed = ledger.DataLoader(Augmented(20), 4, True, log=root)
    with pytest.raises(ConfigMismatch, match=r"torch.manual_seed\(5\)") as info:
        resumed.load_state_dict(token)
    assert (info.value.field, info.value.expected, info.value.found) == ("seed", 5, 6)
    torch.manual_seed(5)
    again = ledger.DataLoader(Augmented(20), 4, True, log=root)
    again.load_state_dict(token)
    assert _ids(again, 3) == _ids(loader, 3)


@pytest.mark.parametrize(
    "make,shuffle,seed",
    [
        (lambda ds: tud.SequentialSampler(ds), False, 9),
        (lambda ds: tud.RandomSampler(ds, generator=torch.Generator().manual_seed(4)), True, 4),
    ],
)
def test_torch_samplers_are_translated(root, tmp_path, make, shuffle, seed):
    ds = Augmented(20)
    torch.manual_seed(9)
    loader = ledger.DataLoader(ds, 4, sampler=make(ds), log=root)
    assert (loader.shuffle, loader.seed) == (shuffle, seed)
    same = ledger.DataLoader(ds, 4, shuffle, seed=seed, log=str(tmp_path / "same"))
    assert _ids(loader, 6) == _ids(same, 6)


def test_distributed_sampler_gives_rank_world_size_and_seed():
    ds = Augmented(20)
    sampler = tud.DistributedSampler(ds, num_replicas=2, rank=1, shuffle=True, seed=3)
    # (A loader of world size 2 needs a process group; tests/test_dist.py runs those.)
    args = dict(batch_size=2, shuffle=None, batch_sampler=None, drop_last=False)
    args.update(generator=None, seed=None, in_order=True, world_size=None)
    got = torch_args.resolve(ds, sampler=sampler, rank=None, **args)
    assert (got.shuffle, got.seed, got.rank, got.world_size) == (True, 3, 1, 2)
    with pytest.raises(UnsupportedArgument, match="rank=0 contradicts"):
        torch_args.resolve(ds, sampler=sampler, rank=0, **args)


def test_batch_sampler_gives_batch_size_and_drop_last(root, tmp_path):
    ds = Augmented(10)
    shuffled = tud.RandomSampler(ds, generator=torch.Generator().manual_seed(2))
    bs = tud.BatchSampler(shuffled, 3, True)
    loader = ledger.DataLoader(ds, batch_sampler=bs, log=root)
    assert (loader.batch_size, loader.drop_last, loader.shuffle, loader.seed) == (3, True, True, 2)
    same = ledger.DataLoader(ds, 3, True, drop_last=True, seed=2, log=str(tmp_path / "same"))
    assert _ids(loader, 6) == _ids(same, 6)
    with pytest.raises(UnsupportedArgument, match="mutually exclusive"):
        ledger.DataLoader(ds, 4, batch_sampler=bs, log=root)


class _Custom(tud.Sampler[int]):
    def __iter__(self):
        return iter(range(10))

    def __len__(self):
        return 10


class _Stream(tud.IterableDataset):
    def __iter__(self):
        return iter(range(3))


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(sampler=_Custom()), "sampler=_Custom is not supported: ledger orders each epoch"),
        (
            dict(sampler=tud.WeightedRandomSampler([1.0] * 10, 10)),
            "sampler=WeightedRandomSampler is not supported.*Subset",
        ),
        (dict(sampler=tud.SubsetRandomSampler([1, 2])), "Subset\\(dataset, indices\\)"),
        (dict(sampler=tud.RandomSampler(range(10), replacement=True)), "replacement"),
        (dict(batch_sampler=[[0, 1], [2]]), "batch_sampler=list is not supported"),
        (dict(in_order=False), "in_order=False is not supported: ledger hands batches"),
        (dict(batch_size=None), "batch_size=None"),
        (dict(batch_size=0), "batch_size must be an int >= 1"),
        (dict(shuffle=True, sampler=tud.SequentialSampler(range(10))), "mutually exclusive"),
        (
            dict(sampler=tud.SequentialSampler(range(4))),
            "SequentialSampler over 4 samples for a dataset of 10.*Subset",
        ),
        (
            dict(batch_sampler=tud.BatchSampler(tud.SequentialSampler(range(4)), 3, False)),
            "SequentialSampler over 4 samples",
        ),
        (
            dict(sampler=tud.DistributedSampler(range(12), num_replicas=2, rank=0)),
            "DistributedSampler over 12 samples for a dataset of 10",
        ),
    ],
)
def test_what_cannot_be_exact_is_refused_with_what_to_do(root, kwargs, message):
    with pytest.raises(UnsupportedArgument, match=message):
        ledger.DataLoader(Augmented(10), log=root, **kwargs)


def test_iterable_dataset_points_to_stream(root):
    with pytest.raises(UnsupportedArgument, match=r"ledger\.stream\.Stream") as info:
        ledger.DataLoader(_Stream(), batch_size=2, log=root)
    assert isinstance(info.value, ValueError)


def test_pin_memory_device_reaches_torch(root):
    loader = ledger.DataLoader(Augmented(8), 4, pin_memory_device="cpu", log=root)
    assert loader._torch_loader.pin_memory_device == "cpu"


# ---------------------------------------------------------------- moved logs


def _run(root, batches):
    loader = ledger.DataLoader(Augmented(20), 4, True, seed=1, log=root)
    seen = list(take(loader, batches))
    return loader, seen, loader.state_dict()


def _reference(tmp_path, batches):
    loader = ledger.DataLoader(Augmented(20), 4, True, seed=1, log=str(tmp_path / "reference"))
    return list(take(loader, batches))


def test_token_resumes_on_a_copied_log(tmp_path):
    old = str(tmp_path / "old")
    _, _, token = _run(old, 3)
    new = str(tmp_path / "mounted" / "elsewhere")
    shutil.copytree(old, new)
    shutil.rmtree(old)  # the original is gone: only the copy can serve
    resumed = ledger.DataLoader(Augmented(20), 4, True, seed=1, log=new)
    resumed.load_state_dict(token)
    rest = list(take(resumed, 4))
    want = _reference(tmp_path, 7)[3:]
    assert all(batches_equal(a, b) for a, b in zip(rest, want, strict=True))
    after = resumed.state_dict()
    assert after["root"] == os.path.abspath(new) and after["run_id"] == token["run_id"]
    assert not os.path.exists(old)  # nothing was written to the old path


def test_copy_older_than_the_token_is_refused(tmp_path):
    old = str(tmp_path / "old")
    loader, _, _ = _run(old, 2)
    new = str(tmp_path / "copy")
    shutil.copytree(old, new)
    list(take(loader, 2))
    token = loader.state_dict()  # a commit the copy lacks
    resumed = ledger.DataLoader(Augmented(20), 4, True, seed=1, log=new)
    with pytest.raises(WrongRoot, match=r"not its commit .*predates"):
        resumed.load_state_dict(token)


def test_another_run_at_the_other_root_is_refused(tmp_path):
    _, _, token = _run(str(tmp_path / "a"), 2)
    _run(str(tmp_path / "b"), 2)
    other = ledger.DataLoader(Augmented(20), 4, True, seed=1, log=str(tmp_path / "b"))
    with pytest.raises(WrongRoot, match=r"holds run [0-9a-f]+: pass log="):
        other.load_state_dict(token)
    empty = ledger.DataLoader(Augmented(20), 4, True, seed=1, log=str(tmp_path / "c"))
    with pytest.raises(WrongRoot, match="holds no run"):
        empty.load_state_dict(token)
    assert not os.path.exists(tmp_path / "c" / "run.json")  # nothing created by a refusal


def test_token_resumes_on_a_log_moved_to_a_bucket(s3, tmp_path):
    import fsspec

    old = str(tmp_path / "old")
    _, _, token = _run(old, 3)
    new = s3.new_root("moved")
    fs = fsspec.filesystem("s3")
    for dirpath, _, files in os.walk(old):
        for name in files:
            local = os.path.join(dirpath, name)
            fs.put_file(local, new[len("s3://") :] + "/" + os.path.relpath(local, old))
    resumed = ledger.DataLoader(Augmented(20), 4, True, seed=1, log=new)
    resumed.load_state_dict(token)
    rest = list(take(resumed, 4))
    want = _reference(tmp_path, 7)[3:]
    assert all(batches_equal(a, b) for a, b in zip(rest, want, strict=True))
    assert resumed.state_dict()["root"] == new
