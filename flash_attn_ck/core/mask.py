"""CK's attention mask, the mask kinds backends declare, and the one place where causal/window arguments
are canonicalised.

`MaskInfo` mirrors CK's `mask_info` (example/ck_tile/01_fmha/mask.hpp): a type, the user-facing
`left`/`right` window sizes, and CK's generic coordinates `(y, x)`. Element `(i, j)` is kept iff
`i + 1 - y <= j < min(i + x, s_k)`. Only `type`, `left` and `right` reach a kernel, which rebuilds
`(y, x)` from the real per-sequence lengths (so varlen gets per-sequence bottom-right alignment).

`MaskKind` names the shape of a mask apart from its sizes; each backend declares the kinds its kernels
run (`Backend.mask_kinds`), and a call with any other kind is refused in the kind's own words.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch


class MaskType(enum.IntEnum):
    """CK's `mask_enum` (and the C ABI's `fack_mask_type`): how a kernel reads `left`/`right`."""
    NO_MASK = 0
    TOP_LEFT = 1
    BOTTOM_RIGHT = 2
    WINDOW_GENERIC = 3


class MaskKind(enum.Enum):
    """A mask's shape without its sizes: what a backend declares it runs. The value is the kind in words."""
    NONE = "no mask"
    CAUSAL = "causal (bottom-right)"
    CAUSAL_TOP_LEFT = "causal aligned top-left"
    WINDOW = "local window (bottom-right)"
    WINDOW_TOP_LEFT = "local window aligned top-left"
    GENERIC = "generic (y, x) window"


# What flash-attn's arguments (causal, window_size) make; the other kinds come from the SDPA-style
# top-left alignment and from query-row chunks of a masked call (pipeline/chunking.py).
API_MASK_KINDS = frozenset({MaskKind.NONE, MaskKind.CAUSAL, MaskKind.WINDOW})
# What a kernel that rebuilds its mask per sequence from (left, right) and the alignment runs (CK's and the Triton
# kernels'); listed, not derived from MaskKind, so a new kind is claimed only by the backends that add it.
WINDOW_MASK_KINDS = frozenset({MaskKind.NONE, MaskKind.CAUSAL, MaskKind.CAUSAL_TOP_LEFT, MaskKind.WINDOW,
                               MaskKind.WINDOW_TOP_LEFT})


def describe_kinds(kinds: frozenset[MaskKind]) -> str:
    """The kinds in words, in MaskKind's order."""
    return ", ".join(kind.value for kind in MaskKind if kind in kinds)


def generic_coordinates(left: int, right: int, seqlen_q: int, seqlen_k: int, top_left: bool) -> tuple[int, int]:
    """CK's left/right window -> `(y, x)`; a negative side is unbounded."""
    if left < 0:
        left = seqlen_q - 1 if top_left else seqlen_k - 1
    if right < 0:
        right = seqlen_k - 1 if top_left else seqlen_q - 1
    shift = 0 if top_left else seqlen_k - seqlen_q
    x = 1 + right + shift
    y = 1 + left - shift
    return y, x


@dataclass(frozen=True)
class MaskInfo:
    type: MaskType
    left: int
    right: int
    y: int
    x: int
    seqlen_q: int
    seqlen_k: int

    # ---- construction -------------------------------------------------------------------------
    @classmethod
    def no_mask(cls, seqlen_q: int, seqlen_k: int) -> MaskInfo:
        return cls(MaskType.NO_MASK, -1, -1, seqlen_q, seqlen_k, seqlen_q, seqlen_k)

    @classmethod
    def bottom_right(cls, left: int, right: int, seqlen_q: int, seqlen_k: int) -> MaskInfo:
        """A window aligned to the bottom-right corner (flash-attn's alignment); a negative side is unbounded."""
        y, x = generic_coordinates(left, right, seqlen_q, seqlen_k, top_left=False)
        return cls(MaskType.BOTTOM_RIGHT, left, right, y, x, seqlen_q, seqlen_k)

    @classmethod
    def top_left(cls, left: int, right: int, seqlen_q: int, seqlen_k: int) -> MaskInfo:
        """A window aligned to the top-left corner (SDPA's causal alignment); a negative side is unbounded."""
        y, x = generic_coordinates(left, right, seqlen_q, seqlen_k, top_left=True)
        return cls(MaskType.TOP_LEFT, left, right, y, x, seqlen_q, seqlen_k)

    @classmethod
    def generic(cls, y: int, x: int, seqlen_q: int, seqlen_k: int) -> MaskInfo:
        """CK's generic window in its own coordinates, kept as given for every length: row i keeps keys
        `i + 1 - y <= j < i + x` (a query-row chunk of another mask, in the chunk's row numbering)."""
        return cls(MaskType.WINDOW_GENERIC, y, x, y, x, seqlen_q, seqlen_k)

    @classmethod
    def from_flash_args(cls, causal: bool, window_size: tuple[int, int], seqlen_q: int, seqlen_k: int) -> MaskInfo:
        """flash-attn's arguments -> CK mask: flash-attn's documented interval, exactly (docs/semantics.md §Masks).

        `seqlen_q`/`seqlen_k`: the lengths (varlen: upper bounds of every sequence's lengths, e.g. the
        max_seqlen), which decide only where a side is redundant; kernels apply the kept bounds per
        sequence."""
        left, right = canonical_window(causal, window_size, seqlen_q, seqlen_k)
        if not causal and left == -1 and right == -1:
            return cls.no_mask(seqlen_q, seqlen_k)
        return cls.bottom_right(left, right, seqlen_q, seqlen_k)

    @classmethod
    def decode(cls, spec: str, seqlen_q: int, seqlen_k: int) -> MaskInfo:
        """CK's `mask_identify` strings as flash-attention's CK frontend writes them: `0` (no mask) and
        `b:L,R` (bottom-right window). Only CK's string interface and its tests use this form."""
        if spec == "0":
            return cls.no_mask(seqlen_q, seqlen_k)
        kind, colon, value = spec.partition(":")
        if kind != "b" or not colon:
            raise ValueError(f"mask spec {spec!r}: expected '0' or 'b:LEFT,RIGHT'")
        first, comma, second = value.partition(",")
        if not comma:
            raise ValueError(f"mask spec {spec!r}: expected two comma-separated integers after ':'")
        return cls.bottom_right(_parse_int(first, spec), _parse_int(second, spec), seqlen_q, seqlen_k)

    # ---- queries -------------------------------------------------------------------------------
    @property
    def is_masked(self) -> bool:
        return self.type != MaskType.NO_MASK

    @property
    def is_causal(self) -> bool:
        return self.type in (MaskType.TOP_LEFT, MaskType.BOTTOM_RIGHT) and self.left < 0 and self.right == 0

    @property
    def kind(self) -> MaskKind:
        if self.type == MaskType.NO_MASK:
            return MaskKind.NONE
        if self.type == MaskType.WINDOW_GENERIC:
            return MaskKind.GENERIC
        if self.type == MaskType.TOP_LEFT:
            return MaskKind.CAUSAL_TOP_LEFT if self.is_causal else MaskKind.WINDOW_TOP_LEFT
        return MaskKind.CAUSAL if self.is_causal else MaskKind.WINDOW

    def for_lengths(self, seqlen_q: int, seqlen_k: int) -> MaskInfo:
        """The same left/right window rebuilt for other lengths, as a CK kernel does per sequence."""
        if self.type == MaskType.NO_MASK:
            return MaskInfo.no_mask(seqlen_q, seqlen_k)
        if self.type == MaskType.WINDOW_GENERIC:
            return MaskInfo.generic(self.y, self.x, seqlen_q, seqlen_k)
        align = MaskInfo.top_left if self.type == MaskType.TOP_LEFT else MaskInfo.bottom_right
        return align(self.left, self.right, seqlen_q, seqlen_k)

    def key_bounds(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Half-open key range `[lo, hi)` kept for each query row (clamped to `[0, s_k]`)."""
        if self.type == MaskType.NO_MASK:
            return torch.zeros_like(rows), torch.full_like(rows, self.seqlen_k)
        lo = (rows + 1 - self.y).clamp(0, self.seqlen_k)
        hi = torch.minimum(rows + self.x, torch.full_like(rows, self.seqlen_k)).clamp(min=0)
        return lo, torch.maximum(lo, hi)

    def keep(self, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        """Boolean keep matrix for query rows `rows[:, None]` and key columns `cols[None, :]`."""
        lo, hi = self.key_bounds(rows)
        return (cols[None, :] >= lo[:, None]) & (cols[None, :] < hi[:, None])

    def describe(self) -> str:
        return f"{self.type.name.lower()}(left={self.left}, right={self.right}, y={self.y}, x={self.x})"


def canonical_window(causal: bool, window_size: tuple[int, int], seqlen_q: int, seqlen_k: int) -> tuple[int, int]:
    """causal sets right = 0; a side becomes -1 (unbounded) only where that changes nothing.

    Query i (0 <= i < s_q) attends keys j in [i + s_k - s_q - left, i + s_k - s_q + right] (flash-attn's
    documented interval). The right bound cuts nothing iff s_k - s_q + right >= s_k - 1 at i = 0, i.e.
    right >= s_q - 1; the left bound cuts nothing iff s_k - 1 - left <= 0 at i = s_q - 1, i.e. left >= s_k - 1.
    For varlen, `seqlen_q`/`seqlen_k` are bounds of every sequence's lengths, so a side dropped here is
    redundant in every sequence (flash-attention's CK frontend instead drops any side >= max_seqlen_k,
    which changes the mask when s_q > s_k: docs/semantics.md §Masks)."""
    left, right = (int(window_size[0]), int(window_size[1]))
    if causal:
        right = 0
    if left >= max(seqlen_k - 1, 0):
        left = -1
    if right >= max(seqlen_q - 1, 0) and not causal:     # causal keeps right = 0: it names the mask
        right = -1
    return left, right


def _parse_int(text: str, spec: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"mask spec {spec!r}: {text!r} is not an integer") from None
