"""End to end: SIGKILL examples/train_lm_packed.py, resume it, compare with a clean run.

The streamed, packed twin of ``tests/test_example.py``, with the helpers of
``tools/demo.py``. The corpus is the first 5 stdlib files (one of 5 kB, three under
250 bytes, one of 3 kB) in 4 shards of one-row row groups: a few dozen batches of 8
rows of 33 tokens make an epoch, so the runs cross an epoch boundary, documents span
rows and batches, and the shuffle buffer (2 documents) refills across shards.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import signal
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

# One worker runs this module whole (pytest-xdist --dist loadgroup): its module-scoped
# fixture is built once.
pytestmark = pytest.mark.xdist_group("test_example_packed")

REPO = Path(__file__).resolve().parents[1]


def _load(name: str, path: Path):  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


demo = _load("ledger_demo", REPO / "tools" / "demo.py")
shards_mod = _load("make_shards", REPO / "tools" / "make_shards.py")
packed = _load("train_lm_packed", REPO / "examples" / "train_lm_packed.py")

STEPS = 48
BATCH = 8
CKPT_EVERY = 8
KILL_AT = 21  # the killed run's last checkpoint is step 16
MAX_FILES = 5


@pytest.fixture(scope="module")
def shards_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("shards")
    shards_mod.make_shards(out, shards=4, max_files=MAX_FILES, row_group_rows=1)
    return out


def _train_args(shards_dir: Path, num_workers: int) -> list[str]:
    return [
        "--shards-dir", str(shards_dir),
        "--steps", str(STEPS),
        "--batch-size", str(BATCH),
        "--seq-len", "32",
        "--shuffle-buffer", "2",
        "--num-workers", str(num_workers),
        "--ckpt-every", str(CKPT_EVERY),
        "--seed", "3",
    ]  # fmt: skip


CleanRun = Callable[[list[str]], tuple[Path, "Future[tuple[int, list[str]]]"]]


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CleanRun]:
    """The uninterrupted run of some arguments: its directory and its future, started (in a
    thread, alongside the run the test kills) by the first test that asks for those
    arguments. kill-2 and after-commit-2 train on the same arguments: one run."""
    runs: dict[tuple[str, ...], tuple[Path, Future[tuple[int, list[str]]]]] = {}
    run = functools.partial(demo.run_train, script=demo.TRAIN_PACKED)
    with ThreadPoolExecutor(1) as pool:

        def clean(args: list[str]) -> tuple[Path, Future[tuple[int, list[str]]]]:
            if tuple(args) not in runs:
                root = tmp_path_factory.mktemp("clean")
                runs[tuple(args)] = root, pool.submit(run, root, args)
            return runs[tuple(args)]

        yield clean


@pytest.mark.slow
@pytest.mark.parametrize(
    ("crash_mode", "num_workers"),
    [
        ("kill", 0),
        # Workers have prefetched batches (and filled their packers) that the killed run
        # never consumed (the long tier: test_sigkill kills a packed stream with 2
        # workers in CI).
        pytest.param("kill", 2, marks=pytest.mark.long),
        # Dies between the log commit of step 24 and its checkpoint: the resume from
        # step 16 must leave commit 24 of attempt 0 as an abandoned branch (CI runs this
        # crash mode with test_example's map-style run).
        pytest.param("after-commit", 2, marks=pytest.mark.long),
    ],
)
def test_sigkill_and_resume_is_exact(
    tmp_path: Path, shards_dir: Path, clean_run: CleanRun, crash_mode: str, num_workers: int
) -> None:
    args = _train_args(shards_dir, num_workers)
    run = functools.partial(demo.run_train, script=demo.TRAIN_PACKED)
    crash = tmp_path / "crash"

    # The reference run goes alongside the one to kill (shared with the other crash mode).
    clean, reference = clean_run(args)
    if crash_mode == "kill":
        rc, _ = run(crash, args, kill_at=KILL_AT)
    else:
        rc, _ = run(crash, [*args, "--die-after-commit", str(3 * CKPT_EVERY)])
    assert reference.result()[0] == 0
    assert rc == -signal.SIGKILL
    killed = demo.effective_stream(crash / "stream.jsonl")
    assert KILL_AT < len(killed) < STEPS

    rc, lines = run(crash, args, resume=True)
    assert rc == 0
    resumed_from = next(int(m.group(1)) for ln in lines if (m := demo.RESUMED_RE.match(ln)))
    assert resumed_from == 2 * CKPT_EVERY
    if crash_mode == "after-commit":
        assert len(killed) == 3 * CKPT_EVERY
        log = crash / "log"
        assert (log / "commits" / "000000000024-0000.json").exists()
        attempt1 = json.loads((log / "attempts" / "0001.json").read_text())
        assert attempt1["parent"] == "000000000016-0000"

    raw = [json.loads(ln) for ln in (crash / "stream.jsonl").read_text().splitlines()]
    assert [r["step"] for r in raw] == [*range(len(killed)), *range(resumed_from, STEPS)]

    ref = demo.effective_stream(clean / "stream.jsonl")
    eff = demo.effective_stream(crash / "stream.jsonl")
    assert len(ref) == STEPS
    epochs = [r["epoch"] for r in ref]
    assert epochs == sorted(epochs) and len(set(epochs)) >= 2, "the run must cross an epoch"
    assert demo.count_differences(ref, eff) == 0
    assert demo.weights_diff(clean / "final.pt", crash / "final.pt") == []
    assert demo.ledger_cli("audit", str(crash / "log"))[0] == 0


def test_make_shards_contiguous_unequal_short_final(tmp_path: Path) -> None:
    paths = shards_mod.make_shards(tmp_path, shards=4, max_files=40, row_group_rows=3)
    files = shards_mod.stdlib_files(40)
    stdlib = files[0].parents[0]
    assert paths == [str(tmp_path / f"shard-{i:05d}-of-00004.parquet") for i in range(4)]
    tables = [pq.read_table(p) for p in paths]
    rows = [t.num_rows for t in tables]
    # Files 0-39 of the sorted stdlib cut at i * total bytes / 3.5 (see _cut_points).
    assert rows == [13, 7, 8, 12]
    assert [pq.ParquetFile(p).metadata.num_row_groups for p in paths] == [5, 3, 3, 4]
    got = [row for t in tables for row in t.to_pylist()]
    assert [r["path"] for r in got] == [p.relative_to(stdlib).as_posix() for p in files]
    assert got[0]["text"] == files[0].read_text(encoding="utf-8")
    size = [sum(len(r["text"].encode()) for r in t.to_pylist()) for t in tables]
    assert size[-1] < min(size[:-1])
    manifest = shards_mod.read_manifest(tmp_path)
    assert manifest["shards"] == [
        {"path": Path(p).name, "rows": n} for p, n in zip(paths, rows, strict=True)
    ]


def test_cut_points_never_empty() -> None:
    assert shards_mod._cut_points([100, 1, 1], 8) == [0, 1, 2, 3]
    assert shards_mod._cut_points([1000, 1, 1, 1], 3) == [0, 1, 2, 4]
    assert shards_mod._cut_points([10] * 8, 1) == [0, 8]


class _Rng:
    def __init__(self, value: float) -> None:
        self.value = value

    def random(self) -> float:
        return self.value


@pytest.mark.parametrize(("draw", "tokens"), [(0.05, [98, 10]), (0.1, [97, 10, 98, 10])])
def test_byte_tokenize_drops_first_line_with_p_0_1(draw: float, tokens: list[int]) -> None:
    recorded: list[dict[str, object]] = []
    ctx = SimpleNamespace(rng=_Rng(draw), record=lambda **kw: recorded.append(kw))
    out = packed.byte_tokenize({"path": "x.py", "text": "a\nb\n"}, ctx)
    assert out.dtype == np.int64 and out.tolist() == tokens
    assert recorded == [{"dropped_first_line": draw < 0.1}]


def test_loss_ignores_padding() -> None:
    torch.manual_seed(0)
    model = packed.TinyLM(8).eval()
    tokens = torch.randint(1, 256, (2, 9))
    sample_ids = torch.tensor([[4] * 9, [5] * 3 + [-1] * 6])
    loss = packed.batch_loss(model, {"tokens": tokens, "sample_ids": sample_ids})
    # Other values under the padding change neither the targets counted nor, the model
    # being causal, the logits of the positions before the padding.
    other = tokens.masked_fill(sample_ids == -1, 7)
    assert torch.equal(loss, packed.batch_loss(model, {"tokens": other, "sample_ids": sample_ids}))
    # 8 + 2 targets count: the mean is over those, not over all 16.
    ce = torch.nn.functional.cross_entropy(
        model(tokens[:, :-1]).reshape(-1, 256), tokens[:, 1:].reshape(-1), reduction="none"
    )
    assert torch.allclose(loss, ce[(sample_ids[:, 1:] != -1).reshape(-1)].mean())


def test_resumed_stream_in_main_process_leaves_global_rng_alone(
    tmp_path: Path, shards_dir: Path
) -> None:
    paths = shards_mod.read_manifest(shards_dir)["shards"]
    source = packed.ShardedSource([str(shards_dir / p["path"]) for p in paths])

    def loader(root: Path) -> packed.ledger.DataLoader:
        stream = packed.Stream(
            source, transform=packed.byte_tokenize, shuffle_buffer=2, packer=packed.Packer(33)
        )
        return packed.ledger.DataLoader(stream, batch_size=2, shuffle=True, log=str(root))

    first = loader(tmp_path / "log")
    it = iter(first)
    for _ in range(2):
        next(it)
    token = first.state_dict()
    resumed = loader(tmp_path / "log")
    resumed.load_state_dict(token)
    torch.manual_seed(123)
    before = torch.get_rng_state()
    next(iter(resumed))
    assert torch.equal(torch.get_rng_state(), before)
