"""torch.distributed coordination: one attempt number and one commit marker for all ranks.

Payloads travel as JSON in ``uint8`` tensors, never pickled (torch's ``*_object``
collectives pickle).
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ledger.errors import UnsupportedArgument


class Group:
    """The ranks that share one log.

    Args:
        rank: this rank.
        world_size: number of ranks.
        group: the process group (default: the world group); needed when
            ``world_size > 1``.

    Raises:
        UnsupportedArgument: if ``world_size > 1`` and torch.distributed is not
            initialised.
    """

    def __init__(self, rank: int, world_size: int, group: Any = None) -> None:
        self.rank = rank
        self.world_size = world_size
        self.group = group
        if world_size > 1 and not (dist.is_available() and dist.is_initialized()):
            raise UnsupportedArgument(
                f"world_size={world_size} needs torch.distributed to be initialised "
                "(init_process_group) before the log is used"
            )

    @property
    def coordinated(self) -> bool:
        """Whether commits are collective (more than one rank)."""
        return self.world_size > 1

    def _device(self) -> torch.device:
        backend = dist.get_backend(self.group)
        if backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's JSON-serialisable ``obj``, in rank order (collective)."""
        if not self.coordinated:
            return [obj]
        device = self._device()
        data = torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)
        size = torch.tensor([data.numel()], dtype=torch.int64, device=device)
        sizes = [torch.zeros_like(size) for _ in range(self.world_size)]
        dist.all_gather(sizes, size, group=self.group)
        longest = int(max(s.item() for s in sizes))
        padded = torch.zeros(longest, dtype=torch.uint8, device=device)
        padded[: data.numel()] = data.to(device)
        out = [torch.zeros_like(padded) for _ in range(self.world_size)]
        dist.all_gather(out, padded, group=self.group)
        return [
            json.loads(bytes(t[: int(s.item())].cpu().numpy()).decode())
            for t, s in zip(out, sizes, strict=True)
        ]

    def gather(self, obj: Any, dst: int = 0) -> list[Any] | None:
        """Every rank's JSON-serialisable ``obj`` on rank ``dst``, in rank order; ``None``
        on the other ranks (collective). Only ``dst`` receives W payloads: the others send
        one and receive nothing, so a commit costs them O(1) at any world size."""
        if not self.coordinated:
            return [obj]
        device = self._device()
        data = torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)
        size = torch.tensor([data.numel()], dtype=torch.int64, device=device)
        # The longest payload sizes the buffers: one all_reduce of one integer.
        longest = size.clone()
        dist.all_reduce(longest, op=dist.ReduceOp.MAX, group=self.group)
        width = int(longest.item()) + 8
        padded = torch.zeros(width, dtype=torch.uint8, device=device)
        padded[:8] = size.cpu().view(torch.uint8).to(device)
        padded[8 : 8 + data.numel()] = data.to(device)
        mine = self.rank == dst
        out = [torch.zeros_like(padded) for _ in range(self.world_size)] if mine else None
        dist.gather(padded, out, dst=dst, group=self.group)
        if out is None:
            return None
        found = []
        for t in out:
            raw = bytes(t.cpu().numpy())
            n = int.from_bytes(raw[:8], "little")
            found.append(json.loads(raw[8 : 8 + n].decode()))
        return found

    def gather_rows(self, row: np.ndarray, dst: int = 0) -> np.ndarray | None:
        """Every rank's ``int64`` vector on rank ``dst`` as a ``(W, L)`` matrix (rows
        zero-padded to the longest), ``None`` on the other ranks (collective).

        No JSON and no Python object per rank on ``dst``: the commit's O(W) work there is
        numpy's (:func:`ledger.ranks.from_rows`)."""
        if not self.coordinated:
            return row[None, :]
        device = self._device()
        length = torch.tensor([row.size], dtype=torch.int64, device=device)
        dist.all_reduce(length, op=dist.ReduceOp.MAX, group=self.group)
        padded = torch.zeros(int(length.item()), dtype=torch.int64)
        padded[: row.size] = torch.from_numpy(row)
        padded = padded.to(device)
        out = (
            [torch.zeros_like(padded) for _ in range(self.world_size)] if self.rank == dst else None
        )
        dist.gather(padded, out, dst=dst, group=self.group)
        if out is None:
            return None
        return torch.stack(out).cpu().numpy()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Rank ``src``'s JSON-serialisable ``obj`` on every rank (collective)."""
        if not self.coordinated:
            return obj
        device = self._device()
        data = json.dumps(obj).encode() if self.rank == src else b""
        size = torch.tensor([len(data)], dtype=torch.int64, device=device)
        dist.broadcast(size, src, group=self.group)
        buf = torch.zeros(int(size.item()), dtype=torch.uint8, device=device)
        if self.rank == src:
            buf[:] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
        dist.broadcast(buf, src, group=self.group)
        return json.loads(bytes(buf.cpu().numpy()).decode())
