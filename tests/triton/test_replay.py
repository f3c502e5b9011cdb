"""backends/triton/runtime/replay.py (CPU, fake kernels): a recorded method's launches are re-issued with a later call's
tensors in the same roles, and nothing is recorded where a replay could differ from running the method."""

from __future__ import annotations

import dataclasses
import functools
import types
import weakref
from typing import NamedTuple

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("triton")

from test_launch_cache import _FakeKernel, fake_driver, needs_cuda_backend  # noqa: F401 (fake_driver: a fixture)

from flash_attn_ck.backends.triton.runtime import launch, replay
from flash_attn_ck.core.problem import AttentionProblem


class Pair(NamedTuple):
    first: torch.Tensor
    stride: int


def _descriptor(t):
    """A host TMA descriptor over a (b, s, h, d) tensor, as the warp-specialised kernels take them."""
    from flash_attn_ck.backends.triton.gluon.gluon_common import descriptor
    return descriptor(t, False, 16)


def _tensors(n=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(1, 32, 2, 64, generator=g, dtype=torch.bfloat16) for _ in range(n))


@needs_cuda_backend
@pytest.mark.usefixtures("fake_driver")
def test_a_replay_reissues_every_launch_with_the_new_calls_tensors():
    kernel = _FakeKernel([False, False, False, False, True])
    other = _FakeKernel([False, False])

    def method(a, b, c, d):
        launch.launch_kernel(kernel, (3, 2), (a, Pair(b, 7), _descriptor(c), 5, 64), 4, 2)
        launch.launch_kernel(other, (9,), (d, a), 4, 1)

    first = _tensors()
    recorded = replay.record(functools.partial(method, *first), first)
    assert recorded is not None and len(recorded.launches) == 2
    kernel.direct.clear()
    other.direct.clear()
    later = _tensors(seed=1)
    recorded.run(later)
    (run,) = kernel.direct
    assert run[:9] == (3, 2, 1, 1234, "function", "metadata", None, None, None)
    a, pair, desc, five, sixty_four = run[9:]
    assert a is later[0] and isinstance(pair, Pair) and pair.first is later[1] and pair.stride == 7
    assert desc.base is later[2] and desc.block_shape == [16, 1, 64] and (five, sixty_four) == (5, 64)
    (run,) = other.direct
    assert run[:3] == (9, 1, 1) and run[9] is later[3] and run[10] is later[0]
    # a replay copies what it changes, and keeps no tensor of the recorded call alive
    recorded.run(first)
    assert kernel.direct[-1][11].base is first[2] and desc.base is later[2]
    refs = [weakref.ref(t) for t in first]
    del first, run, a, pair, desc
    for fake in (kernel, other):        # what the fakes themselves keep
        fake.direct.clear()
        fake.jit_launches.clear()
    assert all(ref() is None for ref in refs)


@needs_cuda_backend
@pytest.mark.parametrize("why", ["a torch operation", "a tensor from elsewhere", "a launch hook", "a view",
                                 "an allocation no launch takes", "a filled allocation"])
@pytest.mark.usefixtures("fake_driver")
def test_nothing_is_recorded_where_a_replay_could_differ(why):
    from triton import knobs
    kernel = _FakeKernel([False, False])
    tensors = _tensors(2)
    elsewhere = _tensors(1, seed=3)[0]

    def method():
        a, b = tensors
        if why == "a torch operation":
            b.zero_()
        if why == "a tensor from elsewhere":
            b = elsewhere
        if why == "a view":
            b = b[:32]
        if why == "an allocation no launch takes":
            torch.empty(16, dtype=torch.int32)      # e.g. its address passed as an int: a replay could not know
        if why == "a filled allocation":
            b = torch.zeros_like(b)
        launch.launch_kernel(kernel, (1,), (a, b), 4, 1)

    if why == "a launch hook":
        knobs.runtime.launch_enter_hook.add(print)
    try:
        assert replay.record(method, tensors) is None
    finally:
        if why == "a launch hook":
            knobs.runtime.launch_enter_hook.remove(print)
    why = None      # without the reason, the same method records
    assert replay.record(method, tensors) is not None


@needs_cuda_backend
@pytest.mark.usefixtures("fake_driver")
def test_a_scratch_allocation_is_made_afresh_by_every_replay():
    """A tensor the method allocates (torch.empty / empty_like / empty_strided) and a kernel takes, direct or
    through a declared view, is replayed as a fresh tensor of the recorded shape, strides, dtype and device: never
    the recorded one, never one replay's in the next."""
    kernel = _FakeKernel([False, False, False])

    def method(a, b):
        schedule = torch.empty((5, 2), dtype=torch.int32)
        strided = torch.empty_strided((4, 3), (1, 4), dtype=torch.float32)
        like = torch.empty_like(b)
        launch.launch_kernel(kernel, (1,), (schedule, a, strided), 4, 1)
        launch.launch_kernel(kernel, (1,), (launch.derived(like.narrow(2, 1, 1), like), schedule, b), 4, 1)

    first = _tensors(2)
    recorded = replay.record(functools.partial(method, *first), first)
    assert recorded is not None and len(recorded.scratch) == 3
    kernel.direct.clear()
    seen = []
    for seed in (1, 2):
        later = _tensors(2, seed=seed)
        recorded.run(later)
        (schedule, a, strided), (like_head, schedule_again, b) = (run[9:] for run in kernel.direct[-2:])
        assert a is later[0] and b is later[1] and schedule_again is schedule
        assert (schedule.shape, schedule.stride(), schedule.dtype) == ((5, 2), (2, 1), torch.int32)
        assert (strided.shape, strided.stride(), strided.dtype) == ((4, 3), (1, 4), torch.float32)
        assert isinstance(like_head, int) and not isinstance(like_head, torch.Tensor)
        seen.append((schedule, strided))
    assert all(x is not y for x, y in zip(*seen))


@needs_cuda_backend
@pytest.mark.usefixtures("fake_driver")
def test_a_declared_view_is_replayed_at_its_offset_of_the_later_calls_tensor():
    """A view declared with launch.derived (a slice of heads; a slice of that) is re-issued as the address of the same
    offset in the later call's tensor, direct and under a descriptor; the recorded call's memory is not kept."""
    kernel = _FakeKernel([False, False, False])

    def method(a, b):
        head = launch.derived(a.narrow(2, 1, 1), a)
        rows = launch.derived(head.narrow(1, 8, 8), head)
        launch.launch_kernel(kernel, (1,), (head, _descriptor(head), launch.derived(b.narrow(2, 1, 1), b)), 4, 1)
        launch.launch_kernel(kernel, (1,), (rows, b, 7), 4, 1)

    first = _tensors(2)
    recorded = replay.record(functools.partial(method, *first), first)
    assert recorded is not None
    kernel.direct.clear()
    later = _tensors(2, seed=1)
    recorded.run(later)
    (head, desc, b_head), (rows, b, seven) = (run[9:] for run in kernel.direct)
    element = later[0].element_size()
    assert head == later[0].data_ptr() + 64 * element and desc.base.data_ptr() == head
    assert b_head == later[1].data_ptr() + 64 * element and b is later[1] and seven == 7
    assert rows == later[0].data_ptr() + (64 + 8 * 2 * 64) * element
    assert (head, rows) == (later[0][:, :, 1:].data_ptr(), later[0][:, 8:, 1:].data_ptr())     # torch's own offsets
    refs = [weakref.ref(t) for t in first]
    del first
    kernel.direct.clear()
    kernel.jit_launches.clear()
    assert all(ref() is None for ref in refs)


@needs_cuda_backend
@pytest.mark.usefixtures("fake_driver")
def test_a_view_declared_of_an_undeclared_view_is_not_replayed():
    kernel = _FakeKernel([False])
    tensors = _tensors(1)

    def method(declare_source):
        a = tensors[0]
        source = a[:, :16]
        if declare_source:
            launch.derived(source, a)
        launch.launch_kernel(kernel, (1,), (launch.derived(source.narrow(2, 1, 1), source),), 4, 1)

    assert replay.record(functools.partial(method, False), tensors) is None
    assert replay.record(functools.partial(method, True), tensors) is not None


def test_an_argument_of_an_unknown_kind_is_not_replayed():
    """Only scalars, tuples of them, the call's tensors and descriptors over them are known to a replay: anything else
    (which might hold the recorded call's memory) leaves nothing to replay."""
    x = torch.zeros(4)
    assert replay._Args.of((x, 3, (1.5, None, "s")), {id(x): 0}).tensors == ((0, 0),)
    for unknown in ([x], object(), torch.float32):
        with pytest.raises(replay._NotReplayable):
            replay._Args.of((x, unknown), {id(x): 0})


@dataclasses.dataclass(frozen=True)
class _Flags:
    ON: bool = True
    SIZES: tuple = (64, 128)


@dataclasses.dataclass(frozen=True)
class _Aggregate:
    """A constexpr aggregate as the Gluon kernels take them (config.WsTile, launch.GluonCall): fields nested."""
    BLOCK: int = 64
    FLAGS: _Flags = _Flags()
    EXTRA: object = None


@dataclasses.dataclass
class _Mutable:
    BLOCK: int = 64


def test_a_frozen_aggregate_of_scalars_is_a_constant_and_one_holding_anything_else_is_not_replayed():
    """The Gluon kernels take their tile and call as frozen dataclasses: a replay keeps them as recorded, so their
    launches replay; an aggregate that holds a tensor or a list somewhere, or one that can change, is not replayed."""
    x = torch.zeros(4)
    kept = _Aggregate()
    args = replay._Args.of((x, kept, 3), {id(x): 0})
    assert args.template[1] is kept and args.tensors == ((0, 0),)
    for unknown in (_Aggregate(EXTRA=x), _Aggregate(FLAGS=_Flags(SIZES=(64, x))), _Aggregate(EXTRA=[1]), _Mutable()):
        with pytest.raises(replay._NotReplayable):
            replay._Args.of((x, unknown), {id(x): 0})


def test_the_layout_key_holds_shape_strides_and_alignment(monkeypatch):
    monkeypatch.setattr(launch, "current_device_and_stream", lambda: (0, 1234))
    x = torch.zeros(64, 8)
    key = replay.layout_key((x, None))
    assert replay.layout_key((torch.ones(64, 8), None)) == key            # other values, same layout
    for changed in ((x.t(), None),                                       # strides
                    (x[:32], None),                                      # shape
                    (x.view(-1)[1:].view(-1, 1), None),                 # shape, strides and alignment
                    (x.view(-1)[2:506].view(63, 8), None),              # alignment (and shape)
                    (x, x)):                                             # an empty role now filled
        assert replay.layout_key(changed) != key
    y = torch.ones(64, 8)
    assert replay.layout_key((x, x)) != replay.layout_key((x, y))       # one tensor in two roles, or two
    seed = torch.zeros(2, dtype=torch.int64)       # a caller's rng_state: its dtype is not the problem's to fix
    assert replay.layout_key((seed,)) != replay.layout_key((seed.int(),))
    aligned, offset = x.view(-1)[:504].view(63, 8), x.view(-1)[2:506].view(63, 8)
    assert replay.layout_key((aligned,)) != replay.layout_key((offset,))  # the address modulo 16 alone


# ---- the layout key, field by field (hypothesis) ------------------------------------------------------------------

_DTYPES = (torch.float32, torch.bfloat16, torch.int32, torch.int64)


def _laid_out(shape, strides, dtype, misalign):
    """A fresh tensor of `shape`, `strides` and `dtype` whose address is `misalign` bytes past a 16-byte boundary (the
    CPU allocator aligns to 64)."""
    size = torch.empty(0, dtype=dtype).element_size()
    span = 1 + sum((n - 1) * s for n, s in zip(shape, strides))
    storage = torch.zeros(misalign + (span + 4) * size, dtype=torch.uint8)
    return storage[misalign:misalign + (span + 4) * size].view(dtype).as_strided(shape, strides)


@st.composite
def _layouts(draw):
    """Roles: None, a tensor of its own, the tensor of an earlier role (shared), or a twin of an earlier role's tensor
    (another tensor of the same layout: what sharing must be told from)."""
    roles = []
    for _ in range(draw(st.integers(1, 6))):
        kind = draw(st.sampled_from(["none", "own", "own", "shared", "twin"] if roles else ["none", "own", "own"]))
        earlier = [i for i, r in enumerate(roles) if r is not None and r[0] == "own"]
        if kind in ("shared", "twin") and earlier:
            roles.append((kind, draw(st.sampled_from(earlier))))
        elif kind == "none":
            roles.append(None)
        else:
            dtype = draw(st.sampled_from(_DTYPES))
            size = torch.empty(0, dtype=dtype).element_size()
            dims = draw(st.integers(1, 3))
            shape = tuple(draw(st.integers(1, 4)) for _ in range(dims))
            strides = tuple(draw(st.integers(1, 40)) for _ in range(dims))
            misalign = draw(st.sampled_from([m for m in (0, 4, 8, 12) if m % size == 0]))
            roles.append(("own", (shape, strides, dtype, misalign)))
    return roles


def _realise(roles):
    made = []
    for role in roles:
        if role is None:
            made.append(None)
        elif role[0] == "own":
            made.append(_laid_out(*role[1]))
        elif role[0] == "shared":
            made.append(made[role[1]])
        else:
            made.append(_laid_out(*roles[role[1]][1]))
    return tuple(made)


_KEY_FIELDS = ["shape", "strides", "dtype", "alignment", "share", "unshare", "fill an empty role", "empty a role",
               "device", "debug", "instrumentation"]


@pytest.mark.parametrize("field", _KEY_FIELDS)
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(roles=_layouts(), data=st.data())
def test_each_field_of_the_layout_key_changed_alone_changes_it(monkeypatch, field, roles, data):
    """The key of fresh tensors of the same layouts (shape, strides, dtype, address modulo 16, the same roles sharing)
    equals the recorded one; changing one field alone — of one role, the roles' sharing (one tensor in two roles, or
    two equal-looking tensors), an empty role, the device, a debug knob — changes it."""
    from triton import knobs
    monkeypatch.setattr(launch, "current_device_and_stream", lambda: (0, 1234))
    tensors = _realise(roles)
    key = replay.layout_key(tensors)
    assert replay.layout_key(_realise(roles)) == key                     # other tensors, the same layout
    assert replay.layout_key(tensors, 0) == key                         # the caller's device, read once
    if field in ("device", "debug", "instrumentation"):
        # patched for this example only (hypothesis runs every example in one fixture)
        with monkeypatch.context() as m:
            if field == "device":
                assert replay.layout_key(tensors, 1) != key
                m.setattr(launch, "current_device_and_stream", lambda: (1, 1234))
            elif field == "debug":
                m.setattr(knobs.runtime, "debug", not knobs.runtime.debug)
            else:
                m.setattr(knobs.compilation, "instrumentation_mode", "fpsan")
            assert replay.layout_key(tensors) != key
        return
    changed = _ROLE_CHANGES[field](roles, data)
    if changed is not None:      # None: these roles have nothing to change the field of
        assert replay.layout_key(_realise(changed)) != key, (roles, changed)


def _own_roles(roles) -> list[int]:
    return [i for i, r in enumerate(roles) if r is not None and r[0] == "own"]


def _changed_tensor_field(field):
    """One own role's shape, strides, dtype or alignment changed (a role sharing or twinning it follows it: the field
    changes, not the sharing)."""
    def change(roles, data):
        own = _own_roles(roles)
        if not own:
            return None
        i = data.draw(st.sampled_from(own))
        shape, strides, dtype, misalign = roles[i][1]
        size = torch.empty(0, dtype=dtype).element_size()
        if field == "shape":
            shape = (shape[0] + 1, *shape[1:])
        elif field == "strides":
            strides = (*strides[:-1], strides[-1] + 1)
        elif field == "dtype":
            dtype = data.draw(st.sampled_from([d for d in _DTYPES if d != dtype
                                               and misalign % torch.empty(0, dtype=d).element_size() == 0]))
        else:
            misalign = data.draw(st.sampled_from([m for m in (0, 4, 8, 12) if m != misalign and m % size == 0]))
        return [("own", (shape, strides, dtype, misalign)) if j == i else r for j, r in enumerate(roles)]
    return change


def _changed_sharing(kind, other):
    """A role that twins an earlier one made to share it, or the reverse."""
    def change(roles, data):
        candidates = [i for i, r in enumerate(roles) if r is not None and r[0] == kind]
        if not candidates:
            return None
        i = data.draw(st.sampled_from(candidates))
        return [(other, r[1]) if j == i else r for j, r in enumerate(roles)]
    return change


def _filled_role(roles, data):
    empty = [i for i, r in enumerate(roles) if r is None]
    if not empty:
        return None
    i = data.draw(st.sampled_from(empty))
    return [("own", ((2,), (1,), torch.float32, 0)) if j == i else r for j, r in enumerate(roles)]


def _emptied_role(roles, data):
    # a role no later role shares or twins
    free = [i for i in _own_roles(roles) if not any(r is not None and r[0] != "own" and r[1] == i for r in roles)]
    if not free:
        return None
    i = data.draw(st.sampled_from(free))
    return [None if j == i else r for j, r in enumerate(roles)]


_ROLE_CHANGES = {
    **{field: _changed_tensor_field(field) for field in ("shape", "strides", "dtype", "alignment")},
    "share": _changed_sharing("twin", "shared"),
    "unshare": _changed_sharing("shared", "twin"),
    "fill an empty role": _filled_role,
    "empty a role": _emptied_role,
}


def test_a_tensor_in_two_roles_is_told_from_two_equal_looking_tensors(monkeypatch):
    monkeypatch.setattr(launch, "current_device_and_stream", lambda: (0, 1234))
    cu, twin = torch.arange(4, dtype=torch.int32), torch.arange(4, dtype=torch.int32)
    shared = replay.layout_key((cu, cu, None))
    assert replay.layout_key((cu, twin, None)) != shared
    assert replay.layout_key((twin, twin, None)) == shared
    assert replay.layout_key((cu, None, cu)) != replay.layout_key((cu, None, twin)) != shared


# ---- a replay's arguments, whatever their nesting (hypothesis) ---------------------------------------------------

class Trio(NamedTuple):
    a: object
    b: object
    c: object


class Single(NamedTuple):
    only: object


@st.composite
def _argument_specs(draw, depth=0):
    """An argument: a constant, a role's tensor, a declared view of one (a head), a TMA descriptor over one (or over a
    declared view), or — above depth 2 — a plain tuple, a named tuple of one or three, of such arguments."""
    kinds = ["int", "float", "tensor", "view", "descriptor", "view descriptor"]
    if depth < 2:
        kinds += ["tuple", "trio", "single"]
    kind = draw(st.sampled_from(kinds))
    if kind == "int":
        return ("int", draw(st.integers(-3, 70)))
    if kind == "float":
        return ("float", draw(st.floats(-2.0, 2.0, allow_nan=False)))
    if kind in ("tensor", "view", "descriptor", "view descriptor"):
        return (kind, draw(st.integers(0, 3)))
    if kind == "tuple":
        return ("tuple", tuple(draw(st.lists(_argument_specs(depth + 1), max_size=3))))
    return (kind, tuple(draw(_argument_specs(depth + 1)) for _ in range(3 if kind == "trio" else 1)))


def _build(spec, tensors, declare=True):
    """The argument `spec` stands for over `tensors` (declare: its views declared with launch.derived)."""
    kind, value = spec
    if kind in ("int", "float"):
        return value
    if kind == "tensor":
        return tensors[value]
    if kind in ("view", "view descriptor"):
        t = tensors[value]
        view = t.narrow(2, 1, 1)
        view = launch.derived(view, t) if declare else view
        return view if kind == "view" else _descriptor(view)
    if kind == "descriptor":
        return _descriptor(tensors[value])
    inner = [_build(x, tensors, declare) for x in value]
    return tuple(inner) if kind == "tuple" else (Trio if kind == "trio" else Single)(*inner)


def _same_argument(got, want):
    """A replayed argument against what the method passes the kernel with the later call's tensors: the same tensor;
    a view's address; a descriptor of the same box over the same memory; tuples of the same type, element-wise."""
    if isinstance(want, torch.Tensor) and want._base is not None:        # a declared view: replayed as its address
        return isinstance(got, int) and not isinstance(got, torch.Tensor) and got == want.data_ptr()
    if isinstance(want, torch.Tensor):
        return got is want
    if hasattr(want, "block_shape"):
        mine, theirs = dict(vars(got)), dict(vars(want))
        base, want_base = mine.pop("base"), theirs.pop("base")
        return mine == theirs and base.data_ptr() == want_base.data_ptr()
    if isinstance(want, tuple):
        return type(got) is type(want) and len(got) == len(want) and all(map(_same_argument, got, want))
    return type(got) is type(want) and got == want


@needs_cuda_backend
@pytest.mark.usefixtures("fake_driver")
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(specs=st.lists(_argument_specs(), min_size=1, max_size=5), second=st.lists(_argument_specs(), max_size=3))
def test_a_replay_passes_what_the_method_would_whatever_the_nesting(specs, second):
    """Arguments of any nesting (tuples and named tuples in tuples, one-element ones, empty ones) holding the call's
    tensors, declared views and descriptors over either, in two launches: a replay with later tensors passes each
    kernel what the method passes it with those tensors."""
    kernels = [_FakeKernel([False] * len(x)) for x in (specs, second)]

    def method(tensors):
        for kernel, spec in zip(kernels, (specs, second)):
            if spec:
                launch.launch_kernel(kernel, (2, 3), tuple(_build(x, tensors) for x in spec), 4, 1)

    first = _tensors()
    recorded = replay.record(functools.partial(method, first), first)
    assert recorded is not None
    later = _tensors(seed=1)
    for kernel in kernels:
        kernel.direct.clear()
    recorded.run(later)
    for kernel, spec in zip(kernels, (specs, second)):
        if not spec:
            continue
        (run,) = kernel.direct
        assert run[:9] == (2, 3, 1, 1234, "function", "metadata", None, None, None)
        want = tuple(_build(x, later, declare=False) for x in spec)
        assert len(run[9:]) == len(want) and all(map(_same_argument, run[9:], want)), (spec, run[9:])


@needs_cuda_backend
def test_the_entry_points_read_the_device_and_stream_once_and_key_on_the_device(monkeypatch):
    """`_replayed` on a CUDA-looking call (Tensor.is_cuda patched): records on a layout's first call, replays later
    ones on the stream it read with the device of the key (one read per call), records anew on another device or
    layout, runs the method every call where the layout cannot be replayed."""
    import triton.runtime as runtime

    from flash_attn_ck.backends.triton import backend as triton_backend
    state = dict(device=0, stream=1234, reads=0)

    def current_device():
        state["reads"] += 1
        return state["device"]
    monkeypatch.setattr(runtime, "driver", types.SimpleNamespace(active=types.SimpleNamespace(
        get_current_device=current_device, get_current_stream=lambda device: state["stream"] + device)))
    monkeypatch.setattr(launch, "_KERNELS", {})
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    kernel = _FakeKernel([False, False, False, False])
    kernel.device_caches[1] = kernel.device_caches[0]
    runs = []

    class Backend:
        @triton_backend._replayed
        def forward(self, p, params, out, lse):
            runs.append(out)
            if out.dtype == torch.float64:       # not replayable: a torch operation
                out.add_(1)
            launch.launch_kernel(kernel, (1,), (params.q, out, lse, 3), 4, 1)

    problem = types.SimpleNamespace(memo={})
    problem.remember = functools.partial(AttentionProblem.remember, problem)
    backend = Backend()

    def call(out=None, seed=0):
        q, out_, lse = _tensors(3, seed=seed)
        params = types.SimpleNamespace(q=q, k=None, v=None, cu_seqlens_q=None, cu_seqlens_k=None,
                                       alibi_slopes=None, rng_state=None, learnable_sink=None)
        out = out_ if out is None else out
        state["reads"] = 0
        backend.forward(problem, params, out, lse)
        return q, out, lse

    call()
    assert len(runs) == 1
    kernel.direct.clear()
    q, out, lse = call(seed=1)                          # replayed: the method does not run
    assert len(runs) == 1 and state["reads"] == 1
    assert kernel.direct == [(1, 1, 1, 1234, "function", "metadata", None, None, None, q, out, lse, 3)]
    state.update(device=1)                              # another device: recorded anew, then replayed on its stream
    call(seed=2)
    assert len(runs) == 2
    q, out, lse = call(seed=3)
    assert len(runs) == 2 and state["reads"] == 1 and kernel.direct[-1][3] == 1235
    double = torch.zeros(1, 32, 2, 64, dtype=torch.float64)     # another layout, which cannot be replayed
    for _ in range(3):
        call(out=double)
    assert len(runs) == 5 and [None in x.values() for x in problem.memo.values()] == [True]


def test_the_backends_entry_points_run_the_method_off_the_gpu(monkeypatch):
    """On CPU tensors (and interpreted) nothing is recorded: the wrapped method runs every time."""
    from flash_attn_ck.backends.triton import backend as triton_backend
    calls = []

    class Backend:
        @triton_backend._replayed
        def forward(self, p, params, out, lse):
            calls.append((out, lse))

    problem = types.SimpleNamespace(device=torch.device("cuda"), memo={})      # a CUDA problem, CPU tensors
    params = types.SimpleNamespace(q=torch.zeros(1), k=None, v=None, cu_seqlens_q=None, cu_seqlens_k=None,
                                   alibi_slopes=None, rng_state=None)
    for _ in range(3):
        Backend().forward(problem, params, 1, 2)
    assert calls == [(1, 2)] * 3 and not problem.memo


@needs_cuda_backend
@pytest.mark.usefixtures("fake_driver")
def test_run_through_records_once_then_replays_and_empties_a_full_store():
    kernel = _FakeKernel([False, False])
    runs = []

    def method(a, b):
        runs.append(1)
        launch.launch_kernel(kernel, (1,), (a, b), 4, 1)

    store = {}
    first, later = _tensors(2), _tensors(2, seed=1)
    replay.run_through(store, ("k",), functools.partial(method, *first), first, capacity=2)
    replay.run_through(store, ("k",), functools.partial(method, *later), later, capacity=2)
    assert len(runs) == 1 and kernel.direct[-1][9] is later[0]       # recorded once, then replayed
    store[("none",)] = None                                             # a layout that does not replay: runs
    replay.run_through(store, ("none",), functools.partial(method, *later), later, capacity=2)
    assert len(runs) == 2
    replay.run_through(store, ("new",), functools.partial(method, *later), later, capacity=2)
    assert set(store) == {("new",)} and len(runs) == 3                 # full: emptied, then the new key recorded
