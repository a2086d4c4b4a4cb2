"""Train a tiny byte-level language model on a weighted mixture of two real corpora, with
an annealing phase, resumably.

The two corpora are on every machine that runs Python:

- ``code``: the ``.py`` files of the running interpreter's standard library
  (``train_lm.StdlibWindows``);
- ``docs``: the ``.txt``, ``.md`` and ``.rst`` files of the installed packages
  (``site-packages``: licences, READMEs, changelogs), :class:`DocsWindows`.

A ``ledger.Mixture`` serves them with weights 0.7/0.3 until the annealing phase, then
0.3/0.7 (a ``ledger.Schedule`` by samples: the boundary is ``--anneal-from`` of the
run's samples, rounded down to a block of 1,000). Kill the process at any instant,
rerun with ``--resume``, and the batches the training loop sees -- and the final
weights -- are identical to a run that never stopped (``tools/demo.py``).
``ledger audit ROOT/log --check mixture`` compares each source's realised share with its
target; ``ledger audit ROOT/log`` shows the shares over steps, the annealing included.

Layout under ``--root DIR``: as ``train_lm.py`` (``log/``, ``ckpt/``, ``final.pt``).

Example:
    python examples/train_lm_mixture.py --root runs/mix --steps 250 --stream-out runs/mix/s.jsonl
    python examples/train_lm_mixture.py --root runs/mix --steps 250 --resume   # after a crash
    ledger audit runs/mix/log --check mixture
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import signal
import site
import sys
import sysconfig
from pathlib import Path

import numpy as np
import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_lm import (
    VOCAB,
    StdlibWindows,
    TinyLM,
    atomic_save,
    load_checkpoint,
    save_checkpoint,
)

import ledger
from ledger.mixture import BLOCK

DOC_SUFFIXES = (".txt", ".md", ".rst")
WEIGHTS = {"code": 0.7, "docs": 0.3}
ANNEAL = {"code": 0.3, "docs": 0.7}


def doc_files(max_files: int | None = None) -> list[Path]:
    """The ``.txt``/``.md``/``.rst`` files under the installed packages' directories, sorted.

    Args:
        max_files: keep only the first ``max_files`` paths.

    Returns:
        Sorted absolute paths (empty files left out).
    """
    roots = {Path(p) for p in site.getsitepackages()} | {Path(sysconfig.get_paths()["purelib"])}
    files: set[Path] = set()
    for root in sorted(roots):
        if not root.is_dir():
            continue
        for parent, _, names in os.walk(root):
            files |= {Path(parent, n) for n in names if n.endswith(DOC_SUFFIXES)}
    found = sorted(p for p in files if p.is_file() and p.stat().st_size > 0)
    return found[:max_files] if max_files is not None else found


class DocsWindows(torch.utils.data.Dataset):
    """Non-overlapping windows of ``seq_len + 1`` bytes over the concatenated docs.

    Args:
        seq_len: tokens (bytes) per sample.
        max_files: corpus limited to the first ``max_files`` files.
        max_samples: keep ``max_samples`` windows spread evenly over the corpus.

    Raises:
        ValueError: if no documentation file is installed.
    """

    def __init__(
        self, seq_len: int, max_files: int | None = None, max_samples: int | None = None
    ) -> None:
        files = doc_files(max_files)
        if not files:
            raise ValueError("no .txt/.md/.rst file under the installed packages")
        self.seq_len = seq_len
        self.data = np.frombuffer(b"".join(p.read_bytes() for p in files), dtype=np.uint8)
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
        return {"input": window[:-1].clone(), "target": window[1:].clone()}


def build_mixture(
    seq_len: int,
    steps: int,
    batch_size: int,
    anneal_from: float,
    max_samples: int | None,
    max_files: int | None = None,
) -> tuple[ledger.Mixture, int | None]:
    """The two corpora mixed, and the sample where the annealing phase starts (``None``:
    the run is too short for a phase at a block boundary).

    Args:
        seq_len: bytes per window.
        steps, batch_size: the run's length (the phase boundary is a share of it).
        anneal_from: share of the run's samples before the annealing weights.
        max_samples: windows per corpus, spread over it (``None``: all).
        max_files: files per corpus (the first ones, sorted; ``None``: all).
    """
    code = StdlibWindows(seq_len, max_files, max_samples)
    docs = DocsWindows(seq_len, max_files, max_samples)
    anneal = int(anneal_from * steps * batch_size) // BLOCK * BLOCK
    pieces = {0: WEIGHTS, anneal: ANNEAL} if anneal > 0 else {0: WEIGHTS}
    # A mixture epoch of 100 batches, so the run crosses epochs (the corpora's own
    # epochs run on their own: "code" repeats sooner than "docs" while it weighs more).
    mix = ledger.Mixture(
        {"code": code, "docs": docs},
        weights=ledger.Schedule(pieces),
        epoch_size=100 * batch_size,
    )
    return mix, anneal if anneal > 0 else None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", type=Path, required=True, help="run directory (log, checkpoints)")
    ap.add_argument("--steps", type=int, default=250, help="training steps (batches)")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--num-workers", type=int, default=2)
    ap.add_argument("--ckpt-every", type=int, default=50, help="checkpoint every N steps")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument(
        "--anneal-from",
        type=float,
        default=0.9,
        help="fraction of the run's samples after which the annealing weights apply "
        "(rounded down to a block of 1,000 samples)",
    )
    ap.add_argument("--max-samples", type=int, default=2000, help="windows per corpus (0: all)")
    ap.add_argument("--max-files", type=int, default=None, help="use the first N files per corpus")
    ap.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    ap.add_argument("--stream-out", type=Path, default=None, help="append per-step JSON lines")
    ap.add_argument(
        "--die-after-commit",
        type=int,
        default=None,
        metavar="STEP",
        help="testing aid: SIGKILL this process after the log commit of STEP",
    )
    ap.add_argument(
        "--stop-after",
        type=int,
        default=None,
        metavar="STEP",
        help="exit after the checkpoint of STEP, as a preempted job does (then --resume)",
    )
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    ckpt_dir = args.root / "ckpt"
    ckpt_dir.mkdir(parents=True, exist_ok=True)

    mix, anneal = build_mixture(
        args.seq_len,
        args.steps,
        args.batch_size,
        args.anneal_from,
        args.max_samples or None,
        args.max_files,
    )
    loader = ledger.DataLoader(
        mix,
        batch_size=args.batch_size,
        shuffle=True,
        seed=args.seed,
        num_workers=args.num_workers,
        log=str(args.root / "log"),
    )
    where = (
        f"annealing from sample {anneal} (step {anneal // args.batch_size})"
        if anneal
        else ("no annealing phase (run too short)")
    )
    print(
        f"mixture: code {len(mix.sources[0])} + docs {len(mix.sources[1])} windows, "
        f"weights {WEIGHTS}, {where}",
        flush=True,
    )
    model = TinyLM(args.seq_len)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    step = 0
    if args.resume:
        try:
            resumed = load_checkpoint(ckpt_dir, model, opt, loader)
        except ledger.errors.LedgerError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        if resumed is None:
            print(f"error: --resume given but no checkpoint in {ckpt_dir}", file=sys.stderr)
            return 2
        path, step, _ = resumed
        print(f"resumed from {path.name} at step {step}", flush=True)

    model.train()
    with contextlib.ExitStack() as stack:
        stream = stack.enter_context(open(args.stream_out, "a")) if args.stream_out else None
        while step < args.steps:
            for batch in loader:
                x, y = batch["input"], batch["target"]
                if stream is not None:
                    digest = hashlib.sha256(x.contiguous().numpy().tobytes()).hexdigest()
                    line = {"step": step, "epoch": loader.epoch, "digest": digest}
                    stream.write(json.dumps(line) + "\n")
                    stream.flush()
                logits = model(x)
                loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                print(f"step {step} loss {loss.item():.4f}", flush=True)
                step += 1
                if step % args.ckpt_every == 0 or step == args.steps:
                    token = loader.state_dict()  # the log commit first, then the checkpoint
                    if step == args.die_after_commit:
                        os.kill(os.getpid(), signal.SIGKILL)
                    save_checkpoint(ckpt_dir / f"step-{step:08d}.pt", model, opt, step, token)
                    if step == args.stop_after:
                        print(f"stopped after the checkpoint of step {step}", flush=True)
                        loader.close()
                        return 0
                if step >= args.steps:
                    break
    atomic_save(model.state_dict(), args.root / "final.pt")
    print(f"done: {step} steps, final weights in {args.root / 'final.pt'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
