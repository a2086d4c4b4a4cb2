"""Recipe: ledger under Lightning (``lightning.pytorch``).

Nothing to subclass: return the ``ledger.DataLoader`` from ``train_dataloader()``.
Lightning saves the state of a training loader that has ``state_dict()`` and
``load_state_dict()`` in every checkpoint (``loops.fit_loop.state_dict.combined_loader``)
and restores it when ``trainer.fit(..., ckpt_path=...)`` resumes, before it iterates; for
ledger that state is the token, and ``state_dict()`` is the log commit, made while
Lightning writes the checkpoint.

One condition: the loader handed over no batch that the model has not trained on when
the checkpoint is written. Lightning fetches one batch ahead only when the loader has no
length, so a map-style dataset (``len(loader)`` known) needs nothing. For a
``ledger.stream.Stream`` (no length), write ``training_step(self, dataloader_iter)`` and
call ``next(dataloader_iter)`` yourself: Lightning then prefetches nothing.

Run as a script, it trains a tiny causal model built from a config on synthetic token
sequences and appends what each step trained on to ``--record`` (one JSON line per
batch), which ``tests/test_recipes.py`` compares between a SIGKILLed-and-resumed run and an
uninterrupted one.

Example:
    python examples/lightning_recipe.py --out runs/pl --steps 24 --save-steps 6
    python examples/lightning_recipe.py --out runs/pl --steps 24 --save-steps 6 --resume
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
from dataclasses import dataclass

import lightning.pytorch as pl
import torch
from torch import nn

import ledger

_CKPT = re.compile(r"^step=(\d+)\.ckpt$")


@dataclass(frozen=True)
class TinyConfig:
    vocab: int = 64
    dim: int = 32
    seq_len: int = 16


class TinyLM(pl.LightningModule):
    """Embedding, one GRU layer, a linear head: next-token prediction."""

    def __init__(self, config: TinyConfig, record: str | None = None) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab, config.dim)
        self.rnn = nn.GRU(config.dim, config.dim, batch_first=True)
        self.head = nn.Linear(config.dim, config.vocab)
        self.record = record

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.rnn(self.embed(tokens))
        return self.head(hidden)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        tokens = batch["input_ids"]
        if self.record is not None:
            digest = hashlib.sha256(tokens.cpu().numpy().tobytes()).hexdigest()[:16]
            with open(self.record, "a") as f:
                f.write(json.dumps({"step": self.global_step, "input_ids": digest}) + "\n")
        logits = self(tokens[:, :-1])
        return nn.functional.cross_entropy(
            logits.reshape(-1, self.config.vocab), tokens[:, 1:].reshape(-1)
        )

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class RandomSequences:
    """``n`` token sequences drawn with torch's RNG, seeded by ledger per sample."""

    def __init__(self, n: int, seq_len: int, vocab: int) -> None:
        self.n, self.seq_len, self.vocab = n, seq_len, vocab

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": torch.randint(1, self.vocab, (self.seq_len,))}


class LedgerData(pl.LightningDataModule):
    """The training loader is a ``ledger.DataLoader``: Lightning checkpoints its token."""

    def __init__(self, log: str, samples: int, batch_size: int, seed: int, workers: int) -> None:
        super().__init__()
        self.log, self.samples, self.batch_size = log, samples, batch_size
        self.seed, self.workers = seed, workers

    def train_dataloader(self) -> ledger.DataLoader:
        config = TinyConfig()
        return ledger.DataLoader(
            RandomSequences(self.samples, config.seq_len, config.vocab),
            batch_size=self.batch_size,
            shuffle=True,
            seed=self.seed,
            num_workers=self.workers,
            log=self.log,
        )


def last_checkpoint(folder: str) -> str | None:
    """The newest ``step=N.ckpt`` that loads (a kill mid-write leaves a torn file)."""
    found = sorted(
        ((int(m.group(1)), name) for name in os.listdir(folder) if (m := _CKPT.match(name))),
        reverse=True,
    ) if os.path.isdir(folder) else []  # fmt: skip
    for _, name in found:
        path = os.path.join(folder, name)
        try:
            torch.load(path, map_location="cpu", weights_only=False)
        except Exception:  # a torn file of a killed write: any error
            continue
        return path
    return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="checkpoints in OUT/ckpt, the log in OUT/log")
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--save-steps", type=int, default=6)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--samples", type=int, default=40)
    p.add_argument("--num-workers", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--record", help="append one JSON line per trained batch to this file")
    args = p.parse_args()

    pl.seed_everything(args.seed, workers=False, verbose=False)
    model = TinyLM(TinyConfig(), record=args.record)
    data = LedgerData(
        os.path.join(args.out, "log"), args.samples, args.batch_size, args.seed, args.num_workers
    )
    ckpt_dir = os.path.join(args.out, "ckpt")
    trainer = pl.Trainer(
        max_steps=args.steps,
        accelerator="cpu",
        devices=1,
        deterministic=True,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[
            pl.callbacks.ModelCheckpoint(
                dirpath=ckpt_dir,
                filename="{step}",
                every_n_train_steps=args.save_steps,
                save_top_k=-1,
            )
        ],
    )
    ckpt = last_checkpoint(ckpt_dir) if args.resume else None
    if args.resume and ckpt is None:
        raise SystemExit(f"no checkpoint in {ckpt_dir}")
    trainer.fit(model, datamodule=data, ckpt_path=ckpt)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    weights = b"".join(state[k].numpy().tobytes() for k in sorted(state))
    with open(os.path.join(args.out, "final.sha256"), "w") as f:
        f.write(hashlib.sha256(weights).hexdigest() + "\n")


if __name__ == "__main__":
    main()
