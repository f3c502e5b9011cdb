"""A CPU emulation of CK's fmha kernels behind the C ABI of csrc_ck/include/flash_attn_ck.h.

`EmulatedCkLibrary` stands where `ctypes.CDLL("libflash_attn_ck.so")` stands: it has the same
`fack_*` entry points, takes the same ctypes structs by reference (the bytes the backend built,
re-read through the header's layout) and answers with the same status codes and messages. Behind
`fack_fwd` / `fack_bwd` it executes CK's kernel contract from the struct alone:

* memory is reached only through the struct's pointers and element strides, each access checked
  against the allocation (a torch storage) the test registered in `Memory`: a pointer outside every
  allocation, or an access running past the allocation its pointer is in, raises `OutOfBounds`;
* the grids of CK's host API (fmha_bwd.hpp, fmha_fwd.hpp): dq_dk_dv launches
  `ceil(max_seqlen_k / kN0) x nhead_q x batch` blocks, dot_do_o and convert_dq
  `ceil(max_seqlen_q / 64) x nhead_q x batch`, the forward `ceil(max_seqlen_q / kM0) x nhead_q x batch`;
  a grid dimension of 0 is an invalid launch (CK's hip_check_error throws, FACK_LAUNCH_ERROR);
* the kernels' own early returns (fmha_bwd_kernel.hpp): group mode reads each sequence's lengths
  from seqstart; dq_dk_dv returns when `seqlen_q == 0 || seqlen_k == 0` (before its dK/dV epilogue)
  and for key tiles at or past the sequence's `seqlen_k`; dot_do_o / convert_dq / the forward return
  for query tiles past `seqlen_q`; nothing else is written;
* CK's mask from `mask_type` / `window_size_left/right` rebuilt per sequence (generic (y, x)
  coordinates, docs/semantics.md §Masks), ALiBi in the mode ck_tile picks from the mask (`_alibi_position`)
  read through the slopes pointer and batch stride, the scale, lse = -inf for rows with no key in the forward;
* the backward pipeline: dot_do_o writes `D = p_undrop * rowsum(dO * O)`; dq_dk_dv writes dK/dV per
  query head (reading k/v of head `h / (nhead_q / nhead_k)`), adds dQ into dq_acc split 0, or into
  split `i_tile_n` (one per key tile of kN0 rows) when deterministic; convert_dq sums
  `ceil(seqlen_k / kN0)` splits (group mode: the sequence's own seqlen_k) and casts;
* dropout with CK's D scaling and `rp_undrop`, but with the reference keep pattern
  (flash_attn_ck/core/dropout.py), read at the seed/offset *pointers*: CK's own Philox layout is not
  emulated, so the pattern is not CK's (refused with `dropout=False`).

Arithmetic is fp32 from the stored dtype (CK rounds P and dS to the input dtype before two of its
GEMMs; the emulation does not), so results are compared with the oracle under the 2x rule, not
bitwise with an MI300.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from flash_attn_ck.backends.ck import backend as ck
from flash_attn_ck.core.dropout import keep_mask

DTYPES = {0: torch.float16, 1: torch.bfloat16}
FACK_OK, FACK_INVALID_ARGUMENT, FACK_NO_INSTANCE, FACK_INTERNAL_ERROR, FACK_LAUNCH_ERROR = 0, 1, 2, 4, 5
M0_1D = 64          # dot_do_o / convert_dq query tile (CK's M0_1D)
FWD_M0 = 128        # forward query tile of the gfx9 instances


class OutOfBounds(RuntimeError):
    """An access outside the allocation its pointer lies in (or a pointer in no allocation)."""


@dataclass
class Allocation:
    start: int
    nbytes: int
    data: torch.Tensor          # uint8 view of the whole storage


@dataclass
class Memory:
    """The allocations a launch may touch: whole torch storages, registered by the test."""
    allocations: list[Allocation] = field(default_factory=list)
    log: list[str] = field(default_factory=list)

    def register(self, t: torch.Tensor | None) -> None:
        if t is None or not isinstance(t, torch.Tensor) or t.device.type != "cpu":
            return
        storage = t.untyped_storage()
        start, nbytes = storage.data_ptr(), storage.nbytes()
        if nbytes == 0 or any(a.start == start and a.nbytes == nbytes for a in self.allocations):
            return
        data = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (nbytes,), (1,))
        self.allocations = [a for a in self.allocations if a.start != start]
        self.allocations.append(Allocation(start, nbytes, data))

    def _find(self, name: str, ptr: int) -> Allocation:
        for a in self.allocations:
            if a.start <= ptr < a.start + a.nbytes:
                return a
        raise OutOfBounds(f"{name}: pointer {ptr:#x} lies in no registered allocation")

    def _index(self, name: str, ptr: int, dtype: torch.dtype, offsets: torch.Tensor):
        if not ptr:
            raise OutOfBounds(f"{name}: NULL pointer dereferenced")
        alloc = self._find(name, ptr)
        size = torch.empty((), dtype=dtype).element_size()
        if (ptr - alloc.start) % size:
            raise OutOfBounds(f"{name}: pointer {ptr:#x} is not aligned to {size} bytes")
        index = (ptr - alloc.start) // size + offsets.to(torch.int64)
        if index.numel():
            low, high = int(index.min()), int(index.max())
            if low < 0 or (high + 1) * size > alloc.nbytes:
                raise OutOfBounds(f"{name}: elements {low}..{high} of {dtype} past the allocation of "
                                  f"{alloc.nbytes} bytes at {alloc.start:#x}")
        usable = alloc.nbytes // size * size
        return alloc.data[:usable].view(dtype), index

    def read(self, name: str, ptr: int, dtype: torch.dtype, offsets: torch.Tensor) -> torch.Tensor:
        view, index = self._index(name, ptr, dtype, offsets)
        return view[index]

    def write(self, name: str, ptr: int, dtype: torch.dtype, offsets: torch.Tensor, values: torch.Tensor) -> None:
        view, index = self._index(name, ptr, dtype, offsets)
        view[index] = values.to(dtype)
        self.log.append(name)

    def add(self, name: str, ptr: int, dtype: torch.dtype, offsets: torch.Tensor, values: torch.Tensor) -> None:
        view, index = self._index(name, ptr, dtype, offsets)
        view.index_put_((index.reshape(-1),), values.to(dtype).reshape(-1), accumulate=True)
        self.log.append(name)


class TrackAllocations(TorchDispatchMode):
    """Registers the storage of every tensor an aten op returns (for tensors a backend makes itself)."""

    def __init__(self, memory: Memory):
        super().__init__()
        self.memory = memory

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        for t in tree_leaves(result):
            if isinstance(t, torch.Tensor):
                self.memory.register(t)
        return result


class LaunchError(RuntimeError):
    """What CK's launch_kernel throws after hipGetLastError() (the glue maps it to FACK_LAUNCH_ERROR)."""


def _grid(name: str, x: int, y: int, z: int) -> None:
    if x <= 0 or y <= 0 or z <= 0:
        raise LaunchError(f"HIP runtime error: invalid configuration argument. {name}: grid ({x}, {y}, {z})")


class EmulatedCkLibrary:
    """The fack_* entry points over `memory`. `kn0`: the key tile of the emulated dq_dk_dv instance
    (None: CK's gfx9 table, 128 for d <= 128 else 64); `dropout`: emulate dropout (reference pattern)."""

    def __init__(self, memory: Memory, kn0: int | None = None, dropout: bool = True,
                 report_tile: bool = True, gfx_targets: str = "gfx942"):
        self.memory = memory
        self.kn0_override = kn0
        self.dropout = dropout
        self.report_tile = report_tile
        self.targets = gfx_targets.encode()
        self.launches: list[tuple[str, tuple[int, int, int]]] = []
        self._error = b""
        if report_tile:
            self.fack_bwd_tile = self._fack_bwd_tile

    # ---- the C ABI's self-description ----------------------------------------------------------
    def fack_abi_version(self) -> int:
        return ck.ABI_VERSION

    def fack_attention_size(self) -> int:
        return ctypes.sizeof(ck.FackAttention)

    def fack_bwd_args_size(self) -> int:
        return ctypes.sizeof(ck.FackBwdArgs)

    def fack_gpu_targets(self) -> bytes:
        return self.targets

    def fack_last_error(self) -> bytes:
        return self._error

    def fack_last_hip_error(self) -> int:
        return 0

    # ---- entry points ----------------------------------------------------------------------------
    def fack_fwd(self, args_ref, stream) -> int:
        return self._guarded(lambda: self._fwd(_struct(args_ref, ck.FackAttention)))

    def fack_bwd(self, args_ref, stream) -> int:
        return self._guarded(lambda: self._bwd(_struct(args_ref, ck.FackBwdArgs)))

    def _fack_bwd_tile(self, args_ref, gfx_arch, kn0_ref) -> int:
        def call():
            b = _struct(args_ref, ck.FackBwdArgs)
            kn0_ref._obj.value = self.kn0(b.attn.head_dim)
            return FACK_OK
        return self._guarded(call)

    def kn0(self, head_dim: int) -> int:
        return self.kn0_override or (128 if head_dim <= 128 else 64)

    def _guarded(self, call) -> int:
        self._error = b""
        try:
            return call() or FACK_OK
        except LaunchError as e:
            self._error = f"kernel launch failed: {e}".encode()
            return FACK_LAUNCH_ERROR
        except NotImplementedError as e:
            self._error = f"CK emulator: {e}".encode()
            return FACK_NO_INSTANCE
        except ValueError as e:
            self._error = str(e).encode()
            return FACK_INVALID_ARGUMENT

    # ---- shared pieces ---------------------------------------------------------------------------
    def _lengths(self, a: ck.FackAttention, b: int) -> tuple[int, int, int, int]:
        """(query_start, key_start, seqlen_q, seqlen_k) of batch entry b, as CK's kernels read them."""
        if not a.group_mode:
            return 0, 0, a.seqlen_q, a.seqlen_k
        sq = self.memory.read("seqstart_q", a.seqstart_q, torch.int32, torch.tensor([b, b + 1]))
        sk = self.memory.read("seqstart_k", a.seqstart_k, torch.int32, torch.tensor([b, b + 1]))
        return int(sq[0]), int(sk[0]), int(sq[1] - sq[0]), int(sk[1] - sk[0])

    def _rows(self, name: str, t: ck.FackTensor, dtype, b: int, start: int, rows: torch.Tensor, head: int,
              d: int, group: bool) -> torch.Tensor:
        """(len(rows), d) of tensor `t` at batch b (group mode: row offset `start`), head `head`, fp32."""
        base = (start if group else 0) * t.row_stride + (0 if group else b * t.batch_stride) + head * t.head_stride
        offsets = base + rows[:, None] * t.row_stride + torch.arange(d)[None, :]
        return self.memory.read(name, t.data, dtype, offsets).float()

    def _row_offsets(self, t: ck.FackTensor, b: int, start: int, rows: torch.Tensor, head: int, d: int,
                     group: bool) -> torch.Tensor:
        base = (start if group else 0) * t.row_stride + (0 if group else b * t.batch_stride) + head * t.head_stride
        return base + rows[:, None] * t.row_stride + torch.arange(d)[None, :]

    @staticmethod
    def _stat_offsets(s: ck.FackRowStats, b: int, start: int, rows: torch.Tensor, head: int, group: bool):
        # Group mode: (h, total_q) with the sequence's query_start added; batch mode (b, h, s_q).
        return (start if group else b * s.batch_stride) + head * s.head_stride + rows

    def _scores(self, a: ck.FackAttention, b: int, head: int, q: torch.Tensor, k: torch.Tensor, s_q: int, s_k: int,
                rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        """Scaled scores with ALiBi and CK's mask (masked -> -inf) for rows x cols of one sequence."""
        scores = (q @ k.T) * a.softmax_scale
        i, j = rows[:, None], cols[None, :]
        if a.alibi_slopes:
            slope = self.memory.read("alibi_slopes", a.alibi_slopes, torch.float32,
                                     torch.tensor([b * a.alibi_batch_stride + head]))
            scores = scores + slope * _alibi_position(a, s_q, s_k, i, j)
        keep = _ck_mask(a.mask_type, a.window_left, a.window_right, s_q, s_k, i, j)
        return scores.masked_fill(~keep, float("-inf"))

    def _keep(self, a: ck.FackAttention, b: int, head: int, rows: torch.Tensor, cols: torch.Tensor):
        if a.p_drop <= 0:
            return None
        if not self.dropout:
            raise NotImplementedError("dropout is not emulated (CK's Philox keep pattern is CK-specific)")
        seed = int(self.memory.read("drop_seed", a.drop_seed, torch.int64, torch.tensor([0])))
        offset = int(self.memory.read("drop_offset", a.drop_offset, torch.int64, torch.tensor([0])))
        return keep_mask((seed, offset), a.p_drop, b, a.nhead_q, torch.tensor([head]), rows, cols)[0]

    # ---- fmha_fwd --------------------------------------------------------------------------------
    def _fwd(self, a: ck.FackAttention) -> None:
        dtype = _dtype(a)
        group, d = bool(a.group_mode), a.head_dim
        max_q = a.max_seqlen_q if group else a.seqlen_q
        grid = (-(-max_q // FWD_M0), a.nhead_q, a.batch)
        _grid("fmha_fwd", *grid)
        self.launches.append(("fwd", grid))
        ratio = a.nhead_q // a.nhead_k
        for b in range(a.batch):
            q0, k0, s_q, s_k = self._lengths(a, b)
            for head in range(a.nhead_q):
                for tile in range(grid[0]):
                    if tile * FWD_M0 >= s_q:
                        continue            # CK: `if(seqlen_q <= i_m0) return;`
                    rows = torch.arange(tile * FWD_M0, min((tile + 1) * FWD_M0, s_q))
                    cols = torch.arange(s_k)
                    q = self._rows("q", a.q, dtype, b, q0, rows, head, d, group)
                    k = self._rows("k", a.k, dtype, b, k0, cols, head // ratio, d, group)
                    v = self._rows("v", a.v, dtype, b, k0, cols, head // ratio, d, group)
                    scores = self._scores(a, b, head, q, k, s_q, s_k, rows, cols)
                    lse = torch.logsumexp(scores, dim=-1) if s_k else torch.full((rows.numel(),), float("-inf"))
                    probs = torch.exp(scores - lse[:, None]).nan_to_num(0.0)
                    keep = self._keep(a, b, head, rows, cols)
                    if keep is not None:
                        probs = probs * keep / (1.0 - a.p_drop)
                    out = probs @ v
                    self.memory.write("out", a.out.data, dtype, self._row_offsets(a.out, b, q0, rows, head, d, group),
                                      out)
                    self.memory.write("lse", a.lse.data, torch.float32,
                                      self._stat_offsets(a.lse, b, q0, rows, head, group), lse)

    # ---- fmha_bwd: dot_do_o, dq_dk_dv, convert_dq --------------------------------------------
    def _bwd(self, args: ck.FackBwdArgs) -> None:
        a = args.attn
        if (args.d.head_stride, args.d.batch_stride) != (a.lse.head_stride, a.lse.batch_stride):
            raise ValueError("d must have the strides of lse")
        dtype = _dtype(a)
        group, d = bool(a.group_mode), a.head_dim
        max_q = a.max_seqlen_q if group else a.seqlen_q
        # CK's bwd args carry max_seqlen_k for the dq_dk_dv grid (batch mode: the frontend's s_k).
        max_k = a.max_seqlen_k
        kn0 = self.kn0(d)
        grid_1d = (-(-max_q // M0_1D), a.nhead_q, a.batch)
        grid_n = (-(-max_k // kn0), a.nhead_q, a.batch)
        # CK's launch_kernel runs the three kernels in order; each launch checks its grid.
        _grid("fmha_bwd_dot_do_o", *grid_1d)
        self.launches.append(("dot_do_o", grid_1d))
        self._dot_do_o(args, dtype, grid_1d)
        _grid("fmha_bwd_dq_dk_dv", *grid_n)
        self.launches.append(("dq_dk_dv", grid_n))
        self._dq_dk_dv(args, dtype, grid_n, kn0)
        _grid("fmha_bwd_convert_dq", *grid_1d)
        self.launches.append(("convert_dq", grid_1d))
        self._convert_dq(args, dtype, grid_1d, kn0)

    def _dot_do_o(self, args: ck.FackBwdArgs, dtype: torch.dtype, grid_1d) -> None:
        """D = p_undrop * rowsum(dO * O), per row of each (sequence, head) the grid reaches."""
        a = args.attn
        group, d = bool(a.group_mode), a.head_dim
        for b in range(a.batch):
            q0, _, s_q, _ = self._lengths(a, b)
            for head in range(a.nhead_q):
                rows = torch.arange(s_q)[: grid_1d[0] * M0_1D]
                do = self._rows("dout", args.dout, dtype, b, q0, rows, head, d, group)
                o = self._rows("out", a.out, dtype, b, q0, rows, head, d, group)
                self.memory.write("d", args.d.data, torch.float32, self._stat_offsets(args.d, b, q0, rows, head, group),
                                  args.p_undrop * (do * o).sum(-1))

    def _dq_dk_dv(self, args: ck.FackBwdArgs, dtype: torch.dtype, grid_n, kn0: int) -> None:
        """Per key tile: dK and dV written, dQ added into its split of dq_acc (split 0 unless deterministic)."""
        a = args.attn
        group, d = bool(a.group_mode), a.head_dim
        for b in range(a.batch):
            q0, k0, s_q, s_k = self._lengths(a, b)
            if group and (s_q == 0 or s_k == 0):
                continue                    # CK: returns before the dK/dV epilogue
            for head in range(a.nhead_q):
                rows = torch.arange(s_q)
                q = self._rows("q", a.q, dtype, b, q0, rows, head, d, group)
                do = self._rows("dout", args.dout, dtype, b, q0, rows, head, d, group)
                lse = self.memory.read("lse", a.lse.data, torch.float32, self._stat_offsets(a.lse, b, q0, rows, head,
                                                                                            group))
                big_d = self.memory.read("d", args.d.data, torch.float32,
                                         self._stat_offsets(args.d, b, q0, rows, head, group))
                for tile in range(grid_n[0]):
                    if group and s_k <= tile * kn0:
                        break               # CK: `if(kargs.seqlen_k <= i_n0) return;`
                    cols = torch.arange(tile * kn0, min((tile + 1) * kn0, s_k))
                    self._key_tile(args, dtype, b, head, tile, (q0, k0, s_q, s_k), rows, cols, q, do, lse, big_d)

    def _key_tile(self, args: ck.FackBwdArgs, dtype: torch.dtype, b: int, head: int, tile: int, lengths, rows, cols,
                  q, do, lse, big_d) -> None:
        """One key tile of one (sequence, head): its dK, dV and dQ part."""
        a = args.attn
        group, d = bool(a.group_mode), a.head_dim
        q0, k0, s_q, s_k = lengths
        ratio = a.nhead_q // a.nhead_k
        k = self._rows("k", a.k, dtype, b, k0, cols, head // ratio, d, group)
        v = self._rows("v", a.v, dtype, b, k0, cols, head // ratio, d, group)
        scores = self._scores(a, b, head, q, k, s_q, s_k, rows, cols)
        probs = torch.exp(scores - lse[:, None])
        keep = self._keep(a, b, head, rows, cols)
        dp = do @ v.T
        if keep is not None:
            rp_undrop = 1.0 / args.p_undrop
            dv = (probs * keep * rp_undrop).T @ do
            ds = probs * (dp * keep - big_d[:, None]) * rp_undrop
        else:
            dv = probs.T @ do
            ds = probs * (dp - big_d[:, None])
        ds = ds * a.softmax_scale
        dk, dq = ds.T @ q, ds @ k
        for name, target, value in (("dk", args.dk, dk), ("dv", args.dv, dv)):
            offsets = self._row_offsets(target, b, k0, cols, head, d, group)
            self.memory.write(name, target.data, dtype, offsets, value)
        split = tile if args.deterministic else 0
        offsets = split * args.dq_acc_split_stride + self._row_offsets(args.dq_acc, b, q0, rows, head, d, group)
        self.memory.add("dq_acc", args.dq_acc.data, torch.float32, offsets, dq)

    def _convert_dq(self, args: ck.FackBwdArgs, dtype: torch.dtype, grid_1d, kn0: int) -> None:
        """dQ = the sum of dq_acc's splits, in the output dtype."""
        a = args.attn
        group, d = bool(a.group_mode), a.head_dim
        for b in range(a.batch):
            q0, _, s_q, s_k = self._lengths(a, b)
            nsplits = -(-s_k // kn0) if args.deterministic else 1
            for head in range(a.nhead_q):
                rows = torch.arange(s_q)[: grid_1d[0] * M0_1D]
                base = self._row_offsets(args.dq_acc, b, q0, rows, head, d, group)
                total = torch.zeros(rows.numel(), d)
                for split in range(nsplits):
                    total += self.memory.read("dq_acc", args.dq_acc.data, torch.float32,
                                              split * args.dq_acc_split_stride + base)
                self.memory.write("dq", args.dq.data, dtype, self._row_offsets(args.dq, b, q0, rows, head, d, group),
                                  total)


def _alibi_position(a: ck.FackAttention, s_q: int, s_k: int, i, j):
    """What CK adds to a score per unit of slope (ck_tile's `Alibi::update` in the mode
    `make_alibi_from_lr_mask` picks): with no mask, from the bottom-right corner, `-|i + s_k - s_q - j|`;
    with a mask whose left side is unbounded and right side 0 ("causal" to CK, whatever its alignment),
    VERTICAL: `+j`, which differs from the bottom-right form by a per-row constant (softmax keeps out and the
    gradients, lse moves by `slope * (i + s_k - s_q)`); otherwise the mask's own alignment, top-left `-|i - j|`
    or bottom-right."""
    if a.mask_type == 0:
        return -(i + s_k - s_q - j).abs()
    if a.window_left < 0 and a.window_right == 0:
        return j.expand_as(i + j)
    if a.mask_type == 1:
        return -(i - j).abs()
    if a.mask_type == 2:
        return -(i + s_k - s_q - j).abs()
    raise NotImplementedError(f"ALiBi with mask type {a.mask_type}: no ALiBi mode of CK's")


def _ck_mask(mask_type: int, left: int, right: int, s_q: int, s_k: int, i, j):
    """CK's generic mask from (type, left, right) and one sequence's lengths (docs/semantics.md §Masks)."""
    if mask_type == 0:
        return torch.ones(torch.broadcast_shapes(i.shape, j.shape), dtype=torch.bool)
    top_left = mask_type == 1
    if left < 0:
        left = s_q - 1 if top_left else s_k - 1
    if right < 0:
        right = s_k - 1 if top_left else s_q - 1
    x = 1 + right + (0 if top_left else s_k - s_q)
    y = 1 + left + (0 if top_left else s_q - s_k)
    return (j >= i + 1 - y) & (j < torch.clamp(i + x, max=s_k))


def _dtype(a: ck.FackAttention) -> torch.dtype:
    if a.dtype not in DTYPES:
        raise ValueError(f"dtype {a.dtype} is not FACK_FP16 or FACK_BF16")
    return DTYPES[a.dtype]


def _struct(ref, cls):
    """The struct behind `ctypes.byref(struct)`, re-read from its bytes through the header's layout."""
    obj = ref._obj
    if not isinstance(obj, ctypes.Structure):
        raise ValueError("args is NULL")
    return cls.from_buffer_copy(ctypes.string_at(ctypes.addressof(obj), ctypes.sizeof(cls)))


__all__ = ["EmulatedCkLibrary", "LaunchError", "Memory", "OutOfBounds", "TrackAllocations"]
