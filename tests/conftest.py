from __future__ import annotations

import os
import random

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


@pytest.fixture
def root(tmp_path):
    """A fresh log root on local disk."""
    return str(tmp_path / "log")
