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


def quantize_fp8(weight: Any, scheme: str = "block128", scale_format: str = "f32", *,
                 name: str = "weight") -> tuple:
    """``weight`` (2-D, BF16, F16 or F32, host memory) quantized to FP8 E4M3
    exactly as the rollout engines' loaders do it: ``(codes, scales)``, the
    codes a uint8 array of the weight's shape (view it as
    ``torch.float8_e4m3fn``), the scales the dequantization multipliers.

    ``scheme``: ``"block128"`` (DeepGEMM's ``per_block_cast_to_fp8`` as vLLM
    and SGLang run it; scales ``[ceil(M/128), ceil(N/128)]``, DeepSeek-V3's
    ``weight_scale_inv``), ``"per_tensor"`` (vLLM's dynamic per-tensor
    quantization; scales ``[1]``) or ``"per_channel"`` (SGLang's per-row
    load path; scales ``[M, 1]``). ``scale_format``: ``"f32"``, or for
    block128 ``"ue8m0_f32"`` (powers of two as float32) or ``"ue8m0"`` (one
    F8_E8M0 byte each, uint8). A NaN or infinite weight raises
    InvalidArgumentError naming it."""
    return _deltasync.quantize_fp8(arg(name, weight), scheme, scale_format)


def encodings() -> list[str]:
    """The disk store's encodings, by name."""
    return list(_deltasync.encodings())


def dtype_size(dtype: str) -> int:
    """Bytes per element of a safetensors dtype name ("BF16" -> 2)."""
    return _deltasync.dtype_size(dtype)
