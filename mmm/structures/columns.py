"""Column accessors: fast gathers and scatters of one field across many pages.

A field of slot ``s`` in frame ``f`` sits at byte ``f * page_bytes + offset +
s * stride``. When that address is always a multiple of the field's itemsize,
the whole pool is viewed as one flat 1-D array of the field's dtype and a batch
access is one ``np.take`` / fancy assignment on it (about 1 ns per element);
otherwise a 2-D strided view is used (several times slower, still vectorized).
"""
from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["Column"]


class Column:
    """One field (or the whole record) of a slot array laid out in every frame."""

    __slots__ = ("dtype", "flat", "pbu", "base", "step", "view2d")

    def __init__(self, frames: npt.NDArray[np.uint8], offset: int, stride: int,
                 dtype: np.dtype[Any], slots: int) -> None:
        self.dtype = dtype
        isz = dtype.itemsize
        pb = frames.shape[1]
        flat_ok = (dtype.fields is None and dtype.subdtype is None and dtype.kind != "V"
                   and offset % isz == 0 and stride % isz == 0 and pb % isz == 0
                   and frames.flags.c_contiguous)
        self.flat: Any = None
        self.view2d: Any = None
        if flat_ok:
            self.flat = frames.reshape(-1).view(dtype)
            self.pbu, self.base, self.step = pb // isz, offset // isz, stride // isz
        else:
            raw = frames[:, offset:offset + (slots - 1) * stride + isz]
            self.view2d = np.lib.stride_tricks.as_strided(
                raw.view(np.uint8), shape=(frames.shape[0], slots, isz),
                strides=(raw.strides[0], stride, 1)).view(dtype)[..., 0]
            self.pbu = self.base = self.step = 0

    def get(self, f: npt.NDArray[np.int64], s: npt.NDArray[np.int64]) -> npt.NDArray[Any]:
        """Values at frames ``f``, slots ``s`` (a new array)."""
        out: npt.NDArray[Any]
        if self.flat is not None:
            out = np.take(self.flat, f * self.pbu + self.base + s * self.step)
            return out
        out = self.view2d[f, s]
        return out

    def set(self, f: npt.NDArray[np.int64], s: npt.NDArray[np.int64], v: Any) -> None:
        """Store ``v`` at frames ``f``, slots ``s`` (no duplicate positions)."""
        if self.flat is not None:
            self.flat[f * self.pbu + self.base + s * self.step] = v
        else:
            self.view2d[f, s] = v
