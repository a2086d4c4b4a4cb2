"""Train a tiny byte-level language model on CPython's standard library, resumably.

The data pipeline is a ``ledger.DataLoader``: every consumed sample is logged under
``ROOT/log`` and each checkpoint carries a small token naming the log commit it matches.
Kill the process at any instant, rerun with ``--resume``, and the batches the training
loop sees -- and, with deterministic kernels, the final weights -- are identical to a run
that never stopped. ``tools/demo.py`` checks exactly that.

Under ``torchrun`` (``WORLD_SIZE`` set) every rank joins a gloo process group, the model
is wrapped in ``DistributedDataParallel`` and each rank's loader takes its share of every
global step. A checkpoint is collective: every rank commits its log (``state_dict()``)
at the same step, and rank 0 writes the file with every rank's data token and RNG state.
``--resume`` with the same world size gives each rank its own token back; with another
world size every rank resumes from rank 0's token and the loader continues the epoch
with the new shape, each sample still consumed exactly once (``tools/demo_elastic.py``
shows it).

Layout under ``--root DIR``::

    DIR/log/                the ledger root (events, commits, journal)
    DIR/ckpt/step-*.pt      checkpoints: model, optimizer, step, torch RNG, data token;
                            ``world_size`` and ``ranks`` (each rank's token and RNG)
    DIR/final.pt            model state_dict after the last step (rank 0)

Example:
    python examples/train_lm.py --root runs/lm --steps 300 --stream-out runs/lm/stream.jsonl
    python examples/train_lm.py --root runs/lm --steps 300 --resume   # after a crash
    torchrun --nproc_per_node 2 examples/train_lm.py --root runs/lm2 --steps 300 \
        --stream-out runs/lm2/stream.jsonl          # per rank: stream.jsonl.rank0, .rank1
    torchrun --nproc_per_node 1 examples/train_lm.py --root runs/lm2 --steps 300 --resume
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import re
import signal
import sys
import sysconfig
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import ledger

VOCAB = 256  # bytes
CKPT_RE = re.compile(r"^step-(\d{8})\.pt$")


def stdlib_files(max_files: int | None = None) -> list[Path]:
    """The ``.py`` files of the running interpreter's standard library, sorted.

    Args:
        max_files: keep only the first ``max_files`` paths (for quick tests).

    Returns:
        Sorted absolute paths, ``site-packages`` excluded.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    files: list[Path] = []
    for parent, dirs, names in os.walk(root):
        # Pruned rather than filtered: site-packages holds far more files than the stdlib.
        dirs[:] = [d for d in dirs if d != "site-packages"]
        files += [Path(parent, n) for n in names if n.endswith(".py")]
    files.sort()
    return files[:max_files] if max_files is not None else files


class StdlibWindows(torch.utils.data.Dataset):
    """Non-overlapping windows of ``seq_len + 1`` bytes over the concatenated stdlib.

    Sample ``i`` is bytes ``[i * (seq_len + 1), (i + 1) * (seq_len + 1))`` of the corpus,
    split into a next-byte prediction pair. A few input bytes are masked (set to 0) at
    positions drawn from the *global* torch RNG, so the sample depends on the per-sample
    seed the loader sets before calling ``__getitem__``.

    Args:
        seq_len: tokens (bytes) per sample.
        max_files: corpus limited to the first ``max_files`` files.
        max_samples: keep ``max_samples`` windows spread evenly over the whole corpus
            (every k-th window), for short epochs that still span every file.
    """

    def __init__(
        self, seq_len: int, max_files: int | None = None, max_samples: int | None = None
    ) -> None:
        self.seq_len = seq_len
        corpus = b"".join(p.read_bytes() for p in stdlib_files(max_files))
        self.data = np.frombuffer(corpus, dtype=np.uint8)
        n = len(self.data) // (seq_len + 1)
        self.n = n if max_samples is None else min(n, max_samples)
        self.stride = n // self.n if self.n else 1

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not 0 <= i < self.n:
            raise IndexError(i)
        start = i * self.stride * (self.seq_len + 1)
        window = torch.from_numpy(self.data[start : start + self.seq_len + 1].astype(np.int64))
        x, y = window[:-1].clone(), window[1:].clone()
        # Augmentation drawn from the global RNG: 0-3 masked input positions.
        k = int(torch.randint(0, 4, ()))
        x[torch.randint(0, self.seq_len, (k,))] = 0
        return {"input": x, "target": y}


class TinyLM(nn.Module):
    """Causal transformer over bytes: 2 layers, d_model 64, 4 heads, dropout 0.1."""

    def __init__(self, seq_len: int, d_model: int = 64, nhead: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        layer = nn.TransformerEncoderLayer(
            d_model, nhead, dim_feedforward=4 * d_model, dropout=0.1, batch_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, VOCAB)
        self.mask: torch.Tensor
        mask = nn.Transformer.generate_square_subsequent_mask(seq_len)
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, L, 256]`` float32 for byte ids ``x`` ``[B, L]`` int64."""
        length = x.shape[1]
        h = self.tok(x) + self.pos.weight[:length]
        h = self.encoder(h, mask=self.mask[:length, :length], is_causal=True)
        return self.head(h)


def atomic_save(obj: object, path: Path) -> None:
    """``torch.save`` to a temporary name, then rename: a reader never sees half a file."""
    tmp = path.with_name(f".tmp-{path.name}")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def latest_checkpoint(ckpt_dir: Path) -> Path | None:
    """The checkpoint with the highest step (temporaries ignored), or None."""
    found = [p for p in ckpt_dir.glob("step-*.pt") if CKPT_RE.match(p.name)]
    return max(found, key=lambda p: p.name) if found else None


def init_distributed() -> tuple[int, int]:
    """Join torchrun's process group (gloo) when launched by torchrun.

    Returns:
        ``(rank, world_size)``; ``(0, 1)`` when ``WORLD_SIZE`` is not in the environment.
    """
    if "WORLD_SIZE" not in os.environ:
        return 0, 1
    dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size()


def rank_path(path: Path, rank: int) -> Path:
    """``path`` for one rank when distributed (``stream.jsonl.rank1``), else ``path``."""
    return path.with_name(f"{path.name}.rank{rank}") if dist.is_initialized() else path


def save_checkpoint(
    path: Path, model: nn.Module, opt: torch.optim.Optimizer, step: int, token: dict
) -> None:
    """Write a checkpoint holding every rank's data token and torch RNG state.

    Collective when distributed: every rank calls it at the same step, after its
    ``loader.state_dict()``; rank 0 gathers the others' token and RNG and writes the
    file. ``data`` and ``rng`` are rank 0's (what a resume with another world size
    uses); ``ranks[r]`` holds rank ``r``'s, for a resume with the same world size.
    """
    mine = {"data": token, "rng": torch.get_rng_state()}
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    ranks: list[dict] | None = [mine]
    if world_size > 1:
        # Pickled between live processes only: the file itself loads with weights_only.
        ranks = [{} for _ in range(world_size)] if dist.get_rank() == 0 else None
        dist.gather_object(mine, ranks, dst=0)
    if ranks is None:
        return
    ck = {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "step": step,
        "rng": ranks[0]["rng"],
        "data": ranks[0]["data"],
        "world_size": world_size,
        "ranks": ranks,
    }
    atomic_save(ck, path)


def load_checkpoint(
    ckpt_dir: Path, model: nn.Module, opt: torch.optim.Optimizer, loader: ledger.DataLoader
) -> tuple[Path, int, int] | None:
    """Restore model, optimizer, torch RNG and loader from the latest checkpoint.

    With the world size the checkpoint was written with, each rank restores its own
    token and RNG; with another (an elastic resume) every rank restores rank 0's, and
    ``loader.load_state_dict`` redistributes the rest of the epoch over the new ranks.

    Returns:
        ``(path, step, world size that wrote it)``, or ``None`` without a checkpoint.
    """
    path = latest_checkpoint(ckpt_dir)
    if dist.is_initialized():  # every rank must resume from the same file
        chosen = [path]
        dist.broadcast_object_list(chosen, src=0)
        path = chosen[0]
    if path is None:
        return None
    ck = torch.load(path, weights_only=True)
    model.load_state_dict(ck["model"])
    opt.load_state_dict(ck["optimizer"])
    saved_world = int(ck.get("world_size", 1))
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    mine = ck["ranks"][rank] if saved_world == world_size and "ranks" in ck else ck
    torch.set_rng_state(mine["rng"])
    loader.load_state_dict(mine["data"])
    return path, int(ck["step"]), saved_world


def finish_distributed() -> None:
    """Wait for every rank, then leave the process group (no-op without one)."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", type=Path, required=True, help="run directory (log, checkpoints)")
    ap.add_argument("--steps", type=int, default=300, help="training steps (batches)")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--num-workers", type=int, default=2)
    ap.add_argument("--ckpt-every", type=int, default=50, help="checkpoint every N steps")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    ap.add_argument("--max-files", type=int, default=None, help="use the first N stdlib files")
    ap.add_argument(
        "--max-samples", type=int, default=None, help="use N windows spread over the corpus"
    )
    ap.add_argument("--stream-out", type=Path, default=None, help="append per-step JSON lines")
    ap.add_argument(
        "--die-after-commit",
        type=int,
        default=None,
        metavar="STEP",
        help="testing aid: SIGKILL this process after the log commit of STEP, before its "
        "checkpoint is written",
    )
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rank, world_size = init_distributed()

    ckpt_dir = args.root / "ckpt"
    ckpt_dir.mkdir(parents=True, exist_ok=True)

    dataset = StdlibWindows(args.seq_len, args.max_files, args.max_samples)
    loader = ledger.DataLoader(  # rank and world size come from the process group
        dataset,
        batch_size=args.batch_size,
        shuffle=True,
        seed=args.seed,
        num_workers=args.num_workers,
        log=str(args.root / "log"),
    )
    model = TinyLM(args.seq_len)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    step = 0

    if args.resume:
        try:
            resumed = load_checkpoint(ckpt_dir, model, opt, loader)
        except ledger.errors.LedgerError as e:  # e.g. another batch size, or world size
            print(f"error: {e}", file=sys.stderr)
            return 2
        if resumed is None:
            print(f"error: --resume given but no checkpoint in {ckpt_dir}", file=sys.stderr)
            return 2
        path, step, saved_world = resumed
        if rank == 0:
            shape = (
                f" (world size {saved_world} -> {world_size})" if saved_world != world_size else ""
            )
            print(f"resumed from {path.name} at step {step}{shape}", flush=True)

    # Wrapped after the resume, so the checkpoint's weights are what DDP broadcasts.
    net = DistributedDataParallel(model) if dist.is_initialized() else model
    net.train()
    with contextlib.ExitStack() as stack:
        stream = None
        if args.stream_out:
            stream = stack.enter_context(open(rank_path(args.stream_out, rank), "a"))
        while step < args.steps:
            for batch in loader:
                x, y = batch["input"], batch["target"]
                if stream is not None:
                    digest = hashlib.sha256(x.contiguous().numpy().tobytes()).hexdigest()
                    line = {"step": step, "epoch": loader.epoch, "digest": digest}
                    stream.write(json.dumps(line) + "\n")
                    stream.flush()

                logits = net(x)
                loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                if rank == 0:
                    print(f"step {step} loss {loss.item():.4f}", flush=True)
                step += 1

                if step % args.ckpt_every == 0 or step == args.steps:
                    # Commit the log first: a checkpoint must never name a commit that does
                    # not exist. A crash in between leaves a commit without a checkpoint,
                    # which the next attempt treats as an abandoned branch. Every rank
                    # commits here, at the same step: the commit is collective.
                    token = loader.state_dict()
                    if step == args.die_after_commit:
                        os.kill(os.getpid(), signal.SIGKILL)
                    save_checkpoint(ckpt_dir / f"step-{step:08d}.pt", model, opt, step, token)
                if step >= args.steps:
                    break

    if rank == 0:
        atomic_save(model.state_dict(), args.root / "final.pt")
        print(f"done: {step} steps, final weights in {args.root / 'final.pt'}", flush=True)
    finish_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
