"""Train the tiny byte-level LM on Parquet shards of the stdlib, packed, resumably.

The streaming twin of ``examples/train_lm.py`` (whose model, checkpoint layout and
``--resume`` / ``--stream-out`` / ``--die-after-commit`` conventions it reuses). The data
flows:

1. ``ShardedSource``: the shards of ``tools/make_shards.py``, one row per stdlib file;
   sample id = global row number over the sorted shard list.
2. Each epoch, the shards, in a seeded order, are dealt round robin to
   ``max(--num-workers, 1)`` logical workers; the stream therefore depends on
   ``--num-workers``, and ``--resume`` needs the same value.
3. ``byte_tokenize``, as a worker reads a row: the file's UTF-8 bytes as tokens; with
   probability 0.1 the first line is dropped first, drawn from ``ctx.rng`` and logged
   with the sample as ``dropped_first_line``.
4. the worker's shuffle buffer of ``--shuffle-buffer`` documents.
5. the worker's ``Packer``: documents, each followed by EOS (token 0), cut into rows of
   ``--seq-len + 1`` tokens; the worker's last row of an epoch is padded with 0, where
   ``sample_ids`` is -1.
6. ``ledger.DataLoader``: logs every consumed sample and span; its ``state_dict`` goes
   into each checkpoint.

Tokens are raw bytes and the vocabulary stays 256 (``train_lm.TinyLM`` unchanged), so
EOS and padding share id 0 with the NUL byte. No stdlib ``.py`` file contains a NUL
(CPython refuses source with one) and U+FFFD from undecodable bytes encodes without
one, so in this corpus 0 only ever means EOS or padding. Padding is excluded from the
loss through ``sample_ids``, not through the token value.

Layout under ``--root DIR``: as for ``train_lm.py`` (``log/``, ``ckpt/``, ``final.pt``),
plus ``shards/`` when ``--shards-dir`` is not given.

Under ``torchrun`` it runs data parallel as ``train_lm.py`` does (gloo, DDP, collective
checkpoints holding every rank's token, ``--stream-out`` per rank). Each rank's logical
workers read their own shards, so ranks may end their epochs at different steps; the
training steps stay in lockstep. ``--resume`` needs the world size of the checkpoint: a
stream cannot change it yet (``ledger`` refuses with ``ConfigMismatch``).

Example:
    python examples/train_lm_packed.py --root runs/packed --steps 200 --max-files 40
    python examples/train_lm_packed.py --root runs/packed --steps 200 --resume
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import ledger
from ledger.stream import Packer, SampleContext, ShardedSource, Stream

# examples/ and tools/ are not packages: reuse train_lm.py and make_shards.py by path.
_REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(_REPO / "examples"), str(_REPO / "tools")]
from make_shards import make_shards, read_manifest  # noqa: E402
from train_lm import (  # noqa: E402
    VOCAB,
    TinyLM,
    atomic_save,
    finish_distributed,
    init_distributed,
    load_checkpoint,
    rank_path,
    save_checkpoint,
)

EOS = 0  # also the padding id; see the module docstring
DROP_FIRST_LINE_P = 0.1
DEFAULT_SHARDS = 8


def byte_tokenize(record: dict[str, Any], ctx: SampleContext) -> np.ndarray:
    """One stdlib file as byte tokens, sometimes without its first line.

    Args:
        record: a shard row, ``{"path": str, "text": str}``.
        ctx: the sample's context; ``ctx.rng`` decides the augmentation, which is
            logged as ``dropped_first_line``.

    Returns:
        int64 ``[n_bytes]``, values in ``[0, 256)``.
    """
    text = record["text"]
    dropped = bool(ctx.rng.random() < DROP_FIRST_LINE_P)
    if dropped:
        text = text.partition("\n")[2]
    ctx.record(dropped_first_line=dropped)
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)


def shard_paths(shards_dir: Path, max_files: int | None) -> list[str]:
    """The shards under ``shards_dir``, made first if the directory has none.

    Raises:
        ValueError: the existing shards were made with another ``max_files``.
    """
    manifest = read_manifest(shards_dir)
    if manifest is None:
        # Under torchrun every rank may get here; they write identical files atomically.
        make_shards(shards_dir, DEFAULT_SHARDS, max_files)
        manifest = read_manifest(shards_dir)
        assert manifest is not None
    elif max_files is not None and manifest["max_files"] != max_files:
        raise ValueError(
            f"{shards_dir} holds shards of max_files={manifest['max_files']}, not "
            f"--max-files {max_files}; pass another --shards-dir or drop --max-files"
        )
    return [str(shards_dir / entry["path"]) for entry in manifest["shards"]]


def batch_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Mean next-byte cross entropy over the non-padding targets of a packed batch.

    Args:
        batch: ``tokens`` and ``sample_ids``, int64 ``[B, seq_len + 1]``.
    """
    tokens, sample_ids = batch["tokens"], batch["sample_ids"]
    target = tokens[:, 1:].masked_fill(sample_ids[:, 1:] == -1, -100)
    logits = model(tokens[:, :-1])
    return nn.functional.cross_entropy(
        logits.reshape(-1, VOCAB), target.reshape(-1), ignore_index=-100
    )


def digest(batch: dict[str, torch.Tensor]) -> str:
    """sha256 of a batch's tokens and sample ids: equal digests, equal batches."""
    h = hashlib.sha256(batch["tokens"].contiguous().numpy().tobytes())
    h.update(batch["sample_ids"].contiguous().numpy().tobytes())
    return h.hexdigest()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", type=Path, required=True, help="run directory (log, checkpoints)")
    ap.add_argument(
        "--shards-dir", type=Path, default=None, help="Parquet shards (default ROOT/shards)"
    )
    ap.add_argument("--steps", type=int, default=300, help="training steps (batches)")
    ap.add_argument("--batch-size", type=int, default=16, help="packed rows per batch")
    ap.add_argument("--seq-len", type=int, default=128, help="model context (tokens)")
    ap.add_argument("--shuffle-buffer", type=int, default=256, help="documents")
    ap.add_argument("--num-workers", type=int, default=2)
    ap.add_argument("--ckpt-every", type=int, default=50, help="checkpoint every N steps")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    ap.add_argument(
        "--max-files", type=int, default=None, help="shards of the first N stdlib files"
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
    rank, _ = init_distributed()

    ckpt_dir = args.root / "ckpt"
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    try:
        shards = shard_paths(args.shards_dir or args.root / "shards", args.max_files)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    # Rows of seq_len + 1 tokens: input and next-token target are the row shifted by one.
    stream = Stream(
        ShardedSource(shards),
        transform=byte_tokenize,
        shuffle_buffer=args.shuffle_buffer,
        packer=Packer(seq_len=args.seq_len + 1, eos_id=EOS, pad_id=EOS),
    )
    loader = ledger.DataLoader(
        stream,
        batch_size=args.batch_size,
        shuffle=True,  # the shard order of each epoch; False reads shards in path order
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
        path, step, _ = resumed
        if rank == 0:
            print(f"resumed from {path.name} at step {step}", flush=True)

    net = DistributedDataParallel(model) if dist.is_initialized() else model
    net.train()
    with contextlib.ExitStack() as stack:
        out = None
        if args.stream_out:
            out = stack.enter_context(open(rank_path(args.stream_out, rank), "a"))
        while step < args.steps:
            for batch in loader:
                if out is not None:
                    line = {"step": step, "epoch": loader.epoch, "digest": digest(batch)}
                    out.write(json.dumps(line) + "\n")
                    out.flush()

                loss = batch_loss(net, batch)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                if rank == 0:
                    print(f"step {step} loss {loss.item():.4f}", flush=True)
                step += 1

                if step % args.ckpt_every == 0 or step == args.steps:
                    # Log commit first, as in train_lm.py: a checkpoint never names a
                    # commit that does not exist. Collective: every rank, same step.
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
