"""At ``num_workers=0`` the loader drives torch's single-process iterator itself
(:func:`ledger.pipeline.in_process`): the same batches, pinning and profiler annotation
as torch's ``__next__``, without its per-batch ``record_function`` when no profiler runs."""

from __future__ import annotations

import pytest
import torch
import torch.autograd.profiler as autograd_profiler
from conftest import Augmented

import ledger
from ledger.pipeline import in_process
from ledger.testing import assert_resume_exact, batches_equal, take

NAME = "enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__"


class Pairs:
    """Items are tuples of a tensor and a dict, with random draws."""

    def __len__(self) -> int:
        return 11

    def __getitem__(self, i: int) -> tuple[torch.Tensor, dict[str, object]]:
        return torch.full((2,), float(i)), {"id": i, "noise": float(torch.rand(()))}


def collate(items: list[tuple[torch.Tensor, dict[str, object]]]) -> dict[str, object]:
    """A user's collate function that draws too (random masking)."""
    xs = torch.stack([x for x, _ in items])
    return {
        "x": xs * (torch.rand(xs.shape) > 0.5),
        "meta": ([m["id"] for _, m in items], torch.tensor([m["noise"] for _, m in items])),
    }


def _loader(root: str, **kwargs: object) -> ledger.DataLoader:
    return ledger.DataLoader(
        Pairs(), batch_size=3, shuffle=True, seed=4, collate_fn=collate, log=root, **kwargs
    )


def test_zero_workers_serve_what_torchs_iterator_serves(root):
    loader = _loader(root)
    pipeline = loader._pipeline
    start = pipeline.initial_state()
    pipeline.begin(start)
    torchs = list(iter(pipeline.torch_loader))  # torch's __next__
    pipeline.begin(start)
    mine = list(in_process(pipeline.torch_loader))
    assert len(mine) == len(torchs) == 4
    for (tag, data), (want_tag, want) in zip(mine, torchs, strict=True):
        assert tag == want_tag  # batch indexes, worker -1, the content digest
        assert batches_equal(data, want)
    served = list(loader)  # and through the loader, recorded
    assert all(batches_equal(a, b) for a, b in zip(served, [d for _, d in torchs], strict=True))


def test_zero_workers_resume_exactly_with_a_collate_function(root):
    assert assert_resume_exact(lambda: _loader(root), batches=9) == 9


def test_no_record_function_without_a_profiler(root, monkeypatch):
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("record_function entered with no profiler running")

    monkeypatch.setattr(autograd_profiler, "record_function", refuse)
    assert len(list(_loader(root))) == 4


def test_a_profiler_sees_each_batch_under_torchs_name(root):
    loader = ledger.DataLoader(Augmented(12), batch_size=4, log=root)
    counts = []
    for served in (loader, torch.utils.data.DataLoader(Augmented(12), batch_size=4)):
        # The legacy profiler: the same annotations as torch.profiler's, started in ms.
        with autograd_profiler.profile(use_kineto=False) as prof:
            assert len(list(served)) == 3
        counts.append({e.key: e.count for e in prof.key_averages()}.get(NAME))
    assert counts == [4, 4]  # as torch's __next__: each batch, and the call that ends the epoch


@pytest.mark.skipif(torch.accelerator.is_available(), reason="the no-accelerator path")
def test_pin_memory_without_an_accelerator_warns_as_torch_does(root, tmp_path):
    plain = list(_loader(str(tmp_path / "plain")))
    with pytest.warns(UserWarning, match="no accelerator is found"):
        pinned = list(_loader(root, pin_memory=True))
    assert all(batches_equal(a, b) for a, b in zip(pinned, plain, strict=True))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA for pinned memory")
def test_pin_memory_pins_every_tensor(root):
    batch = next(iter(take(_loader(root, pin_memory=True), 1)))
    assert batch["x"].is_pinned() and batch["meta"][1].is_pinned()


def _stream_loaders(tmp_path) -> dict[str, ledger.DataLoader]:
    """A packed stream and a map-style source beside it in a mixture, at 0 workers."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from conftest import MapTokens, packed_stream

    shards = tmp_path / "shards"
    shards.mkdir()
    for s in range(2):
        text = [f"row {s} {i} " + "x" * (i % 7) for i in range(12)]
        pq.write_table(pa.table({"text": text}), shards / f"s{s}.parquet", row_group_size=4)
    stream = packed_stream(str(shards), shuffle_buffer=4)
    mix = ledger.Mixture(
        {"map": MapTokens(9), "text": packed_stream(str(shards), shuffle_buffer=4)},
        weights={"map": 0.5, "text": 0.5},
    )
    return {
        name: ledger.DataLoader(source, batch_size=2, seed=1, log=str(tmp_path / name))
        for name, source in (("stream", stream), ("mixture", mix))
    }


def test_streams_at_zero_workers_skip_the_annotation_unless_profiled(tmp_path, monkeypatch):
    loaders = _stream_loaders(tmp_path)
    for loader in loaders.values():  # a profiler sees each batch and the call ending it
        with autograd_profiler.profile(use_kineto=False) as prof:
            served = len(list(loader))
        assert {e.key: e.count for e in prof.key_averages()}.get(NAME) == served + 1

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("record_function entered with no profiler running")

    monkeypatch.setattr(autograd_profiler, "record_function", refuse)
    for loader in loaders.values():
        assert len(list(loader)) > 0


@pytest.mark.parametrize("draws", [False, True])
def test_zero_workers_keep_the_loops_torch_generator_and_its_cached_normal(root, draws):
    """The training loop's torch generator comes back bit for bit after each batch,
    torch's cached normal variate included, whether the dataset draws from it or not."""
    loader = _loader(root) if draws else ledger.DataLoader(list(range(12)), batch_size=4, log=root)
    torch.manual_seed(7)
    torch.randn(1, dtype=torch.float64)  # a loop that drew a normal: its pair's second is cached
    state = torch.default_generator.get_state()
    expected = [torch.randn(1, dtype=torch.float64), torch.rand(3)]
    torch.default_generator.set_state(state)
    for _ in loader:
        assert torch.equal(torch.default_generator.get_state(), state)
    got = [torch.randn(1, dtype=torch.float64), torch.rand(3)]
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
