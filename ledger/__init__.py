"""ledger: exactly resumable, auditable PyTorch data pipelines.

Public API: :class:`DataLoader`, :class:`Ledger`, :mod:`ledger.errors`,
:mod:`ledger.testing`, :mod:`ledger.audit`.
"""

from ledger import errors
from ledger.loader import DataLoader
from ledger.log import Ledger
from ledger.order import EpochOrder, sample_seeds

__all__ = ["DataLoader", "EpochOrder", "Ledger", "errors", "sample_seeds"]
__version__ = "0.1.0"
