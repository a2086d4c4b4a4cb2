"""Streaming pipelines: sharded sources, shuffle buffers and sequence packing.

Hand a :class:`Stream` to :class:`ledger.DataLoader` in place of a map-style dataset.
"""

from ledger.stream.packing import Packer
from ledger.stream.sample import SampleContext
from ledger.stream.source import ShardedSource
from ledger.stream.spec import Stream

__all__ = ["Packer", "SampleContext", "ShardedSource", "Stream"]
