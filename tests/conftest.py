from __future__ import annotations

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


@pytest.fixture
def root(tmp_path):
    """A fresh log root on local disk."""
    return str(tmp_path / "log")
