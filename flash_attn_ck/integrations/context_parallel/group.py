"""What a context-parallel call runs over: a ProcessGroup, a DeviceMesh (1-D, or the hybrid's 2-D), or None (the
default group)."""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ...core.errors import ArgumentError


def is_mesh(mesh_or_group) -> bool:
    """A DeviceMesh, not a ProcessGroup: by type, since under torch.compile a ProcessGroup is an opaque object whose
    unregistered attributes (even `hasattr`) raise."""
    return isinstance(mesh_or_group, DeviceMesh)


def is_mesh_2d(mesh) -> bool:
    return is_mesh(mesh) and mesh.ndim == 2


def process_group(mesh_or_group=None) -> dist.ProcessGroup:
    """A ProcessGroup from a 1-D DeviceMesh, a ProcessGroup, or None (the default group)."""
    if mesh_or_group is None:
        world = dist.group.WORLD
        if world is None:
            raise ArgumentError("group: None means the default process group, which is not initialised "
                                "(torch.distributed.init_process_group)")
        return world
    if is_mesh(mesh_or_group):
        if mesh_or_group.ndim != 1:
            raise ArgumentError(f"mesh: expected a 1-D DeviceMesh (the context-parallel dimension), got "
                                f"{mesh_or_group.ndim} dimensions; pass mesh['cp'] or its process group")
        return mesh_or_group.get_group()
    if not isinstance(mesh_or_group, dist.ProcessGroup):
        raise ArgumentError(f"group: expected a torch.distributed ProcessGroup, a 1-D DeviceMesh or None, got "
                            f"{type(mesh_or_group).__name__}")
    return mesh_or_group


def size_rank(group) -> tuple[int, int]:
    return dist.get_world_size(group), dist.get_rank(group)

