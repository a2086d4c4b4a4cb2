"""What the user describes: a :class:`Stream` (rows, transform, shuffle buffer, packer).

The rest of :mod:`ledger.stream` runs it: :mod:`~ledger.stream.plan` deals shards to
logical workers, :mod:`~ledger.stream.worker` reads, transforms, shuffles and packs in
each worker, :mod:`~ledger.stream.replica` mirrors each worker's ids in the main process,
and :mod:`~ledger.stream.pipeline` ties them to :class:`ledger.DataLoader`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ledger.errors import UnsupportedArgument
from ledger.stream.packing import Packer
from ledger.stream.sample import SampleContext
from ledger.stream.source import ShardedSource
from ledger.torch_args import count


@dataclass(frozen=True, slots=True)
class Stream:
    """A streaming pipeline to hand to :class:`ledger.DataLoader` instead of a dataset.

    Args:
        source: the rows.
        transform: ``f(record: dict, ctx: SampleContext) -> item`` applied to each row as
            it is read; with a packer the item must be a sequence of int token ids (a nested
            one is flattened: one token list per word is the sample's tokens in order).
        shuffle_buffer: shuffle buffer size per logical worker (rows); 0: no buffer.
        packer: pack items into fixed-length token sequences, or ``None``.
    """

    source: ShardedSource
    transform: Callable[[dict[str, Any], SampleContext], Any] | None = None
    shuffle_buffer: int = 0
    packer: Packer | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.source, ShardedSource):
            raise UnsupportedArgument(
                f"a Stream reads a ledger.stream.ShardedSource, got {type(self.source).__name__}"
                ": wrap the files, e.g. Stream(ShardedSource('data/*.parquet'))"
            )
        if self.transform is not None and not callable(self.transform):
            raise UnsupportedArgument(
                f"transform must be callable (record, ctx) or None, got "
                f"{type(self.transform).__name__}"
            )
        if self.packer is not None and not isinstance(self.packer, Packer):
            raise UnsupportedArgument(
                f"packer must be a ledger.stream.Packer or None, got {type(self.packer).__name__}"
            )
        count("shuffle_buffer", self.shuffle_buffer, 0)

    def config(self) -> dict[str, Any]:
        """What must not change across a resume (stored in ``run.json``)."""
        return {
            "source": self.source.fingerprint(),
            "shuffle_buffer": self.shuffle_buffer,
            "packer": None
            if self.packer is None
            else {
                "seq_len": self.packer.seq_len,
                "eos_id": self.packer.eos_id,
                "pad_id": self.packer.pad_id,
            },
        }
