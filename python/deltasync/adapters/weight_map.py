"""Where each checkpoint tensor lives in an engine's parameters, learned once.

Both SGLang and vLLM load weights by running the model's own
``load_weights(iterable of (checkpoint_name, tensor))``, which slices each
tensor for this worker's tensor-parallel rank and copies it into a
parameter: a whole parameter, a slice of it, or a part of a fused one
(q/k/v into ``qkv_proj``, gate/up into ``gate_up_proj``, experts stacked).
:func:`learn` runs that ``load_weights`` once per checkpoint tensor on a
probe tensor and turns each copy of a view of the probe into destination
runs: checkpoint elements ``first .. first+count-1`` live at parameter
elements ``offset, offset+stride, ...``. Later deltas are scattered straight
into those parameters, with no full-size staging tensor.

**Nothing the model holds is written by a dry run.** The loader runs under a
dispatcher mode (``torch.utils._python_dispatch.TorchDispatchMode``) that
sees every ATen operation: an operation that writes into memory which
existed before the dry run (a parameter, a buffer, any tensor the model
holds) never runs; a ``copy_`` of a view of the probe is recorded as a
placement, and any other such write (``fill_(w.item())``, ``set_``,
``index_put_``, an ``out=`` operation, a post-load step recomputing a
derived weight) is refused and sends the tensor through the stock path,
except a constant written (``fill_``, ``zero_``) over elements that hold it
already, which changes nothing (the padding rows of an embedding).
Writes into memory the loader itself made during the dry run run as usual.
The mode is entered on every thread the loader uses: work handed to a
``concurrent.futures.ThreadPoolExecutor`` and threads started with
``threading.Thread`` run under it too (work still running when the loader
returns is waited for, and its tensor takes the stock path). Replacing a
parameter or attribute
of one of the model's modules (``module.w = ...``, ``register_parameter``,
``del module.w``), a parameter's memory (``p.data = ...``) or an attribute
of a parameter is refused the same way. After the dry run every parameter
and buffer is checked against a fingerprint taken before it (and against
its memory and the module attribute holding it); a difference raises
:class:`~deltasync.errors.InternalError` naming the parameter.

**Tensors this worker does not hold.** A tensor whose loader neither copies
any of it, nor reads its values, nor keeps a reference to it, also when it
is given together with every other such tensor (a loader that fuses two
tensors only once it has both), is held by no parameter of this worker: an
expert of another expert-parallel rank, a layer of another pipeline stage,
an ``lm_head`` tied to the embedding. It is reported in
:attr:`WeightMap.skipped`; callers register nothing for it and keep no copy.

A tensor the dry run cannot map (its loader computes on it rather than
copying a view of it, copies it into two parameters, converts its dtype,
or writes in any other way) is reported in :attr:`WeightMap.unmapped` with
the reason; callers take the stock ``load_weights`` path for it.

**Tensors written only together.** Tensors its loader uses only together
(SGLang's DeepSeek concatenates ``q_a_proj`` and ``kv_a_proj_with_mqa``
and copies the result into ``fused_qkv_a_proj_with_mqa`` only when one
call gives it both) get one more dry run with all of them, each a probe of
its own memory whose elements are followed through the operations that
only move them (``torch.cat``, ``stack``, ``clone``, ``flip``, copies into
memory the loader made): replayed on element ids, they say which element
of the copied result comes from which checkpoint element, so each tensor
gets a placement of its own (:attr:`WeightMap.joint`). A group that cannot
be followed so (its loader computes on them) is listed in
:attr:`WeightMap.groups`: the stock path loads them in one call.

**Post-load steps.** What the kernel reads need not be what
``load_weights`` wrote: the engine's model loader runs a post-load step on
modules afterwards (``post_load``: vLLM's and SGLang's quant methods'
``process_weights_after_loading``, vLLM's attention layers'). Each step is
dry-run like a loader, on the model as it is (its writes refused), with
every write it tries recorded and, for each value written, the parameters
it was computed from. A step that writes nothing, or only views of loaded
weights, or constants, needs nothing. A step that derives other weights
from loaded parameters (MLA's absorbed ``W_UK_T``/``W_UV`` from
``kv_b_proj``) is listed in :attr:`WeightMap.steps`, to run again after
the tensors it reads change. A step that rewrites a loaded parameter
(vLLM's unquantized MoE swapping or shuffling ``w13`` for FlashInfer or
AITER) cannot be followed by writing into the parameter: every tensor of
that parameter moves to the stock path as one group, loaded whole again
before the step runs again. Where neither is right (the step gives the
parameter another shape or raises on its own result, part of the parameter
is written by no tensor or by the stock path, or the step reads what it
derives), the tensors are reported in :attr:`WeightMap.refused`.

**Parameters that move.** :attr:`WeightMap.layout` records, for every
parameter and buffer, the object, the module attribute that holds it and
its memory; :meth:`WeightMap.moved` and :meth:`Placement.moved` tell when
one was replaced (``update_weights_from_disk``, a wake from sleep that
reallocates, expert rebalancing that rebuilds a layer), so that the caller
learns the map again before writing. A change that leaves every parameter
where it was (experts swapped in place) is not seen: whoever makes it
learns the map again (``EngineWeights.refresh(force=True)``).
"""

from __future__ import annotations

import concurrent.futures
import concurrent.futures.thread
import contextlib
import dataclasses
import gc
import threading
from typing import Any, Callable, Iterable, Optional

import numpy as np
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from .._tensors import dtype_name
from ..errors import InternalError


__all__ = ["Placement", "PostLoadStep", "WeightMap", "learn"]


def _storage(t: torch.Tensor) -> Any:
    return t.untyped_storage() if hasattr(t, "untyped_storage") else t.storage()


def _storage_ptr(t: torch.Tensor) -> int:
    return t.data_ptr() - t.storage_offset() * t.element_size()


def _key(t: torch.Tensor) -> tuple:
    """Which memory ``t`` views: its device and its storage's address (for a
    tensor without plain memory, one key of its own that nothing else has)."""
    try:
        return (t.device.type, t.device.index, _storage_ptr(t))
    except (RuntimeError, NotImplementedError):
        return ("?", None, id(t))


class _Weight:
    """One parameter or buffer as the dry run found it: the object, the
    module attributes holding it, and its memory."""

    __slots__ = ("name", "obj", "slots", "ptr", "nbytes", "shape", "stride", "offset", "dtype")

    def __init__(self, name: str, obj: torch.Tensor, slots: list) -> None:
        self.name = name
        self.obj = obj
        self.slots = slots
        self.ptr = obj.data_ptr()
        self.nbytes = _storage(obj).nbytes()
        self.shape = tuple(obj.shape)
        self.stride = tuple(obj.stride())
        self.offset = obj.storage_offset()
        self.dtype = obj.dtype

    def changed(self, now: Any = None) -> Optional[str]:
        """Why the weight is no longer where it was (None if it is): ``now``
        is the object the model names it by today, if known."""
        o = self.obj
        if now is not None and now is not o:
            return "the parameter object was replaced"
        for d, k in self.slots:
            if d.get(k) is not o:
                return "the parameter object was replaced"
        if o.data_ptr() != self.ptr:
            return "its memory moved"
        if _storage(o).nbytes() < self.nbytes:
            return "its memory was freed or shrunk"
        if (tuple(o.shape) != self.shape or tuple(o.stride()) != self.stride
                or o.storage_offset() != self.offset or o.dtype != self.dtype):
            return "its shape or layout changed"
        return None


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
    _weight: Optional[_Weight] = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def elements(self) -> int:
        """Checkpoint elements this worker holds."""
        return int(self.runs[:, 1].sum()) if len(self.runs) else 0

    def run_tuples(self) -> list[tuple[int, int, int, int]]:
        """The runs as (first, count, offset, stride) tuples (StreamReceiver.register's)."""
        return [tuple(int(x) for x in r) for r in self.runs]

    def moved(self) -> Optional[str]:
        """Why ``param`` is no longer the parameter's memory (replaced, moved,
        freed), None while it is: a quick check of this one parameter."""
        return self._weight.changed() if self._weight is not None else None

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
class PostLoadStep:
    """A step the engine runs on a module after ``load_weights`` (a quant
    method's ``process_weights_after_loading``, an attention layer's
    derivation of its absorbed weights) that writes weights from loaded
    ones: ``transforms``, the loaded parameters it rewrites into another
    layout; ``feeds``, those it derives other weights from; ``tensors``, the
    checkpoint tensors whose change needs it run again; ``what``, its first
    such write. ``slots`` ((module, attribute)) and ``datas`` (tensors whose
    ``.data`` it replaces): what it may replace, so that running it again
    can keep every weight's memory."""

    name: str
    run: Callable[[], Any] = dataclasses.field(repr=False)
    transforms: list[str]
    feeds: list[str]
    tensors: list[str]
    what: str
    slots: list = dataclasses.field(default_factory=list, repr=False)
    datas: list = dataclasses.field(default_factory=list, repr=False)


@dataclasses.dataclass
class WeightMap:
    """The placements of every checkpoint tensor the dry run mapped, the
    reason for each it could not, the tensors this worker holds none of
    (``skipped``, with the reason), and the parameters' layout when the map
    was learned. ``groups``: for a tensor its loader takes only together
    with others (two projections fused once both are there, every tensor of
    a parameter a post-load step rewrites), all of them, in checkpoint
    order: the stock path loads them in one call. ``joint``: for a mapped
    tensor its loader writes only together with others, all of them (a
    whole tensor is written into its placement, not given to the loader
    alone). ``steps``: the post-load steps to run again after the tensors
    they read change (``steps_of``: tensor -> step names). ``refused``:
    tensors no path keeps right, with why (the model is refused)."""

    placements: dict[str, Placement]
    unmapped: dict[str, str]
    skipped: dict[str, str] = dataclasses.field(default_factory=dict)
    layout: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)
    groups: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    joint: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    steps: list[PostLoadStep] = dataclasses.field(default_factory=list)
    steps_of: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    refused: dict[str, str] = dataclasses.field(default_factory=dict)

    def report(self) -> str:
        """A few lines: how many tensors were mapped and skipped, and why each
        other was not mapped."""
        lines = [f"{len(self.placements)} tensors mapped into parameters, "
                 f"{len(self.unmapped)} through the stock load_weights path, "
                 f"{len(self.skipped)} held by no parameter of this worker"]
        for name, why in sorted(self.unmapped.items()):
            lines.append(f"  {name}: {why}")
        for st in self.steps:
            lines.append(f"  post-load step {st.name} runs again after a change to "
                         f"{len(st.tensors)} tensors ({st.what})")
        return "\n".join(lines)

    def moved(self, model: torch.nn.Module) -> dict[str, str]:
        """The parameters and buffers of ``model`` that are no longer where the
        map was learned (replaced, moved, freed, added or gone), with why."""
        now = dict(model.named_parameters())
        for n, b in model.named_buffers():
            now.setdefault(n, b)
        out = {}
        for name, w in self.layout.items():
            if name not in now:
                out[name] = "it is gone"
                continue
            why = w.changed(now[name])
            if why:
                out[name] = why
        for name in now:
            if name not in self.layout:
                out[name] = "a new parameter"
        return out


# --- what a dry run may and may not do ----------------------------------------

class _Copy:
    __slots__ = ("dst", "src")

    def __init__(self, dst: torch.Tensor, src: Any) -> None:
        self.dst = dst
        self.src = src


def _tensors(x: Any) -> Iterable[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from _tensors(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from _tensors(y)


# Operations that change a tensor's size or memory rather than its values:
# even a tensor with no memory yet is changed by them.
_RESHAPING = ("aten::set_", "aten::resize_", "aten::resize_as_", "aten::as_strided_",
              "aten::_resize_output_", "aten::resize_as_sparse_")


class _Op:
    """What one ATen operation writes and returns, read from its schema once."""

    __slots__ = ("name", "args", "write", "view", "copy", "fill", "reshaping", "lift", "ret")

    def __init__(self, func: Any) -> None:
        s = func._schema
        self.name = str(func)
        self.args = [a.name for a in s.arguments]
        self.write = [i for i, a in enumerate(s.arguments)
                      if a.alias_info is not None and a.alias_info.is_write]
        self.view = not self.write and any(r.alias_info is not None for r in s.returns)
        self.copy = func is torch.ops.aten.copy_.default
        # A constant written over elements: no change where they hold it already.
        self.fill = str(func) in ("aten.fill_.Scalar", "aten.zero_.default")
        self.reshaping = s.name in _RESHAPING
        self.lift = s.name.startswith("aten::lift")
        self.ret = []
        for r in s.returns:
            idx = None
            if r.alias_info is not None and r.alias_info.is_write:
                alias = r.alias_info.before_set
                for i, a in enumerate(s.arguments):
                    if a.alias_info is not None and a.alias_info.before_set == alias:
                        idx = i
                        break
            self.ret.append(idx)

    def arg(self, i: int, args: tuple, kwargs: dict) -> Any:
        return args[i] if i < len(args) else kwargs.get(self.args[i])

    def fill_value(self, args: tuple, kwargs: dict) -> Any:
        return 0 if self.name == "aten.zero_.default" else self.arg(1, args, kwargs)

    def result(self, args: tuple, kwargs: dict) -> Any:
        """What the operation returns without running: the tensors it writes."""
        if any(i is None for i in self.ret):
            raise RuntimeError(f"deltasync dry run: {self.name} refused")
        vals = [self.arg(i, args, kwargs) for i in self.ret]
        if not vals:
            return None
        return vals[0] if len(vals) == 1 else tuple(vals)


def _holds(t: torch.Tensor, value: Any) -> bool:
    """Whether every element of ``t`` has the bits of ``value`` already (then
    writing it changes nothing: a loader zeroing the padding rows of an
    embedding it loaded before)."""
    want = torch.full((1,), value, dtype=t.dtype, device=t.device).view(torch.uint8)
    have = t.detach().reshape(-1).view(torch.uint8).reshape(-1, want.numel())
    return bool((have == want).all())


def _same_geometry(op: _Op, t: torch.Tensor, args: tuple, kwargs: dict) -> bool:
    """Whether a reshaping operation gives ``t`` the sizes and strides it has."""
    if op.name.startswith("aten.as_strided_"):
        size, stride = op.arg(1, args, kwargs), op.arg(2, args, kwargs)
        offset = op.arg(3, args, kwargs) if len(op.args) > 3 else None
        return (list(size) == list(t.shape) and list(stride) == list(t.stride())
                and (offset is None or int(offset) == t.storage_offset()))
    if op.name.startswith("aten.resize_"):
        return list(op.arg(1, args, kwargs)) == list(t.shape) and t.is_contiguous()
    return False


_OPS: dict = {}


def _op(func: Any) -> _Op:
    op = _OPS.get(func)
    if op is None:
        op = _Op(func)
        _OPS[func] = op
    return op


_SIMPLE = (bool, int, float, str, bytes, type(None))


def _same(old: Any, new: Any) -> bool:
    """Setting ``new`` over ``old`` changes nothing."""
    if old is new:
        return True
    return type(old) is type(new) and isinstance(old, _SIMPLE) and old == new


_MISSING = object()

# Operations that only move elements: the same call on tensors of element ids
# says where each element of the result came from.
_MOVES = ("aten.cat.default", "aten.stack.default", "aten.clone.default", "aten.flip.default")


class _Write:
    """A write into memory that existed before the dry run (refused, or
    recorded as a copy): ``param`` names the parameter it targets (None for
    other memory or a module attribute), ``old`` what the target held and
    ``value`` what was written; ``deps`` the parameters ``value`` was
    computed from."""

    __slots__ = ("kind", "what", "param", "owner", "name", "old", "value", "deps")

    def __init__(self, kind: str, what: str, param: Optional[str], owner: Any, name: str,
                 old: Any, value: Any, deps: frozenset) -> None:
        self.kind = kind  # "copy", "op" (another in-place operation), "data", "attr"
        self.what = what
        self.param = param
        self.owner = owner
        self.name = name
        self.old = old
        self.value = value
        self.deps = deps


class _Session:
    """One dry run: the probes it gives the loader (by memory), what the
    loader copied from them, what it was refused, and the memory it made.

    With ``mirrors`` (memory key -> (element ids over that memory, element
    size)) it follows the probes' elements through operations that only move
    them (``_MOVES``, and copies into memory the loader made): a copy of such
    a result into a parameter is then a placement too. With ``track`` it
    records every write into memory that existed before and which
    parameters each value was computed from (a post-load step's dry run)."""

    def __init__(self, probes: dict, params: dict, modules: set, weights: set, *,
                 mirrors: Optional[dict] = None, track: bool = False) -> None:
        self.probes = probes  # memory key -> checkpoint name
        self.params = params  # memory key -> (parameter name, parameter)
        self.modules = modules  # ids of the model's modules
        self.weights = weights  # ids of the model's parameters and buffers
        self.cond = threading.Condition()
        self.fresh: set = set()
        self.copies: list[_Copy] = []
        self.refused: list[str] = []
        self.used: dict[str, str] = {}  # probe name -> the first operation that read its values
        self.changed: set = set()  # probes the loader wrote into
        self.together: list[set] = []  # probes one operation read at once
        self.pending = 0  # work on other threads not finished
        self.targets: set = set()  # parameters a write targeted
        self.seen: set = set()  # parameters an operation took as input (a view of one too)
        self.mirrors = mirrors
        self.sources: dict = {}  # loader-made memory key -> probe names whose elements it holds
        self.track = track
        self.deps: dict = {}  # loader-made memory key -> parameters its values come from
        self.reads: set = set()  # keys of memory that existed before, read by an operation
        self.writes: list[_Write] = []

    # -- bookkeeping

    def refuse(self, why: str) -> None:
        with self.cond:
            self.refused.append(why)

    def deps_of(self, tensors: Iterable[torch.Tensor]) -> frozenset:
        """The parameters whose values ``tensors`` hold or were computed from."""
        out: set = set()
        for t in tensors:
            k = _key(t)
            hit = self.params.get(k)
            if hit is not None:
                out.add(hit[0])
            else:
                out |= self.deps.get(k, frozenset())
        return frozenset(out)

    def note(self, kind: str, what: str, target: Any, owner: Any = None, name: str = "",
             old: Any = None, value: Any = None, deps: Iterable = ()) -> None:
        """Records a write into memory that existed before: ``target`` is the
        memory written ("copy", "op") or the tensor replaced ("data",
        "attr": a parameter or buffer only if it is one of the model's)."""
        hit = None
        if isinstance(target, torch.Tensor) and (kind in ("copy", "op")
                                                 or id(target) in self.weights):
            hit = self.params.get(_key(target))
        with self.cond:
            if hit is not None:
                self.targets.add(hit[0])
            if self.track:
                self.writes.append(_Write(kind, what, hit[0] if hit else None, owner, name, old,
                                          value, frozenset(deps)))

    # -- following elements through operations that only move them

    def ids_of(self, t: torch.Tensor) -> Optional[torch.Tensor]:
        """The element ids ``t`` holds (None when its memory is not followed)."""
        hit = self.mirrors.get(_key(t)) if self.mirrors is not None else None
        if hit is None or hit[1] != t.element_size():
            return None
        return hit[0].as_strided(tuple(t.shape), tuple(t.stride()), t.storage_offset())

    def mirror_for(self, t: torch.Tensor) -> torch.Tensor:
        k = _key(t)
        hit = self.mirrors.get(k)
        if hit is None or hit[1] != t.element_size():
            n = _storage(t).nbytes() // t.element_size()
            hit = (torch.full((n,), -1, dtype=torch.int64), t.element_size())
            self.mirrors[k] = hit
        return hit[0].as_strided(tuple(t.shape), tuple(t.stride()), t.storage_offset())

    def follow_copy(self, dst: torch.Tensor, src: Any) -> None:
        """A copy into the loader's own memory: which elements it now holds."""
        ids = self.ids_of(src) if isinstance(src, torch.Tensor) else None
        if ids is None and _key(dst) not in self.mirrors:
            return
        target = self.mirror_for(dst)
        if ids is not None and src.dtype == dst.dtype:
            try:
                target.copy_(ids.expand(tuple(dst.shape)))
            except RuntimeError:
                target.fill_(-1)
            with self.cond:
                self.sources[_key(dst)] = (self.sources.get(_key(dst), frozenset())
                                           | self.sources.get(_key(src), frozenset()))
        else:
            target.fill_(-1)  # values not followed (converted, or of no probe)

    def replay(self, func: Any, args: tuple, kwargs: dict, out: Any, inputs: list) -> bool:
        """Runs an operation of ``_MOVES`` again on element ids: its result's
        elements are then followed. False if that cannot be done."""
        if not isinstance(out, torch.Tensor):
            return False

        def ids(x: Any) -> Any:
            if isinstance(x, torch.Tensor):
                got = self.ids_of(x)
                if got is None:
                    if _key(x) in self.mirrors:
                        raise ValueError("another element size")
                    return torch.full(tuple(x.shape), -1, dtype=torch.int64)
                return got
            if isinstance(x, (list, tuple)):
                return type(x)(ids(y) for y in x)
            return x

        try:
            got = func(*ids(args), **{k: ids(v) for k, v in kwargs.items()})
        except (ValueError, RuntimeError, TypeError):
            return False
        if not isinstance(got, torch.Tensor) or tuple(got.shape) != tuple(out.shape):
            return False
        self.mirror_for(out).copy_(got)
        srcs: frozenset = frozenset()
        for t in inputs:
            srcs = srcs | self.sources.get(_key(t), frozenset())
        with self.cond:
            self.sources[_key(out)] = srcs
        return True

    def describe(self, t: torch.Tensor) -> str:
        hit = self.params.get(_key(t))
        if hit is not None:
            return f"parameter {hit[0]}"
        return "a tensor that is not a parameter"

    def wrap(self, fn: Callable) -> Callable:
        """``fn`` running under this dry run on whichever thread runs it."""
        grad = torch.is_grad_enabled()
        with self.cond:
            self.pending += 1

        def run(*args: Any, **kwargs: Any) -> Any:
            prev = getattr(_LOCAL, "session", None)
            _LOCAL.session = self
            try:
                with torch.set_grad_enabled(grad), _Intercept(self):
                    return fn(*args, **kwargs)
            finally:
                _LOCAL.session = prev
                with self.cond:
                    self.pending -= 1
                    self.cond.notify_all()

        return run

    def abandon(self) -> None:
        """A wrapped piece of work that will never run."""
        with self.cond:
            self.pending -= 1
            self.cond.notify_all()

    def settle(self, timeout_s: float) -> bool:
        """Waits for work the loader left on other threads; False if some is
        still running."""
        with self.cond:
            return self.cond.wait_for(lambda: self.pending == 0, timeout_s)

    # -- the dispatcher

    def dispatch(self, func: Any, args: tuple, kwargs: dict) -> Any:
        op = _op(func)
        targets: list = []
        if op.write:
            theirs = []
            for i in op.write:
                for t in _tensors(op.arg(i, args, kwargs)):
                    targets.append(t)
                    k = _key(t)
                    if k in self.probes:
                        with self.cond:
                            self.changed.add(self.probes[k])
                    elif t.numel() == 0:
                        # An in-place operation on no elements writes nothing,
                        # but one that sizes it (set_, resize_, an out=
                        # argument) changes it.
                        if op.reshaping or i != 0:
                            theirs.append(t)
                    elif k not in self.fresh:
                        theirs.append(t)
            if not theirs and targets and all(t.numel() == 0 for t in targets):
                return func(*args, **kwargs)  # no element written, none read
            if theirs:
                rest = [t for t in _tensors((args, kwargs)) if not any(t is w for w in targets)]
                if op.copy:
                    src = op.arg(1, args, kwargs)
                    with self.cond:
                        self.copies.append(_Copy(args[0], src))
                    for t in theirs:
                        self.note("copy", f"copy_ into {self.describe(t)}", t, owner=t,
                                  value=src, deps=self.deps_of(rest))
                elif op.reshaping and all(_same_geometry(op, t, args, kwargs) for t in theirs):
                    pass  # the sizes and strides it has already: nothing changes
                elif not (op.fill and all(_holds(t, op.fill_value(args, kwargs)) for t in theirs)):
                    self.refuse(f"its loader writes into {self.describe(theirs[0])} "
                                f"with {op.name}")
                    for t in theirs:
                        self.note("op", f"{op.name} on {self.describe(t)}", t, owner=t,
                                  deps=self.deps_of(rest))
                return op.result(args, kwargs)
            if self.mirrors is not None and op.copy:
                self.follow_copy(args[0], op.arg(1, args, kwargs))
                return func(*args, **kwargs)
        inputs = [t for t in _tensors((args, kwargs)) if not any(t is w for w in targets)]
        in_keys = {_key(t) for t in inputs}
        hits = [self.params[k][0] for k in in_keys if k in self.params]
        if hits:
            with self.cond:
                self.seen.update(hits)
        read: set = set()
        if not op.view:
            for k in in_keys:
                if k in self.probes:
                    read.add(self.probes[k])
                read |= self.sources.get(k, frozenset())
        out = func(*args, **kwargs)
        outs = list(_tensors(out))
        if read and op.name in _MOVES and self.mirrors is not None and not op.write:
            if self.replay(func, args, kwargs, out, inputs):
                read = set()  # elements moved, not values read
        if read:
            # Reading a probe's values: anything but another view of it.
            if not isinstance(out, (torch.Tensor, list, tuple)) or not outs or any(
                    _key(o) not in in_keys for o in outs):
                with self.cond:
                    for name in read:
                        self.used.setdefault(name, op.name)
                    if len(read) > 1:
                        self.together.append(set(read))
        deps = self.deps_of(inputs) if self.track and not op.view else frozenset()
        if self.track and not op.view:
            with self.cond:
                self.reads |= {k for k in in_keys if k[2] != 0 and k not in self.fresh}
        if op.write:
            # A write into the loader's own memory may give it new memory.
            with self.cond:
                for t in targets:
                    k = _key(t)
                    if k[2] != 0 and k not in self.probes:
                        self.fresh.add(k)
                        if deps:
                            self.deps[k] = self.deps.get(k, frozenset()) | deps
                        if self.mirrors is not None and k in self.mirrors:
                            self.mirrors.pop(k)  # its elements no longer followed
                            for name in self.sources.pop(k, ()):
                                self.used.setdefault(name, op.name)
        elif op.lift or not op.view:
            seen = set() if op.lift else in_keys
            with self.cond:
                for o in outs:
                    k = _key(o)
                    if k[2] != 0 and k not in seen:
                        self.fresh.add(k)
                        if deps:
                            self.deps[k] = deps
        return out

    # -- attribute writes

    def tensor_setattr(self, t: torch.Tensor, name: str, value: Any) -> bool:
        """Whether setting ``t.<name> = value`` may run."""
        if name == "data":
            k = _key(t)
            if k in self.probes:
                with self.cond:
                    self.changed.add(self.probes[k])
                return True
            if k in self.fresh or (k[2] == 0 and t.numel() == 0 and id(t) not in self.weights):
                return True
            if (isinstance(value, torch.Tensor) and value.data_ptr() == t.data_ptr()
                    and value.shape == t.shape and value.stride() == t.stride()
                    and value.dtype == t.dtype):
                return True  # the same memory: nothing changes
            self.refuse(f"its loader replaces the memory of {self.describe(t)} (.data = ...)")
            self.note("data", f"replaces the memory of {self.describe(t)} (.data = ...)", t,
                      owner=t, name="data", old=t,
                      value=value, deps=self.deps_of(_tensors(value)))
            return False
        if id(t) not in self.weights:
            return True
        if _same(getattr(t, name, _MISSING), value):
            return True
        self.refuse(f"its loader sets attribute {name} of {self.describe(t)}")
        return False

    def module_write(self, m: torch.nn.Module, name: str, value: Any, what: str) -> bool:
        """Whether ``what`` (setting ``m.<name>`` to ``value``, or deleting it
        when ``value`` is _MISSING) may run."""
        if id(m) not in self.modules:
            return True
        if value is not _MISSING:
            old = _MISSING
            for d in ("_parameters", "_buffers", "_modules"):
                table = m.__dict__.get(d)
                if table is not None and name in table:
                    old = table[name]
                    break
            else:
                old = m.__dict__.get(name, _MISSING)
            if old is not _MISSING and _same(old, value):
                return True
        self.refuse(f"its loader {what} {name} of module {type(m).__name__}")
        old = _attribute(m, name)
        self.note("attr", f"{what} {name} of module {type(m).__name__}", old, owner=m, name=name,
                  old=old, value=value, deps=self.deps_of(_tensors(value)))
        return False


def _attribute(m: torch.nn.Module, name: str) -> Any:
    """What attribute ``name`` of module ``m`` holds (_MISSING if none)."""
    for d in ("_parameters", "_buffers", "_modules"):
        table = m.__dict__.get(d)
        if table is not None and name in table:
            return table[name]
    return m.__dict__.get(name, _MISSING)


class _Intercept(TorchDispatchMode):
    def __init__(self, session: _Session) -> None:
        super().__init__()
        self.session = session

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: Optional[dict] = None) -> Any:
        return self.session.dispatch(func, args, kwargs or {})


# One dry run at a time in a process: the hooks below are process-wide while
# it runs, and pass everything through on any thread it does not run on.
_LOCK = threading.Lock()
_LOCAL = threading.local()


def _session() -> Optional[_Session]:
    return getattr(_LOCAL, "session", None)


_REAL_SUBMIT = concurrent.futures.ThreadPoolExecutor.submit
_REAL_START = threading.Thread.start
_MODULE = torch.nn.Module
_REAL_MODULE = {n: getattr(_MODULE, n) for n in
                ("__setattr__", "__delattr__", "register_parameter", "register_buffer",
                 "add_module")}
_TENSOR_SETATTR = torch.Tensor.__dict__.get("__setattr__")
_REAL_TENSOR_SETATTR = torch.Tensor.__setattr__


def _submit(self: Any, fn: Callable, /, *args: Any, **kwargs: Any) -> Any:
    s = _session()
    if s is None:
        return _REAL_SUBMIT(self, fn, *args, **kwargs)
    try:
        return _REAL_SUBMIT(self, s.wrap(fn), *args, **kwargs)
    except BaseException:
        s.abandon()
        raise


def _start(self: threading.Thread) -> None:
    s = _session()
    # A pool's worker thread outlives the dry run: its tasks are wrapped
    # one by one (_submit) instead.
    if s is None or getattr(self, "_target", None) is concurrent.futures.thread._worker:
        return _REAL_START(self)
    inner = self.run

    def run() -> None:
        try:
            inner()
        finally:
            self.__dict__.pop("run", None)  # no cycle through the thread

    self.run = s.wrap(run)  # type: ignore[method-assign]
    try:
        return _REAL_START(self)
    except BaseException:
        s.abandon()
        raise


def _tensor_setattr(self: torch.Tensor, name: str, value: Any) -> None:
    s = _session()
    if s is not None and not s.tensor_setattr(self, name, value):
        return
    _REAL_TENSOR_SETATTR(self, name, value)


def _module_setattr(self: torch.nn.Module, name: str, value: Any) -> None:
    s = _session()
    if s is None or s.module_write(self, name, value, "sets"):
        _REAL_MODULE["__setattr__"](self, name, value)


def _module_delattr(self: torch.nn.Module, name: str) -> None:
    s = _session()
    if s is None or s.module_write(self, name, _MISSING, "deletes"):
        _REAL_MODULE["__delattr__"](self, name)


def _module_register(kind: str) -> Callable:
    real = _REAL_MODULE[kind]

    def register(self: torch.nn.Module, name: str, value: Any, *args: Any, **kwargs: Any) -> Any:
        s = _session()
        if s is None or s.module_write(self, name, value, f"({kind})"):
            return real(self, name, value, *args, **kwargs)
        return None

    return register


@contextlib.contextmanager
def _hooks() -> Any:
    """The process-wide hooks of a dry run (under _LOCK)."""
    concurrent.futures.ThreadPoolExecutor.submit = _submit  # type: ignore[method-assign]
    threading.Thread.start = _start  # type: ignore[method-assign]
    torch.Tensor.__setattr__ = _tensor_setattr  # type: ignore[method-assign,assignment]
    _MODULE.__setattr__ = _module_setattr  # type: ignore[method-assign,assignment]
    _MODULE.__delattr__ = _module_delattr  # type: ignore[method-assign,assignment]
    for kind in ("register_parameter", "register_buffer", "add_module"):
        setattr(_MODULE, kind, _module_register(kind))
    try:
        yield
    finally:
        concurrent.futures.ThreadPoolExecutor.submit = _REAL_SUBMIT  # type: ignore[method-assign]
        threading.Thread.start = _REAL_START  # type: ignore[method-assign]
        if _TENSOR_SETATTR is None:
            del torch.Tensor.__setattr__
        else:
            torch.Tensor.__setattr__ = _TENSOR_SETATTR  # type: ignore[method-assign]
        for n, f in _REAL_MODULE.items():
            setattr(_MODULE, n, f)


class _Outcome:
    __slots__ = ("error", "copies", "refused", "used", "changed", "together", "left_running",
                 "targets", "writes", "reads")

    # ``targets``: the parameters its writes targeted, and those an operation
    # took as input (the parameters a loader went for).

    def __init__(self, session: _Session, error: Optional[BaseException], left_running: bool):
        with session.cond:  # taken from the session: work still running sees none of it
            self.copies, session.copies = session.copies, []
            self.writes, session.writes = session.writes, []
            self.refused = list(session.refused)
            self.used = dict(session.used)
            self.changed = set(session.changed)
            self.together = list(session.together)
            self.targets = set(session.targets) | set(session.seen)
            self.reads = set(session.reads)
        self.error = error
        self.left_running = left_running


_SETTLE_S = 30.0


def _dry_run(loader: Callable, pairs: list, session: _Session) -> _Outcome:
    """Runs ``loader(pairs)`` under ``session`` on this thread and on every
    thread it hands work to."""
    error = None
    _LOCAL.session = session
    try:
        with torch.no_grad(), _Intercept(session):
            loader(pairs)
    except Exception as e:  # the loader refused a probe: the stock path
        error = e
    finally:
        _LOCAL.session = None
    left_running = not session.settle(_SETTLE_S)
    e = error
    while e is not None:  # the frames of a traceback hold the probes
        e.__traceback__ = None
        e = e.__cause__ or e.__context__
    return _Outcome(session, error, left_running)


def _released(ref: Any) -> bool:
    """Whether nothing holds the probe's memory any more (a cycle is
    collected before saying no)."""
    if ref.expired():
        return True
    gc.collect(1)  # a cycle made during the dry run is young
    return ref.expired()


# --- the parameters before and after --------------------------------------------

_FINGERPRINT_BYTES = 1 << 22


class _Fingerprints:
    """Two numbers per tensor that change when any of its bytes does: the
    bytes summed plain and weighted by position (in pieces of a few MiB, so
    that a large parameter needs little memory beside it)."""

    def __init__(self) -> None:
        self._weights: dict = {}

    def __call__(self, t: torch.Tensor) -> tuple:
        if t.device.type not in ("cpu", "cuda") or t.numel() == 0:
            return (0, 0)
        with torch.no_grad():
            flat = t.detach()
            if not flat.is_contiguous():
                flat = flat.contiguous()
            b = flat.reshape(-1).view(torch.uint8)
            n = min(b.numel(), _FINGERPRINT_BYTES)
            w = self._weights.get(b.device)
            if w is None or w.numel() < n:
                w = torch.arange(n, dtype=torch.int64, device=b.device) % 65521 + 1
                self._weights[b.device] = w
            acc = torch.zeros(2, dtype=torch.int64, device=b.device)
            for chunk in b.split(_FINGERPRINT_BYTES):
                c = chunk.to(torch.int64)
                acc[0] += c.sum()
                acc[1] += (c * w[: c.numel()]).sum()
            return tuple(int(x) for x in acc.tolist())


class _Guard:
    """The model's parameters and buffers before a dry run: the module
    tables holding them, their memory, and (``verify``) a fingerprint of
    their bytes, to put back and to check after it."""

    def __init__(self, model: torch.nn.Module, named: list, verify: bool) -> None:
        self.tables = []
        for m in model.modules():
            for d in ("_parameters", "_buffers"):
                table = m.__dict__.get(d)
                if table is not None:
                    self.tables.append((table, dict(table)))
        self.weights = []
        self.names: dict[int, str] = {}
        for pname, p in named:
            if id(p) in self.names:
                continue
            self.names[id(p)] = pname
            self.weights.append((pname, p, p.data, _Weight(pname, p, [])))
        self.fingerprint = _Fingerprints() if verify else None
        self.prints = ({pname: self.fingerprint(p) for pname, p, _, _ in self.weights}
                       if verify else None)

    def restore(self) -> set[str]:
        """Puts back what a write no hook saw replaced (a module table's
        entry, a parameter's memory); returns those parameters' names."""
        out = set()
        for table, before in self.tables:
            for k, v in before.items():
                if table.get(k) is not v:
                    table[k] = v
                    out.add(self.names.get(id(v), k))
            for k in [k for k in table if k not in before]:
                del table[k]
                out.add(k)
        for pname, p, alias, w in self.weights:
            if w.changed() is not None:
                p.data = alias
                out.add(pname)
        return out

    def changed(self) -> list[str]:
        """The parameters whose bytes are not what they were."""
        if self.prints is None:
            return []
        return [pname for pname, p, _, _ in self.weights
                if self.fingerprint(p) != self.prints[pname]]


def _slots(model: torch.nn.Module) -> dict[int, list]:
    """For each parameter and buffer object, the module tables holding it."""
    out: dict[int, list] = {}
    for m in model.modules():
        for d in ("_parameters", "_buffers"):
            table = m.__dict__.get(d)
            if table is None:
                continue
            for k, v in table.items():
                if v is not None:
                    out.setdefault(id(v), []).append((table, k))
    return out


# --- a recorded copy as destination runs -------------------------------------------

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


def _offsets(t: torch.Tensor) -> np.ndarray:
    """The storage offsets of ``t``'s elements, in its row-major order."""
    off = np.array([t.storage_offset()], dtype=np.int64)
    for n, st in zip(t.shape, t.stride()):
        off = (off[:, None] + np.arange(n, dtype=np.int64)[None, :] * st).reshape(-1)
    return off


def _pair_runs(pos: np.ndarray, dest: np.ndarray) -> np.ndarray:
    """Runs for checkpoint elements ``pos`` written at parameter elements
    ``dest`` (one each), before _coalesce joins what continues."""
    if pos.size == 0:
        return np.zeros((0, 4), dtype=np.int64)
    order = np.argsort(pos, kind="stable")
    pos, dest = pos[order], dest[order]
    n = pos.size
    brk = np.ones(n, dtype=bool)
    if n > 1:
        dp, dd = np.diff(pos), np.diff(dest)
        cont = (dp == 1) & (dd > 0)
        cont[1:] &= ~cont[:-1] | (dd[1:] == dd[:-1])  # one stride within a run
        brk[1:] = ~cont
    starts = np.flatnonzero(brk)
    counts = np.diff(np.append(starts, n))
    nxt = np.minimum(starts + 1, n - 1)
    strides = np.where(counts > 1, dest[nxt] - dest[starts], 1)
    return np.stack([pos[starts], counts, dest[starts], strides], axis=1).astype(np.int64)


def _traced_runs(c: _Copy, session: _Session, base: int, numel: int, param: torch.Tensor,
                 pname: str) -> np.ndarray:
    """The runs of one checkpoint tensor (element ids ``base`` ..
    ``base+numel-1``) in a recorded copy of memory the loader made from
    the probes (a concatenation of two of them)."""
    src, dst = c.src, c.dst
    if src.dtype != dst.dtype:
        raise ValueError(f"the loader converts {src.dtype} to {dst.dtype}")
    ids = session.ids_of(src)
    if ids is None:
        raise ValueError("its loader copies a computed tensor, not its elements")
    shape = tuple(dst.shape)
    try:
        ids = ids.expand(shape)
    except RuntimeError:
        raise ValueError(f"a copy of shape {list(src.shape)} into {list(shape)}") from None
    for d, n in enumerate(shape):
        if n > 1 and ids.stride(d) == 0:
            raise ValueError("the loader broadcasts one element to several places")
    flat = ids.reshape(-1).numpy()
    if (flat < 0).any():
        raise ValueError(f"its loader copies into parameter {pname} values that are not the "
                         "checkpoint's")
    dest = _offsets(dst) - param.storage_offset()
    sel = (flat >= base) & (flat < base + numel)
    return _pair_runs(flat[sel] - base, dest[sel])


def _placement(name: str, probe: torch.Tensor, copies: list, params: dict,
               layout: dict, trace: Optional[tuple] = None) -> Placement:
    """The placement of one probe from the copies a dry run recorded. With
    ``trace`` ((session, id base) of a dry run that followed the probes'
    elements), only the copies that hold some of this probe's elements
    count, and those of memory the loader made count too."""
    probe_key = _key(probe)
    target = None
    all_runs = []
    for c in copies:
        if trace is not None:
            if not isinstance(c.src, torch.Tensor):
                continue
            sk = _key(c.src)
            if sk != probe_key and name not in trace[0].sources.get(sk, ()):
                continue
        hit = params.get(_key(c.dst))
        if hit is None:
            raise ValueError("its loader copies into a tensor that is not a parameter "
                             "(a weight derived after loading)")
        if not isinstance(c.src, torch.Tensor) or (_key(c.src) != probe_key and trace is None):
            raise ValueError("its loader copies a computed tensor, not a view of it")
        pname, param = hit
        if target is not None and target[0] != pname:
            raise ValueError(f"its loader copies into two parameters ({target[0]}, {pname})")
        if not param.is_contiguous():
            raise ValueError(f"parameter {pname} is not contiguous")
        target = (pname, param)
        if _key(c.src) == probe_key:
            all_runs.append(_copy_runs(c, probe, param))
        else:
            all_runs.append(_traced_runs(c, trace[0], trace[1], probe.numel(), param, pname))
    if target is None:
        raise ValueError("its loader copies none of it")
    runs = _coalesce(np.concatenate(all_runs)) if all_runs else np.zeros((0, 4), np.int64)
    pname, param = target
    last = runs[:, 2] + (runs[:, 1] - 1) * runs[:, 3]
    if len(runs) and (runs[:, 2].min() < 0 or last.max() >= param.numel()):
        raise ValueError(f"its runs leave parameter {pname}")
    return Placement(name, dtype_name(probe), list(probe.shape), pname, param, runs,
                     _weight=layout.get(pname))


def _covered(placements: list, param: torch.Tensor) -> bool:
    """Whether ``placements`` write every element of ``param`` once."""
    seen = np.zeros(param.numel(), dtype=bool)
    for pl in placements:
        for first, count, offset, stride in pl.runs.tolist():
            if count <= 0:
                continue
            part = seen[offset: offset + (count - 1) * stride + 1: stride]
            if part.any():
                return False
            part[:] = True
    return bool(seen.all())


# --- learn ---------------------------------------------------------------------------

def _expanded(dtype: torch.dtype, shape: list, device: Any) -> torch.Tensor:
    """A tensor of ``shape`` over one element of memory."""
    return torch.empty([1] * len(shape), dtype=dtype, device=device).expand(shape)


def learn(
    model: torch.nn.Module,
    checkpoint: Iterable[tuple[str, Any, Any]],
    load_weights: Optional[Callable[[list], Any]] = None,
    device: Any = None,
    *,
    verify: bool = True,
    post_load: Iterable[tuple[str, Any, Callable[[], Any]]] = (),
) -> WeightMap:
    """Learns where each checkpoint tensor lands in ``model``'s parameters.

    ``checkpoint`` lists every checkpoint tensor as (name, dtype, shape)
    with a torch dtype or a safetensors name; ``load_weights`` is the
    engine's loader (default ``model.load_weights``). Nothing in the model
    is written (see the module's description); with ``verify`` (the
    default) every parameter and buffer is fingerprinted before and after,
    and InternalError names any whose bytes changed. ``device`` is where
    probe tensors are made (default: the parameters' device, as the engines
    pass tensors already moved there). ``post_load`` lists the steps the
    engine runs after loading, as (name, module, run) (see the module's
    description: :attr:`WeightMap.steps`).
    """
    from .engine import torch_dtype

    loader = load_weights or model.load_weights
    named = list(model.named_parameters()) + list(model.named_buffers())
    slots = _slots(model)
    layout: dict[str, _Weight] = {}
    params: dict = {}
    for pname, p in named:
        if pname not in layout:
            layout[pname] = _Weight(pname, p, slots.get(id(p), []))
        params.setdefault(_key(p), (pname, p))
    modules = {id(m) for m in model.modules()}
    weights = {id(p) for _, p in named}
    if device is None:
        device = named[0][1].device if named else torch.device("cpu")
    placements: dict[str, Placement] = {}
    unmapped: dict[str, str] = {}
    skipped: dict[str, str] = {}
    touches: dict[str, set] = {}  # tensors of the stock path -> parameters their loader writes
    specs: dict[str, tuple] = {}
    alone: list[tuple[str, torch.dtype, list]] = []  # copy nothing when given alone
    joint: dict[str, list[str]] = {}
    steps: list[PostLoadStep] = []
    refused: dict[str, str] = {}
    with _LOCK:
        guard = _Guard(model, named, verify)
        with _hooks():
            for name, dtype, shape in checkpoint:
                tdtype = torch_dtype(dtype) if isinstance(dtype, str) else dtype
                shape = [int(x) for x in shape]
                specs[name] = (tdtype, shape)
                if int(np.prod(shape, dtype=np.int64)) == 0:
                    skipped[name] = "it has no elements"
                    continue
                why, placement, targets = _one(loader, name, tdtype, shape, device, params,
                                               modules, weights, layout)
                if why is not None:
                    unmapped[name] = why
                    touches[name] = targets
                elif placement is not None:
                    placements[name] = placement
                else:
                    alone.append((name, tdtype, shape))
            groups: dict[str, list[str]] = {}
            if alone:
                _together(loader, alone, device, params, modules, weights, unmapped, skipped,
                          groups, touches)
            seen: set = set()
            for name, group in list(groups.items()):
                if name in seen:
                    continue
                seen.update(group)
                got = _joint(loader, [(n, *specs[n]) for n in group], device, params, modules,
                             weights, layout)
                if got is not None:
                    for n in group:
                        placements[n] = got[n]
                        del unmapped[n], groups[n]
                        touches.pop(n, None)
                        joint[n] = list(group)
            if post_load:
                steps = _post_load(list(post_load), list(specs), params, modules, weights,
                                   placements, unmapped, touches, groups, joint, refused)
        replaced = guard.restore()
        if replaced:
            # A write no hook saw: nothing maps into those parameters, and
            # nothing counts as held by no parameter.
            for name, pl in list(placements.items()):
                if pl.param_name in replaced:
                    del placements[name]
                    joint.pop(name, None)
                    unmapped[name] = f"a dry run replaced parameter {pl.param_name}"
            for name in [n for n, why in skipped.items() if why != "it has no elements"]:
                del skipped[name]
                unmapped[name] = (f"a dry run replaced {', '.join(sorted(replaced))} unseen: "
                                  "not taken as held by no parameter")
        changed = guard.changed()
    if changed:
        raise InternalError(
            f"deltasync: the dry run of load_weights changed parameter {changed[0]} "
            f"({len(changed)} in all): its loader writes where the dry run cannot see it (a "
            "thread it neither started nor handed work to through ThreadPoolExecutor.submit); "
            "the weights must be loaded again")
    steps_of: dict[str, list[str]] = {}
    for st in steps:
        for n in st.tensors:
            steps_of.setdefault(n, []).append(st.name)
    return WeightMap(placements, unmapped, skipped, layout, groups, joint, steps, steps_of,
                     refused)


def _one(loader: Callable, name: str, tdtype: torch.dtype, shape: list, device: Any,
         params: dict, modules: set, weights: set, layout: dict
         ) -> tuple[Optional[str], Optional[Placement], set]:
    """The dry run of one tensor: (why it takes the stock path, None) or
    (None, its placement) or (None, None) when it copies none of it, and
    the parameters its loader wrote into (or tried to)."""
    probe = torch.empty(shape, dtype=tdtype, device=device)
    ref = StorageWeakRef(_storage(probe))
    out = _dry_run(loader, [(name, probe)], _Session({_key(probe): name}, params, modules,
                                                      weights))
    targets = out.targets
    why = placement = None
    if out.error is not None:
        why = f"its load_weights raised on a dry run ({type(out.error).__name__}: {out.error})"
    elif out.refused:
        why = f"{out.refused[0]} (refused in the dry run)"
    elif out.changed:
        why = "its loader changes it in place"
    elif out.left_running:
        why = "its loader leaves work running on another thread"
    elif out.copies:
        try:
            placement = _placement(name, probe, out.copies, params, layout)
        except ValueError as e:
            why = str(e)
        else:
            if name in out.used:  # what it copies may depend on the values
                why, placement = f"its loader reads its values ({out.used[name]})", None
            elif not placement.elements:
                placement = None  # empty slices only: none of it here
    elif name in out.used:
        why = f"its loader computes on it ({out.used[name]}) and copies none of it"
    del out, probe
    if why is None and not _released(ref):
        return "its loader keeps a reference to it", None, targets
    return why, placement, targets


# Tensors followed through a joint dry run: at most this many elements in all.
_JOINT_MAX_ELEMENTS = 1 << 28


def _joint(loader: Callable, members: list, device: Any, params: dict, modules: set,
           weights: set, layout: dict) -> Optional[dict]:
    """Tensors its loader writes only together (two projections fused into
    one parameter once both are there): one dry run with all of them, each
    a probe of its own memory whose elements are followed through the
    operations that only move them (``_MOVES``). Their placements, or None
    when any of them cannot be mapped so (the group keeps the stock path)."""
    if sum(int(np.prod(shape, dtype=np.int64)) for _, _, shape in members) > _JOINT_MAX_ELEMENTS:
        return None
    probes: dict = {}
    mirrors: dict = {}
    pairs = []
    refs = []
    for i, (name, tdtype, shape) in enumerate(members):
        p = torch.empty(shape, dtype=tdtype, device=device)
        k = _key(p)
        probes[k] = name
        mirrors[k] = (torch.arange(p.numel(), dtype=torch.int64) + ((i + 1) << 40),
                      p.element_size())
        pairs.append((name, p))
        refs.append(StorageWeakRef(_storage(p)))
    session = _Session(probes, params, modules, weights, mirrors=mirrors)
    session.sources.update({k: frozenset([n]) for k, n in probes.items()})
    out = _dry_run(loader, pairs, session)
    got: Optional[dict] = None
    if (out.error is None and not out.refused and not out.changed and not out.left_running
            and not any(n in out.used for n, _, _ in members)):
        got = _joint_placements(pairs, out.copies, session, params, layout)
    del out, pairs, session, mirrors, probes, p
    if got is not None and not all(_released(r) for r in refs):
        got = None  # its loader keeps a reference to them
    return got


def _joint_placements(pairs: list, copies: list, session: _Session, params: dict,
                      layout: dict) -> Optional[dict]:
    """The placements of a joint dry run's tensors, None if one fails."""
    got = {}
    try:
        for i, (name, probe) in enumerate(pairs):
            pl = _placement(name, probe, copies, params, layout, (session, (i + 1) << 40))
            if not pl.elements:
                return None  # its loader copies none of it
            got[name] = pl
        if any(not isinstance(c.src, torch.Tensor) or not session.sources.get(_key(c.src))
               for c in copies):
            return None  # a copy of a computed tensor
    except ValueError:
        return None
    return got


def _post_load(steps: list, order: list, params: dict, modules: set, weights: set,
               placements: dict, unmapped: dict, touches: dict, groups: dict, joint: dict,
               refused: dict) -> list:
    """The dry run of each post-load step (its writes refused, as a
    loader's): which loaded parameters it rewrites into another layout,
    which it derives other weights from, and what it replaces. Tensors in
    a rewritten parameter move to the stock path, grouped with every tensor
    of that parameter; tensors whose parameter it cannot run again on go to
    ``refused``. Returns the steps that need running again."""
    by_param: dict[str, list[str]] = {}
    for n in order:
        pl = placements.get(n)
        if pl is not None:
            by_param.setdefault(pl.param_name, []).append(n)
        elif n in unmapped:
            for pname in sorted(touches.get(n, ())):
                by_param.setdefault(pname, []).append(n)
    tensor_of = {pname: p for pname, p in params.values()}
    moved: dict[str, Placement] = {}  # placements an earlier step moved to the stock path
    out_steps = []
    for sname, module, run in steps:
        session = _Session({}, params, modules, weights, track=True)
        out = _dry_run(lambda pairs, run=run: run(), [], session)
        del session
        if out.error is not None or out.left_running:
            why = (f"raised on a dry run ({type(out.error).__name__}: {out.error})"
                   if out.error is not None else "leaves work running on another thread")
            mine = set()
            for p in list(module.parameters()) + list(module.buffers()) if module is not None \
                    else []:
                hit = params.get(_key(p))
                if hit is not None:
                    mine.add(hit[0])
            for pname in sorted(mine):
                for n in by_param.get(pname, []):
                    refused.setdefault(
                        n, f"it lands in parameter {pname}, whose post-load step {sname} {why}: "
                           "what that step makes of the loaded layout cannot be followed")
            continue
        transforms: dict[str, str] = {}
        reshaped: dict[str, str] = {}
        feeds: set = set()
        what: Optional[str] = None
        derived: set = set()  # memory of the weights it derives
        rewrites: Optional[str] = None  # an in-place operation on a weight it derives
        slots: list = []
        datas: list = []
        for w in out.writes:
            if w.kind == "attr":
                slots.append((w.owner, w.name))
            elif w.kind == "data":
                datas.append(w.owner)
            v = w.value
            if w.param is not None and w.param in by_param:
                old = tensor_of[w.param]
                if (w.kind in ("attr", "data") and isinstance(v, torch.Tensor)
                        and _key(v) == _key(old) and tuple(v.shape) == tuple(old.shape)
                        and tuple(v.stride()) == tuple(old.stride()) and v.dtype == old.dtype):
                    continue  # the same memory, the same layout
                transforms.setdefault(w.param, w.what)
                feeds |= w.deps
                what = what or w.what
                if w.kind in ("attr", "data"):
                    if not isinstance(v, torch.Tensor):
                        reshaped[w.param] = "it is removed"
                    elif tuple(v.shape) != tuple(old.shape) or v.dtype != old.dtype:
                        reshaped[w.param] = (f"{dtype_name(old)} {list(old.shape)} becomes "
                                             f"{dtype_name(v)} {list(v.shape)}")
                elif w.kind == "op" and _op_reshapes(w.what):
                    reshaped[w.param] = w.what
                continue
            if w.kind == "op" and not w.what.startswith(("aten.fill_", "aten.zero_")):
                rewrites = rewrites or w.what  # reads the values it writes over
            if w.kind in ("attr", "data") and not isinstance(v, torch.Tensor):
                continue  # an object (a kernel), made again whenever the step runs
            if isinstance(v, torch.Tensor) and w.kind != "copy" and _key(v) in params:
                continue  # a view of a loaded weight: it follows the weight
            if not w.deps:
                continue  # constants
            feeds |= w.deps
            what = what or w.what
            if isinstance(w.old, torch.Tensor):
                derived.add(_key(w.old))
            elif w.kind in ("copy", "op") and isinstance(w.owner, torch.Tensor):
                derived.add(_key(w.owner))
        feeds -= set(transforms)
        t_set = {n for pname in transforms for n in by_param.get(pname, [])}
        f_set = {n for pname in feeds for n in by_param.get(pname, [])} - t_set
        if not t_set and not f_set:
            continue
        bad: dict[str, str] = {}
        if out.reads & derived or rewrites:
            why = (f"the post-load step {sname} derives weights from it and reads what it "
                   f"writes ({rewrites or what}): running the step again would not give what "
                   "a fresh load gives")
            bad = {n: why for n in t_set | f_set}
        for pname in sorted(transforms):
            names = by_param.get(pname, [])
            stock = [n for n in names if n not in placements and n not in moved]
            if pname in reshaped:
                why = (f"it lands in parameter {pname}, whose layout the post-load step {sname} "
                       f"changes ({reshaped[pname]}): the layout load_weights writes is gone, "
                       "so a delta has no place to land")
            elif stock:
                why = (f"it lands in parameter {pname}, which the post-load step {sname} "
                       f"rewrites ({transforms[pname]}), and tensor '{stock[0]}' that also "
                       f"lands there takes the stock path ({unmapped[stock[0]]}): the step "
                       "cannot run again on a parameter only partly reloaded")
            elif not _covered([placements.get(n) or moved[n] for n in names],
                              tensor_of[pname]):
                why = (f"it lands in parameter {pname}, which the post-load step {sname} "
                       f"rewrites ({transforms[pname]}), and the checkpoint does not write all "
                       f"of {pname} once: running the step again would rewrite elements no "
                       "load restores")
            else:
                continue
            for n in names:
                bad.setdefault(n, why)
        if bad:
            for n in order:
                if n in bad:
                    refused.setdefault(n, bad[n])
            continue
        members = set(t_set)
        for n in t_set:
            members.update(groups.get(n, ()))
        group = [n for n in order if n in members]
        for n in group:
            groups[n] = group
            if n not in t_set or n in moved:
                continue
            pl = moved[n] = placements.pop(n)
            joint.pop(n, None)
            unmapped[n] = (f"it lands in parameter {pl.param_name}, which the post-load step "
                           f"{sname} rewrites into another layout ({transforms[pl.param_name]}): "
                           "loaded with every tensor of that parameter through the stock path, "
                           "then the step runs again")
        out_steps.append(PostLoadStep(sname, run, sorted(set(transforms)), sorted(feeds),
                                      [n for n in order if n in t_set or n in f_set],
                                      what or "", slots, datas))
    return out_steps


def _op_reshapes(what: str) -> bool:
    return any(what.startswith(f"aten.{n}") for n in ("set_", "resize_", "as_strided_"))


def _together(loader: Callable, alone: list, device: Any, params: dict, modules: set,
              weights: set, unmapped: dict, skipped: dict, groups: dict, touches: dict) -> None:
    """The tensors that copy nothing when alone, given to the loader at once
    (each over one element of memory): those it then leaves untouched are
    held by no parameter of this worker; those it reads together with
    others go to ``groups``."""
    pairs = []
    refs = {}
    probes = {}
    for name, tdtype, shape in alone:
        p = _expanded(tdtype, shape, device)
        probes[_key(p)] = name
        refs[name] = StorageWeakRef(_storage(p))
        pairs.append((name, p))
    out = _dry_run(loader, pairs, _Session(probes, params, modules, weights))
    del pairs, p
    copied = set()
    for c in out.copies:
        if isinstance(c.src, torch.Tensor):
            name = probes.get(_key(c.src))
            if name is not None:
                copied.add(name)
    out.copies = []
    joint: set = set()  # used only together with others
    for name, _, _ in alone:
        why = None
        if out.error is not None:
            why = (f"its load_weights raised on a dry run of the tensors it copies nothing "
                   f"from when alone ({type(out.error).__name__}: {out.error})")
        elif out.left_running:
            why = "its loader leaves work running on another thread"
        elif name in out.used or name in out.changed or name in copied:
            why = ("its loader uses it only together with other tensors "
                   f"({out.used.get(name) or 'a copy'})")
            joint.add(name)
        elif out.refused:
            why = f"{out.refused[0]} (refused in the dry run of the tensors given together)"
        elif not _released(refs[name]):
            why = "its loader keeps a reference to it"
        if why is None:
            skipped[name] = ("its load_weights copies none of it: this worker holds none of it "
                             "(another expert-parallel rank's expert, another pipeline stage's "
                             "layer, a tied weight)")
        else:
            unmapped[name] = why
            touches[name] = out.targets
    # Tensors read by one operation belong together, transitively.
    order = {name: i for i, (name, _, _) in enumerate(alone)}
    parent = {name: name for name in order}

    def root(n: str) -> str:
        while parent[n] != n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    for names in out.together:
        names = [n for n in names if n in parent]
        for n in names[1:]:
            parent[root(n)] = root(names[0])
    members: dict[str, list[str]] = {}
    for name in order:
        if name in joint:
            members.setdefault(root(name), []).append(name)
    # Those used together with no operation reading them at once (each
    # copied into memory of the loader's own first): one group.
    lone = [g[0] for g in members.values() if len(g) == 1]
    if len(lone) > 1:
        for n in lone:
            del members[root(n)]
        members[lone[0]] = lone
    for group in members.values():
        if len(group) > 1:
            for n in group:
                groups[n] = group
