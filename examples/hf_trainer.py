"""Recipe: ledger under Hugging Face ``transformers.Trainer``.

:class:`LedgerTrainer` is all a project needs (copy it):

1. ``get_train_dataloader`` returns the ``ledger.DataLoader`` (Trainer does not wrap it).
2. ``_save_checkpoint`` commits the log (``loader.state_dict()``, collective on every
   rank) before Trainer writes ``checkpoint-N/``, and writes the token there last, as
   ``ledger.json``: a checkpoint folder holding ``ledger.json`` is complete.
3. ``train(resume_from_checkpoint=...)`` loads that token into the loader, so the loader
   stands where the checkpoint's model stopped. Trainer then asks accelerate's
   ``skip_first_batches`` to fast-forward the epoch; for the ledger loader that skip is a
   check instead (the loader must already stand at that batch of the epoch), so Trainer's
   counters, gradient accumulation and RNG restore run as for any resume, and no batch is
   read to be thrown away.

Run as a script, it trains a tiny GPT-2 built from a config (nothing downloaded) on
synthetic token sequences drawn with the per-sample RNG ledger seeds, and writes what
each optimizer step trained on to ``--record`` (one JSON line per batch), which
``tests/test_recipes.py`` compares between a SIGKILLed-and-resumed run and an
uninterrupted one.

Example:
    python examples/hf_trainer.py --out runs/hf --steps 24 --save-steps 6
    python examples/hf_trainer.py --out runs/hf --steps 24 --save-steps 6 --resume
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import re
from collections.abc import Iterator
from typing import Any

import torch
import transformers.trainer
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

import ledger

TOKEN_FILE = "ledger.json"
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


def last_complete_checkpoint(output_dir: str) -> str | None:
    """The newest ``checkpoint-N`` folder that holds a ledger token (written last)."""
    found = [
        (int(m.group(1)), name)
        for name in (os.listdir(output_dir) if os.path.isdir(output_dir) else [])
        if (m := _CHECKPOINT.match(name))
        and os.path.exists(os.path.join(output_dir, name, TOKEN_FILE))
    ]
    return os.path.join(output_dir, max(found)[1]) if found else None


@contextlib.contextmanager
def _skip_is_a_check(loader: ledger.DataLoader) -> Iterator[None]:
    """Trainer fast-forwards a resumed epoch with accelerate's ``skip_first_batches``,
    which re-reads and drops batches; the ledger loader is already there."""
    original = transformers.trainer.skip_first_batches

    def skip(dataloader: Any, num_batches: int = 0) -> Any:
        if dataloader is not loader:
            return original(dataloader, num_batches)
        if loader.state.epoch_batch != num_batches:
            raise ledger.errors.ResumeMismatch(
                f"Trainer resumes at batch {num_batches} of the epoch, the ledger token at batch "
                f"{loader.state.epoch_batch}: the token is not of this checkpoint"
            )
        return loader

    transformers.trainer.skip_first_batches = skip
    try:
        yield
    finally:
        transformers.trainer.skip_first_batches = original


class LedgerTrainer(Trainer):
    """A ``Trainer`` whose training data comes from a ``ledger.DataLoader`` that is
    committed with every checkpoint and restored by ``resume_from_checkpoint``."""

    def __init__(self, *args: Any, ledger_loader: ledger.DataLoader, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.ledger_loader = ledger_loader

    def get_train_dataloader(self) -> Any:
        return self.ledger_loader

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        token = self.ledger_loader.state_dict()  # the log commit first, on every rank
        super()._save_checkpoint(model, trial)
        if self.args.should_save:
            folder = os.path.join(
                self._get_output_dir(trial=trial), f"checkpoint-{self.state.global_step}"
            )
            tmp = os.path.join(folder, TOKEN_FILE + ".tmp")
            with open(tmp, "w") as f:
                json.dump(token, f)
            os.replace(tmp, os.path.join(folder, TOKEN_FILE))

    def train(self, resume_from_checkpoint: str | bool | None = None, **kwargs: Any) -> Any:
        if resume_from_checkpoint is True:
            resume_from_checkpoint = last_complete_checkpoint(self.args.output_dir)
            if resume_from_checkpoint is None:
                raise ValueError(f"no checkpoint with {TOKEN_FILE} in {self.args.output_dir}")
        if resume_from_checkpoint:
            with open(os.path.join(str(resume_from_checkpoint), TOKEN_FILE)) as f:
                self.ledger_loader.load_state_dict(json.load(f))
        with _skip_is_a_check(self.ledger_loader):
            return super().train(resume_from_checkpoint=resume_from_checkpoint, **kwargs)


# ---------------------------------------------------------------- the script


class RandomSequences:
    """``n`` token sequences drawn with torch's RNG, which ledger seeds per sample from
    ``(seed, epoch, sample id)``: the same sample differs between epochs, never between
    a run and its resume."""

    def __init__(self, n: int, seq_len: int, vocab: int) -> None:
        self.n, self.seq_len, self.vocab = n, seq_len, vocab

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(1, self.vocab, (self.seq_len,))
        return {"input_ids": ids, "labels": ids.clone()}


class RecordingTrainer(LedgerTrainer):
    """Writes the step and a digest of every batch it trains on (for the test)."""

    def __init__(self, *args: Any, record: str | None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.record = open(record, "a") if record else None  # noqa: SIM115 (lives with the trainer)

    def training_step(self, model: Any, inputs: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        if self.record is not None:
            digest = hashlib.sha256(inputs["input_ids"].cpu().numpy().tobytes()).hexdigest()[:16]
            line = {"step": self.state.global_step, "input_ids": digest}
            self.record.write(json.dumps(line) + "\n")
            self.record.flush()
        return super().training_step(model, inputs, *args, **kwargs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="Trainer output_dir; the log goes to OUT/log")
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--save-steps", type=int, default=6)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--samples", type=int, default=40)
    p.add_argument("--num-workers", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--record", help="append one JSON line per trained batch to this file")
    args = p.parse_args()

    torch.manual_seed(args.seed)
    config = GPT2Config(
        vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, bos_token_id=0,
        eos_token_id=0,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    model = GPT2LMHeadModel(config)
    loader = ledger.DataLoader(
        RandomSequences(args.samples, 16, config.vocab_size),
        batch_size=args.batch_size,
        shuffle=True,
        seed=args.seed,
        num_workers=args.num_workers,
        log=os.path.join(args.out, "log"),
    )
    training = TrainingArguments(
        output_dir=args.out,
        max_steps=args.steps,
        save_steps=args.save_steps,
        per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=args.grad_accum,
        learning_rate=1e-3,
        logging_steps=args.save_steps,
        report_to=[],
        seed=args.seed,
        use_cpu=True,
        disable_tqdm=True,
    )
    trainer = RecordingTrainer(model=model, args=training, ledger_loader=loader, record=args.record)
    trainer.train(resume_from_checkpoint=True if args.resume else None)
    if trainer.args.should_save:
        state = {k: v.contiguous() for k, v in trainer.model.state_dict().items()}
        weights = b"".join(state[k].numpy().tobytes() for k in sorted(state))
        with open(os.path.join(args.out, "final.sha256"), "w") as f:
            f.write(hashlib.sha256(weights).hexdigest() + "\n")


if __name__ == "__main__":
    main()
