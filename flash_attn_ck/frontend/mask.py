"""CK's attention mask, and the one place where causal/window arguments are canonicalised.

`MaskInfo` mirrors CK's `mask_info` (example/ck_tile/01_fmha/mask.hpp): a type, the user-facing
`left`/`right` window sizes, and CK's generic coordinates `(y, x)`. Element `(i, j)` is kept iff
`i + 1 - y <= j < min(i + x, s_k)`. Only `type`, `left` and `right` reach a kernel, which rebuilds
`(y, x)` from the real per-sequence lengths (so varlen gets per-sequence bottom-right alignment).
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass

import torch


class MaskType(enum.IntEnum):
    NO_MASK = 0
    TOP_LEFT = 1
    BOTTOM_RIGHT = 2
    WINDOW_GENERIC = 3


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
    def decode(cls, spec: str, seqlen_q: int, seqlen_k: int) -> "MaskInfo":
        """Parse CK's mask strings: `0`..`3`, `t`, `b`, `t:L,R`, `b:L,R`, `g:Y,X`, `xt:W`, `xb:W`."""
        if ":" in spec:
            kind, _, value = spec.partition(":")
            if kind in ("xt", "xb"):
                # xformers-style window of total width W centred on the diagonal.
                width = _parse_int(value, spec)
                left, right = (-1, 0) if width <= 0 else (width // 2, width - 1 - width // 2)
                top_left = kind == "xt"
                y, x = generic_coordinates(left, right, seqlen_q, seqlen_k, top_left)
                mtype = MaskType.TOP_LEFT if top_left else MaskType.BOTTOM_RIGHT
                return cls(mtype, left, right, y, x, seqlen_q, seqlen_k)
            first, comma, second = value.partition(",")
            if not comma:
                raise ValueError(f"mask spec {spec!r}: expected two comma-separated integers after ':'")
            v0, v1 = _parse_int(first, spec), _parse_int(second, spec)
            if kind == "t" or kind == "b":
                top_left = kind == "t"
                y, x = generic_coordinates(v0, v1, seqlen_q, seqlen_k, top_left)
                mtype = MaskType.TOP_LEFT if top_left else MaskType.BOTTOM_RIGHT
                return cls(mtype, v0, v1, y, x, seqlen_q, seqlen_k)
            if kind == "g":
                return cls(MaskType.WINDOW_GENERIC, v0, v1, v0, v1, seqlen_q, seqlen_k)
            raise ValueError(f"mask spec {spec!r}: unknown kind {kind!r} (expected t, b, g, xt or xb)")
        if spec == "t":
            return cls.causal(seqlen_q, seqlen_k, top_left=True)
        if spec == "b":
            return cls.causal(seqlen_q, seqlen_k, top_left=False)
        code = MaskType(_parse_int(spec, spec))
        if code == MaskType.TOP_LEFT or code == MaskType.BOTTOM_RIGHT:
            return cls.causal(seqlen_q, seqlen_k, top_left=code == MaskType.TOP_LEFT)
        # A bare generic type carries no coordinates: CK leaves it everything-visible.
        return cls(code, -1, -1, seqlen_q, seqlen_k, seqlen_q, seqlen_k)

    @classmethod
    def causal(cls, seqlen_q: int, seqlen_k: int, top_left: bool) -> "MaskInfo":
        mtype = MaskType.TOP_LEFT if top_left else MaskType.BOTTOM_RIGHT
        x = 1 if top_left else seqlen_k - seqlen_q + 1
        return cls(mtype, -1, 0, seqlen_q, x, seqlen_q, seqlen_k)

    @classmethod
    @functools.lru_cache(maxsize=1024)
    def from_flash_args(cls, causal: bool, window_size: tuple[int, int], seqlen_q: int, seqlen_k: int) -> "MaskInfo":
        """flash-attn's arguments -> CK mask, with flash-attention's normalisation (docs/semantics.md §Masks).

        `seqlen_k` is the key length used for clamping (`max_seqlen_k` for varlen). Memoised (MaskInfo
        is immutable): every call builds its mask, through CK's mask-string round trip."""
        left, right = canonical_window(causal, window_size, seqlen_k)
        if causal:
            return cls.decode(f"b:{left},0", seqlen_q, seqlen_k)
        if left == -1 and right == -1:
            return cls.decode("0", seqlen_q, seqlen_k)
        return cls.decode(f"b:{left},{right}", seqlen_q, seqlen_k)

    # ---- queries -------------------------------------------------------------------------------
    @property
    def is_masked(self) -> bool:
        return self.type != MaskType.NO_MASK

    @property
    def is_causal(self) -> bool:
        return self.type in (MaskType.TOP_LEFT, MaskType.BOTTOM_RIGHT) and self.left < 0 and self.right == 0

    def for_lengths(self, seqlen_q: int, seqlen_k: int) -> "MaskInfo":
        """The same left/right window rebuilt for other lengths, as a CK kernel does per sequence."""
        if self.type == MaskType.NO_MASK:
            return MaskInfo(MaskType.NO_MASK, -1, -1, seqlen_q, seqlen_k, seqlen_q, seqlen_k)
        if self.type == MaskType.WINDOW_GENERIC:
            return MaskInfo(self.type, self.left, self.right, self.y, self.x, seqlen_q, seqlen_k)
        top_left = self.type == MaskType.TOP_LEFT
        y, x = generic_coordinates(self.left, self.right, seqlen_q, seqlen_k, top_left)
        return MaskInfo(self.type, self.left, self.right, y, x, seqlen_q, seqlen_k)

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


def canonical_window(causal: bool, window_size: tuple[int, int], seqlen_k: int) -> tuple[int, int]:
    """flash-attn normalisation: causal sets right = 0; a side reaching past `seqlen_k` is unbounded."""
    left, right = (int(window_size[0]), int(window_size[1]))
    if causal:
        right = 0
    if left >= seqlen_k:
        left = -1
    if right >= seqlen_k:
        right = -1
    return left, right


def _parse_int(text: str, spec: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"mask spec {spec!r}: {text!r} is not an integer") from None
