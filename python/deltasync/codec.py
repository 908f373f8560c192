"""Diff, encode and decode on tensors: the core's building blocks, for tools and tests.

The encodings are the disk store's per-tensor ones (``"xor"``, ``"sparse"``,
``"indices"``, ``"dense"``, ...; :func:`encodings` lists them), byte for
byte what ``deltasync publish`` writes for the same tensor.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from . import _deltasync
from ._tensors import arg


class Changes(NamedTuple):
    """Where ``current`` differs from a snapshot: flat element positions
    (ascending, uint64) and the new values' bytes, one element after another."""

    positions: np.ndarray
    values: bytes

    def as_torch(self, dtype: Any) -> tuple:
        """(positions as an int64 tensor, values as a tensor of ``dtype``),
        e.g. for ``param.view(-1)[positions] = values``."""
        import torch

        pos = torch.from_numpy(self.positions.astype(np.int64))
        if not self.values:
            return pos, torch.zeros(0, dtype=dtype)
        return pos, torch.frombuffer(bytearray(self.values), dtype=torch.uint8).view(dtype)


def diff(current: Any, snapshot: Any, *, refresh: bool = False, name: str = "current") -> Changes:
    """The elements of ``current`` that differ bitwise from ``snapshot`` (same
    dtype and shape, host memory). With ``refresh`` the snapshot takes the new
    values, as a sender's snapshot does after a sync."""
    c = arg(name, current)
    s = arg(name + ".snapshot", snapshot, writable=refresh)
    positions, values = _deltasync.diff(c, s, refresh)
    return Changes(positions, values)


def encode(current: Any, base: Any, encoding: str = "sparse", *, name: str = "current") -> bytes:
    """``current``'s change against ``base``, encoded as the disk store encodes
    one tensor of a delta version."""
    return _deltasync.encode(arg(name, current), arg(name + ".base", base), encoding)


def decode_apply(encoded: bytes, target: Any, encoding: str = "sparse", *, name: str = "target") -> None:
    """Applies an encoding made by :func:`encode` to ``target`` in place;
    ``target`` must hold the base it was made against. A corrupt or
    mismatched encoding raises (CorruptionError, InvalidArgumentError)
    naming the tensor."""
    _deltasync.decode_apply(bytes(encoded), arg(name, target, writable=True), encoding)


def encodings() -> list[str]:
    """The disk store's encodings, by name."""
    return list(_deltasync.encodings())


def dtype_size(dtype: str) -> int:
    """Bytes per element of a safetensors dtype name ("BF16" -> 2)."""
    return _deltasync.dtype_size(dtype)
