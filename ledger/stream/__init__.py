"""Streaming pipelines: sharded sources, shuffle buffers and sequence packing.

Hand a :class:`Stream` to :class:`ledger.DataLoader` in place of a map-style dataset.
"""

from ledger.stream.pipeline import Packer, SampleContext, Stream
from ledger.stream.source import ShardedSource

__all__ = ["Packer", "SampleContext", "ShardedSource", "Stream"]
