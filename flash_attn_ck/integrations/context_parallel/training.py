"""Training: parameter gradients over the context-parallel group.

Each rank's loss is its share of the global mean (a partial sum: `hf.shard_for_causal_lm`), so the true gradient
is the SUM of the ranks' gradients over the context-parallel group; DDP's default hook averages them instead
(at world W, 1 / W of the true gradient). torchtitan and FSDP get the same result by the other convention (a
per-rank mean loss, gradients averaged)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ...core.errors import ArgumentError
from .group import process_group
from .transfers import unpack


def sum_gradients(parameters, mesh_or_group=None) -> None:
    """All-reduce (sum) the `.grad` of `parameters` (an iterable, e.g. `model.parameters()`) over the
    context-parallel group: the gradients of the global loss, for training without DDP. One collective per dtype
    and device."""
    group = process_group(mesh_or_group)
    grads = [p.grad for p in parameters if p.grad is not None]
    for kind in {(g.dtype, g.device) for g in grads}:
        same = [g for g in grads if (g.dtype, g.device) == kind]
        flat = torch.cat([g.reshape(-1) for g in same])
        dist.all_reduce(flat, group=group)
        for grad, summed in zip(same, unpack(flat, *same), strict=True):
            grad.copy_(summed)


@dataclass(frozen=True)
class _CPHookState:
    group: Any          # DDP's process group
    replicas: int       # data-parallel replicas in it: DDP's world / the CP world


def _sum_over_cp_hook(state: _CPHookState, bucket):     # no return annotation: DDP refuses a string one
    """DDP's allreduce, divided by the data-parallel replicas instead of DDP's world: summed over the CP ranks."""
    buffer = bucket.buffer().div_(state.replicas)
    work = dist.all_reduce(buffer, group=state.group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def register_cp_comm_hook(ddp_model, mesh_or_group=None) -> None:
    """Make a DistributedDataParallel model sum its gradients over the context-parallel group (`mesh_or_group`)
    and average them over data-parallel replicas: DDP's group is the CP group (pure CP) or holds whole CP groups
    (data x context parallel), and each rank's loss is its share of its replica's mean."""
    ddp_world = dist.get_world_size(ddp_model.process_group)
    cp_world = dist.get_world_size(process_group(mesh_or_group))
    if ddp_world % cp_world:
        raise ArgumentError(f"DDP's group of {ddp_world} ranks does not hold whole context-parallel groups of "
                            f"{cp_world}")
    ddp_model.register_comm_hook(_CPHookState(ddp_model.process_group, ddp_world // cp_world), _sum_over_cp_hook)

