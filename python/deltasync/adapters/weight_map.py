"""Where each checkpoint tensor lives in an engine's parameters, learned once.

Both SGLang and vLLM load weights by running the model's own
``load_weights(iterable of (checkpoint_name, tensor))``, which slices each
tensor for this worker's tensor-parallel rank and copies it into a
parameter: a whole parameter, a slice of it, or a part of a fused one
(q/k/v into ``qkv_proj``, gate/up into ``gate_up_proj``, experts stacked).
:func:`learn` runs that ``load_weights`` once per checkpoint tensor on a
probe tensor, with ``Tensor.copy_`` (and ``__setitem__``) recording instead
of copying, and turns each recorded copy into destination runs: checkpoint
elements ``first .. first+count-1`` live at parameter elements ``offset,
offset+stride, ...``. Later deltas are scattered straight into those
parameters, with no full-size staging tensor.

A tensor the dry run cannot map (its loader computes on it rather than
copying a view of it, copies it into two parameters, converts its dtype,
or replaces a parameter) is reported in :attr:`WeightMap.unmapped` with
the reason; callers take the stock ``load_weights`` path for it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Any, Callable, Iterable, Optional

import numpy as np
import torch

from .._tensors import dtype_name


__all__ = ["Placement", "WeightMap", "learn"]


def _storage_ptr(t: torch.Tensor) -> int:
    if hasattr(t, "untyped_storage"):
        return t.untyped_storage().data_ptr()
    return t.storage().data_ptr()


@dataclasses.dataclass
class Placement:
    """One checkpoint tensor's home: ``param`` (named ``param_name``), and the
    runs (first, count, offset, stride) in flat elements; ``runs`` as an
    (n, 4) int64 array sorted by ``first``."""

    name: str
    dtype: str
    shape: list[int]
    param_name: str
    param: torch.Tensor
    runs: np.ndarray
    _device_runs: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)

    @property
    def elements(self) -> int:
        """Checkpoint elements this worker holds."""
        return int(self.runs[:, 1].sum()) if len(self.runs) else 0

    def run_tuples(self) -> list[tuple[int, int, int, int]]:
        """The runs as (first, count, offset, stride) tuples (StreamReceiver.register's)."""
        return [tuple(int(x) for x in r) for r in self.runs]

    def destinations(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """For flat checkpoint positions (int64, ascending or not), the mask of
        those this worker holds and their flat indices in ``param``."""
        dev = positions.device
        runs = self._device_runs.get(dev)
        if runs is None:  # once per device, not at every delta
            runs = torch.as_tensor(self.runs, dtype=torch.int64, device=dev)
            self._device_runs[dev] = runs
        if len(self.runs) == 0:
            empty = torch.zeros(0, dtype=torch.int64, device=dev)
            return torch.zeros_like(positions, dtype=torch.bool), empty
        firsts = runs[:, 0].contiguous()
        idx = torch.searchsorted(firsts, positions, right=True) - 1
        held = idx >= 0
        idx = idx.clamp(min=0)
        rel = positions - firsts[idx]
        held &= rel < runs[idx, 1]
        dest = runs[idx, 2] + rel * runs[idx, 3]
        return held, dest[held]


@dataclasses.dataclass
class WeightMap:
    """The placements of every checkpoint tensor the dry run mapped, and the
    reason for each it could not."""

    placements: dict[str, Placement]
    unmapped: dict[str, str]

    def report(self) -> str:
        """A few lines: how many tensors were mapped, and why each other was not."""
        lines = [f"{len(self.placements)} tensors mapped into parameters, "
                 f"{len(self.unmapped)} through the stock load_weights path"]
        for name, why in sorted(self.unmapped.items()):
            lines.append(f"  {name}: {why}")
        return "\n".join(lines)


class _Copy:
    __slots__ = ("dst", "src")

    def __init__(self, dst: torch.Tensor, src: Any) -> None:
        self.dst = dst
        self.src = src


_REAL_COPY = torch.Tensor.copy_
_REAL_SETITEM = torch.Tensor.__setitem__
# One dry run at a time in a process (the patch is process-wide); only the
# thread running it records, every other thread's copies run as usual.
_LOCK = threading.Lock()
_LOCAL = threading.local()


def _copy(self: torch.Tensor, src: Any, non_blocking: bool = False) -> torch.Tensor:
    log = getattr(_LOCAL, "log", None)
    if log is None:
        return _REAL_COPY(self, src, non_blocking)
    log.append(_Copy(self, src))
    return self


def _setitem(self: torch.Tensor, index: Any, value: Any) -> None:
    log = getattr(_LOCAL, "log", None)
    if log is None:
        return _REAL_SETITEM(self, index, value)
    view = self[index]
    if isinstance(view, torch.Tensor) and _storage_ptr(view) == _storage_ptr(self):
        log.append(_Copy(view, value))
    else:
        log.append(_Copy(None, value))  # advanced indexing: not a view
    return None


@contextlib.contextmanager
def _recording(log: list) -> Any:
    """In this thread, Tensor.copy_ and Tensor.__setitem__ record (dst, src)
    instead of writing."""
    with _LOCK:
        torch.Tensor.copy_ = _copy
        torch.Tensor.__setitem__ = _setitem
        _LOCAL.log = log
        try:
            yield
        finally:
            _LOCAL.log = None
            torch.Tensor.copy_ = _REAL_COPY
            torch.Tensor.__setitem__ = _REAL_SETITEM


def _copy_runs(c: _Copy, probe: torch.Tensor, param: torch.Tensor) -> np.ndarray:
    """The runs of one recorded copy of a view of ``probe`` into a view of
    ``param``; raises ValueError with the reason it is not one."""
    src, dst = c.src, c.dst
    if src.dtype != dst.dtype:
        raise ValueError(f"the loader converts {src.dtype} to {dst.dtype}")
    shape = list(dst.shape)
    if list(src.shape) != shape:
        try:
            src = src.expand(shape)
        except RuntimeError:
            raise ValueError(f"a copy of shape {list(c.src.shape)} into {shape}") from None
    ss = list(src.stride())
    ds = list(dst.stride())
    for d, n in enumerate(shape):
        if n > 1 and ss[d] == 0:
            raise ValueError("the loader broadcasts one element to several places")
    so = src.storage_offset() - probe.storage_offset()
    do = dst.storage_offset() - param.storage_offset()
    if src.numel() == 0:
        return np.zeros((0, 4), dtype=np.int64)
    # The inner dimension: the one the source walks at stride 1.
    dims = [d for d, n in enumerate(shape) if n > 1]
    inner = next((d for d in reversed(dims) if ss[d] == 1), None)
    outer = [d for d in dims if d != inner]
    hf = np.array([so], dtype=np.int64)
    de = np.array([do], dtype=np.int64)
    for d in outer:
        steps = np.arange(shape[d], dtype=np.int64)
        hf = (hf[:, None] + steps[None, :] * ss[d]).reshape(-1)
        de = (de[:, None] + steps[None, :] * ds[d]).reshape(-1)
    count = shape[inner] if inner is not None else 1
    stride = ds[inner] if inner is not None else 1
    if stride <= 0:
        raise ValueError("the destination walks backwards")
    runs = np.stack([hf, np.full_like(hf, count), de, np.full_like(hf, stride)], axis=1)
    return runs


def _coalesce(runs: np.ndarray) -> np.ndarray:
    """Sorted by first element, adjacent runs joined where the destination
    continues at one stride; refuses an element written twice."""
    runs = runs[np.argsort(runs[:, 0], kind="stable")]
    out: list[list[int]] = []
    for first, count, offset, stride in runs.tolist():
        if out:
            f, n, o, s = out[-1]
            if first < f + n:
                raise ValueError("its loader writes one element twice")
            if first == f + n:
                # A one-element run has no stride of its own.
                prev = s if n > 1 else None
                cur = stride if count > 1 else None
                if prev is None and cur is None:
                    step = offset - o
                elif prev is None or cur is None:
                    step = prev if cur is None else cur
                else:
                    step = prev if prev == cur else 0
                if step > 0 and offset == o + n * step:
                    out[-1] = [f, n + count, o, step]
                    continue
        out.append([first, count, offset, stride])
    return np.array(out, dtype=np.int64).reshape(-1, 4)


def learn(
    model: torch.nn.Module,
    checkpoint: Iterable[tuple[str, Any, Any]],
    load_weights: Optional[Callable[[list], Any]] = None,
    device: Any = None,
) -> WeightMap:
    """Learns where each checkpoint tensor lands in ``model``'s parameters.

    ``checkpoint`` lists every checkpoint tensor as (name, dtype, shape)
    with a torch dtype or a safetensors name; ``load_weights`` is the
    engine's loader (default ``model.load_weights``). Nothing in the model
    is written. ``device`` is where probe tensors are made (default: the
    parameters' device, as the engines pass tensors already moved there).
    """
    from .engine import torch_dtype

    loader = load_weights or model.load_weights
    named = list(model.named_parameters()) + list(model.named_buffers())
    params = {}
    for pname, p in named:
        params.setdefault(_storage_ptr(p), (pname, p))
    if device is None:
        device = named[0][1].device if named else torch.device("cpu")
    before = {pname: (p.data_ptr(), p.data) for pname, p in named}
    placements: dict[str, Placement] = {}
    unmapped: dict[str, str] = {}
    for name, dtype, shape in checkpoint:
        tdtype = torch_dtype(dtype) if isinstance(dtype, str) else dtype
        probe = torch.empty([int(x) for x in shape], dtype=tdtype, device=device)
        log: list[_Copy] = []
        try:
            with torch.no_grad(), _recording(log):
                loader([(name, probe)])
        except Exception as e:  # the loader refused a probe: stock path
            unmapped[name] = f"its load_weights raised on a dry run ({type(e).__name__}: {e})"
            continue
        try:
            placements[name] = _placement(name, probe, log, params)
        except ValueError as e:
            unmapped[name] = str(e)
    for pname, p in named:
        ptr, data = before[pname]
        if p.data_ptr() != ptr:  # the loader replaced the parameter: undo it
            p.data = data
            for name, pl in list(placements.items()):
                if pl.param_name == pname:
                    del placements[name]
                    unmapped[name] = f"its loader replaces parameter {pname}"
    return WeightMap(placements, unmapped)


def _placement(name: str, probe: torch.Tensor, log: list, params: dict) -> Placement:
    if not log:
        raise ValueError("its load_weights copies nothing from it (skipped or renamed away)")
    probe_ptr = _storage_ptr(probe)
    target = None
    all_runs = []
    for c in log:
        if c.dst is None:
            raise ValueError("its loader writes through advanced indexing")
        if not isinstance(c.src, torch.Tensor) or _storage_ptr(c.src) != probe_ptr:
            raise ValueError("its loader copies a computed tensor, not a view of it")
        key = _storage_ptr(c.dst)
        if key not in params:
            raise ValueError("its loader copies into a tensor that is not a parameter")
        pname, param = params[key]
        if target is not None and target[0] != pname:
            raise ValueError(f"its loader copies into two parameters ({target[0]}, {pname})")
        if not param.is_contiguous():
            raise ValueError(f"parameter {pname} is not contiguous")
        target = (pname, param)
        all_runs.append(_copy_runs(c, probe, param))
    runs = _coalesce(np.concatenate(all_runs)) if all_runs else np.zeros((0, 4), np.int64)
    pname, param = target
    last = runs[:, 2] + (runs[:, 1] - 1) * runs[:, 3]
    if len(runs) and (runs[:, 2].min() < 0 or last.max() >= param.numel()):
        raise ValueError(f"its runs leave parameter {pname}")
    return Placement(name, dtype_name(probe), list(probe.shape), pname, param, runs)
