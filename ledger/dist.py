"""torch.distributed coordination: one attempt number and one commit marker for all ranks.

Payloads travel as JSON in ``uint8`` tensors, never pickled (torch's ``*_object``
collectives pickle).
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist


class Group:
    """The ranks that share one log.

    Args:
        rank: this rank.
        world_size: number of ranks.
        group: the process group (default: the world group); needed when
            ``world_size > 1``.
    """

    def __init__(self, rank: int, world_size: int, group: Any = None) -> None:
        self.rank = rank
        self.world_size = world_size
        self.group = group
        if world_size > 1 and not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
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
