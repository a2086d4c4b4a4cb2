"""ledger: exactly resumable, auditable PyTorch data pipelines.

Public API: :class:`DataLoader`, :class:`Ledger`, :class:`Mixture` and :class:`Schedule`
(weighted mixtures), :class:`EpochOrder`, :func:`sample_seeds`, :mod:`ledger.errors`,
:mod:`ledger.testing`, :mod:`ledger.audit`, :mod:`ledger.preemption`.

The names are imported on first use (PEP 562), so ``ledger.audit`` and the ``ledger``
command do not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ledger import errors

if TYPE_CHECKING:
    from ledger import preemption
    from ledger.loader import DataLoader
    from ledger.log import Ledger
    from ledger.mixture import Mixture, Schedule
    from ledger.order import EpochOrder, sample_seeds

_LAZY = {
    "DataLoader": "ledger.loader",
    "Ledger": "ledger.log",
    "Mixture": "ledger.mixture",
    "Schedule": "ledger.mixture",
    "EpochOrder": "ledger.order",
    "sample_seeds": "ledger.order",
}

_SUBMODULES = ("preemption",)

__all__ = [
    "DataLoader", "EpochOrder", "Ledger", "Mixture", "Schedule", "errors", "preemption",
    "sample_seeds",
]  # fmt: skip
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        value = importlib.import_module(f"ledger.{name}")
        globals()[name] = value
        return value
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'ledger' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
