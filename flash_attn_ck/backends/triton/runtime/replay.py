"""Replay: a call signature's kernel launches re-issued with only the call's tensors changed.

A small call is host-bound (docs/host-path.md): deciding its kernels, building their launch specs and Triton's
specialisation key of 20-40 arguments cost more host time than the launches themselves. For a given problem
(one per call signature: shapes, strides, dtypes, devices, every option) and a given layout of the call's tensors
(each one's shape, strides and 16-byte alignment of its address), everything a backend method launches is fixed
except which tensors it reads and writes. So the first call of a (backend, method, problem, layout) runs the
method as always while recording what it launches (`record`), and later calls re-issue those launches through
the compiled kernels' launchers with their own tensors in the same roles (`Replay.run`).

Recording keeps a replay only when the method did nothing but make views, allocate scratch tensors and launch
compiled kernels whose every tensor, direct, inside an argument tuple or under a TMA descriptor, is one of the
call's tensors, a scratch tensor or a view of either that the method declared (`launch.derived`: a slice of heads,
a prefix, whose offset follows from the layout): any other torch operation during the method (a copy, a fill, a
sort: seen by a dispatch mode), a launch through Triton's own path (a profiler hook, the interpreter), a tensor
from anywhere else, an undeclared view, or a scratch tensor that no launch takes as a tensor leaves nothing to
replay, and every call of that layout runs the method. A declared view is re-issued as an address, the later
call's tensor in its source's role plus the recorded byte offset: its shape and strides are fixed by the layout,
and the kernels take those as recorded constants. A scratch tensor (`torch.empty`, `empty_like`, `empty_strided`:
uninitialised memory, which the method's kernels write before they read it, e.g. a varlen call's tile schedule)
is allocated afresh by every replay with the recorded shape, strides, dtype and device, as the method would. A
replay launches on the current stream of the current device, which its key holds.
"""

from __future__ import annotations

import collections
import functools
import operator
from dataclasses import dataclass, fields, is_dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from . import launch

# Operations that only allocate: their tensors' contents are undefined, so a fresh allocation serves a replay.
_ALLOCATIONS = frozenset({torch.ops.aten.empty.memory_format, torch.ops.aten.empty_like.default,
                          torch.ops.aten.empty_strided.default})


class _AnyOperation(TorchDispatchMode):
    """Notes whether any torch operation other than a view or an allocation ran (on any tensor) while it was active
    (`seen`), and keeps the tensors allocated (`allocated`): views read no memory and write none (one that reaches a
    kernel must have been declared: `_Args.of` checks); an allocation's tensor must reach a kernel (`record`
    checks)."""

    def __init__(self):
        super().__init__()
        self.seen = False
        self.allocated: list[torch.Tensor] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        if func in _ALLOCATIONS:
            self.allocated.append(result)
        elif not func.is_view:
            self.seen = True
        return result


def layout_key(tensors: tuple[torch.Tensor | None, ...], device: int | None = None) -> tuple:
    """What decides a recorded launch besides the problem: each tensor's shape, strides, dtype (the problem fixes
    most roles' dtypes, not every caller-given one's) and address modulo 16 (TMA descriptors and Triton's pointer
    specialisation) and the first role the same tensor holds (self-attention's
    shared cu_seqlens: a replay puts the tensor of that role in each), None where a role is empty; the current
    device (`device` where the caller has read it, with the stream it replays on: `launch.current_device_and_stream`)
    and Triton's debug knobs (launch_kernel's key holds them too)."""
    knobs = (launch._TRITON or launch._triton())[0]
    first_role: dict[int, int] = {}
    return (launch.current_device_and_stream()[0] if device is None else device, knobs.runtime.debug,
            knobs.compilation.instrumentation_mode,
            *[None if t is None else (t.shape, t.stride(), t.dtype, t.data_ptr() % 16,
                                      first_role.setdefault(id(t), role))
              for role, t in enumerate(tensors)])


def record(method, tensors: tuple[torch.Tensor | None, ...]) -> Replay | None:
    """Run `method()` (whose launches read and write `tensors`) and return its replay, or None when it cannot be
    replayed (module docstring)."""
    launches: list[Any] = []
    views: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    launch._RECORDING.launches, launch._RECORDING.views = launches, views
    watch = _AnyOperation()
    try:
        with watch:
            method()
    finally:
        launch._RECORDING.launches = launch._RECORDING.views = None
    if watch.seen or any(x is None for x in launches):
        return None
    roles: dict[Any, Any] = {}     # id of a tensor, or of an allocation (_allocation) -> its role
    for role, t in enumerate(tensors):
        if t is not None:
            roles.setdefault(id(t), role)     # a tensor in several roles: its first (the key holds which roles share)
    scratch = tuple((t.shape, t.stride(), t.dtype, t.device) for t in watch.allocated)
    for role, t in enumerate(watch.allocated, start=len(tensors)):      # a replay appends fresh ones to its tensors
        roles[_allocation(t)] = role
    for key, (view, source) in views.items():
        if key not in roles:
            roles[key] = _view_role(view, source, roles, views)
    try:
        recorded = tuple(_Launch.of(compiled, grid, args, roles) for compiled, grid, args in launches)
    except _NotReplayable:
        return None
    taken = {role if isinstance(role, int) else role[0] for x in recorded for role in x.args.roles()}
    if not taken.issuperset(range(len(tensors), len(tensors) + len(scratch))):
        return None     # a scratch tensor no launch takes: what the method did with it is not known
    return Replay(recorded, scratch)


def run_through(store: dict, key: tuple, method, tensors: tuple[torch.Tensor | None, ...], capacity: int,
                stream: int | None = None) -> None:
    """`method()` through `store`'s replay of `key`: replayed once recorded (on `stream`, Replay.run), recorded on the
    key's first call (`store` is emptied first when it holds `capacity` keys), run as is where it cannot be replayed."""
    found = store.get(key, _UNSEEN)
    if found is _UNSEEN:
        if len(store) >= capacity:
            store.clear()
        store[key] = record(method, tensors)
    elif found is None:
        method()
    else:
        found.run(tensors, stream)


_UNSEEN = object()


class _NotReplayable(Exception):
    pass


# Arguments a replay keeps as recorded (besides tuples of them, the call's tensors and TMA descriptors over them).
_CONSTANT_TYPES = (bool, int, float, str, type(None))


def _constant(value: Any) -> bool:
    """Whether a replay may keep `value` as recorded: a scalar, or a frozen dataclass (the Gluon kernels' constexpr
    tile and call aggregates) whose fields are scalars, tuples of them or such dataclasses in turn."""
    if isinstance(value, _CONSTANT_TYPES):
        return True
    if isinstance(value, tuple):
        return all(map(_constant, value))
    params = getattr(type(value), "__dataclass_params__", None)     # a dataclass's; an instance's class, not a class's
    if is_dataclass(value) and params is not None and params.frozen:
        return all(_constant(getattr(value, field.name)) for field in fields(value))
    return False


@dataclass(frozen=True)
class _Launch:
    """One recorded launch: the compiled kernel, its grid, its arguments with the call's tensors taken out (`args`,
    nested tuples included) and how `fill` puts a later call's tensors back, flattened over the nested tuples:
    `gather` (an itemgetter, in C) picks the arguments from `sources`, every constant of the arguments and of their
    nested tuples (`constants`) followed by the call's tensors (the tensor of role r at len(constants) + r); `steps`
    are the values computed per call first, each written into `sources` at its slot, in order (a nested tuple after
    the tuples it holds): `(slot, _NESTED, gather, make)` a nested tuple (`make`: its named tuple's constructor, None
    for a plain tuple), `(slot, _VIEW, role, byte offset)` a declared view's address, `(slot, _DESCRIPTOR, role,
    recorded descriptor)` a TMA descriptor over the role's tensor (or view)."""
    compiled: Any
    grid: tuple[int, int, int]
    args: _Args
    constants: tuple
    steps: tuple[tuple, ...]
    gather: Any

    @staticmethod
    def of(compiled, grid, args, roles) -> _Launch:
        grid = tuple(grid) + (1,) * (3 - len(grid))
        structure = _Args.of(tuple(args), roles)
        constants: list[Any] = []
        flat: list[tuple] = []
        top = _flatten(structure, constants, flat)
        index = functools.partial(_index, len(constants))
        steps = tuple((slot, kind, _gatherer(list(map(index, a))), b) if kind is _NESTED else (slot, kind, a, b)
                      for slot, kind, a, b in flat)
        return _Launch(compiled, grid, structure, tuple(constants), steps, _gatherer(list(map(index, top))))

    def fill(self, tensors: tuple) -> tuple:
        """The arguments with `tensors` (a tuple: a call's tensors by role, then the replay's scratch tensors) in their
        roles."""
        if not self.steps:
            return self.gather(self.constants + tensors)
        sources = [*self.constants, *tensors]
        for slot, kind, a, b in self.steps:
            if kind is _NESTED:
                sources[slot] = a(sources) if b is None else b(a(sources))
            elif kind is _VIEW:
                sources[slot] = _Address(tensors[a].data_ptr() + b)
            else:
                sources[slot] = _with_base(b, _at(tensors, a))
        return self.gather(sources)


_NESTED, _VIEW, _DESCRIPTOR = "nested", "view", "descriptor"


def _flatten(args: _Args, constants: list, steps: list) -> list[tuple[bool, int]]:
    """Append `args`' template to `constants` and what `args` computes per call to `steps` (its nested tuples' steps
    first, so that each is computed before the tuple holding it is gathered); return where each of its arguments
    comes from: `(False, slot)`, the slot of `sources` below len(constants) (a constant, or a value a step writes
    there), or `(True, role)`, the call's tensor of that role."""
    base = len(constants)
    constants.extend(args.template)
    sources = [(False, base + position) for position in range(len(args.template))]
    for position, role in args.tensors:
        if isinstance(role, int):
            sources[position] = (True, role)
        else:
            steps.append((base + position, _VIEW, *role))
    for position, inner in args.nested:
        inner_sources = _flatten(inner, constants, steps)
        steps.append((base + position, _NESTED, inner_sources, inner.make))
    for position, role in args.descriptors:
        steps.append((base + position, _DESCRIPTOR, role, args.template[position]))
    return sources


def _index(constants: int, source: tuple[bool, int]) -> int:
    tensor, at = source
    return constants + at if tensor else at


@dataclass(frozen=True)
class _Args:
    """Arguments with the call's tensors taken out (`template`), and where they go back: `tensors` ((position, role)),
    `nested` ((position, _Args) for argument tuples holding tensors) and `descriptors` ((position, role) of TMA
    descriptors over a role's tensor); a role is an int, or `(role, byte offset)` of a declared view. `make` rebuilds
    the tuple (a named tuple's constructor; None: a plain tuple)."""
    template: tuple
    make: Any
    tensors: tuple[tuple[int, int | tuple[int, int]], ...]
    nested: tuple[tuple[int, _Args], ...]
    descriptors: tuple[tuple[int, int | tuple[int, int]], ...]

    @staticmethod
    def of(args: tuple, roles: dict[int, int]) -> _Args:
        """The template keeps no tensor of the recorded call (it would keep that call's memory alive)."""
        template, tensors, nested, descriptors = list(args), [], [], []
        for position, value in enumerate(args):
            if isinstance(value, torch.Tensor):
                tensors.append((position, _role(value, roles)))
                template[position] = None
            elif isinstance(value, tuple):
                inner = _Args.of(value, roles)
                if inner.tensors or inner.nested or inner.descriptors:
                    nested.append((position, inner))
                    template[position] = None
            elif hasattr(value, "base") and hasattr(value, "block_shape"):      # a host TMA descriptor
                descriptors.append((position, _role(value.base, roles)))
                template[position] = _with_base(value, None)
            elif not _constant(value):
                raise _NotReplayable    # what it holds cannot be told apart from a constant: never replayed
        make = _maker(type(args)) if hasattr(args, "_fields") else None
        return _Args(tuple(template), make, tuple(tensors), tuple(nested), tuple(descriptors))

    def roles(self):
        """Every role this launch's arguments take a tensor from (int, or (role, byte offset) of a declared view)."""
        yield from (role for _, role in self.tensors)
        yield from (role for _, role in self.descriptors)
        for _, inner in self.nested:
            yield from inner.roles()


def _maker(named: Any):
    """What rebuilds a named tuple of `named` from a tuple of its fields: `tuple.__new__(named, fields)` (in C), which
    is what a named tuple's own `_make` does before it checks the length (`_Launch.fill` gathers exactly the recorded
    fields); the class's `_make` where it has another."""
    if getattr(named._make, "__code__", None) is _NAMEDTUPLE_MAKE:
        return functools.partial(tuple.__new__, named)
    return named._make


_NAMEDTUPLE_MAKE = collections.namedtuple("_", "")._make.__code__  # type: ignore[attr-defined]


def _gatherer(indices: list[int]):
    """`sources -> tuple(sources[i] for i in indices)`, in C where there are several (an itemgetter of one index
    returns the item itself)."""
    if len(indices) > 1:
        return operator.itemgetter(*indices)
    return (lambda sources: (sources[indices[0]],)) if indices else (lambda sources: ())


def _with_base(descriptor, base):
    """A copy of a host TMA descriptor over `base`. Its shape, strides and box follow from the layout, which a
    replay's key fixes, so the checks its constructor ran when it was recorded hold again: they are not re-run."""
    copy = object.__new__(type(descriptor))
    vars(copy).update(vars(descriptor), base=base)
    return copy


def _allocation(t: torch.Tensor) -> tuple:
    """What identifies a tensor the method allocated: the dispatch mode sees another Python object than the method
    gets, over the same memory (kept alive while recording, so no other tensor of the method has its address)."""
    return ("allocated", t.data_ptr(), t.shape, t.stride(), t.dtype, t.device)


def _role_of(t: torch.Tensor, roles: dict):
    role = roles.get(id(t))
    return roles.get(_allocation(t)) if role is None else role


def _role(t: torch.Tensor, roles: dict) -> int | tuple[int, int]:
    """A call's or scratch tensor's role, or `(role, byte offset)` of a declared view of one."""
    role = _role_of(t, roles)
    if role is None:
        raise _NotReplayable       # a tensor from anywhere else
    return role


def _view_role(view: torch.Tensor, source: torch.Tensor, roles: dict, views: dict) -> tuple[int, int] | None:
    """`(role, byte offset)` of a declared view whose source is a call's tensor or, in turn, a declared view of one;
    None (a tensor of the method's own, in `_role`'s eyes: not replayable if a kernel reads it) otherwise."""
    role = _role_of(source, roles)
    if role is None and id(source) in views:
        role = _view_role(source, views[id(source)][1], roles, views)
    if role is None:
        return None
    base, offset = (role, 0) if isinstance(role, int) else role
    return base, offset + view.data_ptr() - source.data_ptr()


class _Address(int):
    """A device address where a tensor stood: Triton's launcher takes an int for a pointer argument and reads a
    descriptor's base through `data_ptr()`."""

    def data_ptr(self) -> int:
        return int(self)


def _at(tensors, role: int | tuple[int, int]):
    """What a replay passes for a recorded role: the call's tensor, or the address of a declared view of it."""
    if isinstance(role, int):
        return tensors[role]
    base, offset = role
    return _Address(tensors[base].data_ptr() + offset)


@dataclass(frozen=True)
class Replay:
    """A method's recorded launches, re-issued in order on the current stream with a call's tensors and fresh scratch
    tensors (`scratch`: shape, strides, dtype, device of each the method allocated, in order)."""
    launches: tuple[_Launch, ...]
    scratch: tuple[tuple, ...] = ()

    def run(self, tensors: tuple[torch.Tensor | None, ...], stream: int | None = None) -> None:
        """Re-issue the launches with `tensors` in their roles on `stream` (None: the current device's current
        stream, `launch.current_device_and_stream`; a caller that has read both for the key passes its stream)."""
        if stream is None:
            stream = launch.current_device_and_stream()[1]
        if self.scratch:
            tensors = (*tensors, *(torch.empty_strided(shape, strides, dtype=dtype, device=device)
                                   for shape, strides, dtype, device in self.scratch))
        for recorded in self.launches:
            c = recorded.compiled
            c.run(*recorded.grid, stream, c.function, c.packed_metadata, None, None, None, *recorded.fill(tensors))
