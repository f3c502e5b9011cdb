"""Communication in flight (ring sends/receives, all-gathers), completed on an error; one flat buffer of several
tensors."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .plan import Call


class PostedTransfers:
    """Sends/receives in flight. On an error after they were posted, `drain` completes them, so the group's
    next collective is not matched against a half-finished exchange."""

    def __init__(self):
        self.works = []

    def post(self, buffers: list[torch.Tensor], call: Call) -> list[torch.Tensor]:
        """Send `buffers` to the next rank and receive the previous rank's into new buffers (asynchronously)."""
        if call.world == 1:     # a ring of one: the buffers come back as they are (gloo refuses a send to oneself)
            return list(buffers)
        received = [torch.empty_like(b) for b in buffers]
        after = dist.get_global_rank(call.group, (call.rank + 1) % call.world)
        before = dist.get_global_rank(call.group, (call.rank - 1) % call.world)
        ops = [dist.P2POp(dist.isend, b, after, call.group) for b in buffers]
        ops += [dist.P2POp(dist.irecv, b, before, call.group) for b in received]
        self.works += dist.batch_isend_irecv(ops)
        return received

    def gather(self, buffer: torch.Tensor, call: Call) -> tuple[Any, list[torch.Tensor]]:
        """All-gather `buffer` over the group (asynchronously): (its work, every rank's buffer in rank order)."""
        received = [torch.empty_like(buffer) for _ in range(call.world)]
        work = dist.all_gather(received, buffer, group=call.group, async_op=True)
        self.works.append(work)
        return work, received

    def wait(self) -> None:
        works, self.works = self.works, []
        for work in works:
            work.wait()

    drain = wait


def pack(*tensors: torch.Tensor) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def unpack(buffer: torch.Tensor, *likes: torch.Tensor) -> list[torch.Tensor]:
    out, offset = [], 0
    for like in likes:
        out.append(buffer[offset:offset + like.numel()].view(like.shape))
        offset += like.numel()
    return out

