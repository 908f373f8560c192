"""One engine worker's weights as deltasync updates them, shared by the
SGLang and vLLM adapters.

Tensors the dry run (:mod:`.weight_map`) mapped are written straight into
the model's parameters: each delta's changed elements are scattered into
their places, with no full-size tensor and no NaN sentinel (a true NaN is a
value like any other). Each tensor it could not map keeps a full host copy
(its *shadow*); a delta updates the shadow, and the shadow goes through the
model's stock ``load_weights``, which is what both engines do for every
tensor today. A tensor this worker holds none of (another expert-parallel
rank's expert, another pipeline stage's layer, a tied ``lm_head``:
:attr:`EngineWeights.skipped`) has neither: nothing is registered or kept
for it, and its deltas are dropped. :attr:`EngineWeights.stats` counts the
paths.

**What the kernel reads beyond what load_weights wrote.** Tensors whose
loader writes them only together with others (SGLang's DeepSeek fuses
``q_a_proj`` and ``kv_a_proj_with_mqa`` into one copy once both are in one
call) are mapped from one dry run with all of them: a delta to one of them
lands in the fused parameter, and a whole one is written into its
placement rather than given to the loader alone. The engine's post-load
steps (``post_load``: :func:`post_load_steps`) are dry-run too:

* a step that derives other weights from loaded ones (MLA's ``W_UK_T`` and
  ``W_UV`` from ``kv_b_proj``) runs again after a change to the tensors it
  reads, keeping the memory of every weight it replaces (the new values
  are copied into the old tensors, which stay in place: a captured CUDA
  graph keeps reading them);
* a step that rewrites a loaded parameter into the kernel's layout (vLLM's
  unquantized MoE on FlashInfer-CUTLASS swapping the halves of ``w13``,
  AITER shuffling it) makes every tensor of that parameter take the stock
  path as one group: the shadows are loaded together, which writes the
  whole parameter in the loaded layout again, and the step runs again;
* a model where neither is right (the step changes the parameter's shape,
  derives from what it writes, or the checkpoint does not write all of the
  parameter) is refused: UnsupportedError names the tensor and why.

:meth:`EngineWeights.apply_delta` leaves that work to
:meth:`EngineWeights.flush`, once for all the deltas of a sync;
:meth:`EngineWeights.load_full` and :meth:`EngineWeights.reload_shadows`
flush themselves.

Parameters can move under the map: ``update_weights_from_disk``, a wake
from sleep that reallocates, expert rebalancing that rebuilds a layer.
Before a delta is written into a parameter, that parameter is checked (the
object the module holds, its memory); :meth:`EngineWeights.refresh` checks
them all. Either learns the map again when one moved, so that nothing is
ever written into memory the model no longer uses. A change that keeps
every parameter's memory (experts swapped in place) needs
``refresh(force=True)`` from whoever makes it.
"""

from __future__ import annotations

import functools
import inspect
import logging
from typing import Any, Callable, Iterable, Optional

import torch

from .._tensors import _TORCH_DTYPES, dtype_name
from ..errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    UnsupportedError,
)
from .weight_map import PostLoadStep, WeightMap, _attribute, learn

_GONE, _NEW = "it is gone", "a new parameter"

log = logging.getLogger("deltasync.adapters")


def _code(dtype: Any) -> str:
    """A safetensors dtype name for a name or a torch dtype."""
    return dtype if isinstance(dtype, str) else dtype_name(torch.empty(0, dtype=dtype))


# The FP8 types older torch lacks: float8_e4m3fn and float8_e5m2 came with
# torch 2.1, float8_e8m0fnu (the ue8m0 scale) with 2.7.
_TORCH_MISSING = {code: name for name, code in (("float8_e4m3fn", "F8_E4M3"),
                                                ("float8_e5m2", "F8_E5M2"),
                                                ("float8_e8m0fnu", "F8_E8M0"))
                  if not hasattr(torch, name)}


def torch_dtype(code: str) -> torch.dtype:
    """The torch dtype of a safetensors dtype name."""
    for t, c in _TORCH_DTYPES.items():
        if c == code:
            return t
    if code in _TORCH_MISSING:
        raise InvalidArgumentError(
            f"dtype {code} needs torch.{_TORCH_MISSING[code]} (this is torch {torch.__version__}); "
            f"hold it as uint8 and pass deltasync.Raw(tensor, {code!r})")
    raise InvalidArgumentError(f"dtype {code} has no torch counterpart")


def post_load_steps(model: torch.nn.Module, act_dtype: Optional[torch.dtype] = None
                    ) -> list[tuple[str, torch.nn.Module, Callable[[], Any]]]:
    """The post-load processing an engine's model loader runs after
    ``load_weights``, one step per module, as (name, module, run), in the
    loader's order: each quant method's ``process_weights_after_loading(
    module)`` (vLLM's ``process_weights_after_loading`` in
    ``vllm/model_executor/model_loader/utils.py``, SGLang's
    ``DefaultModelLoader.load_model``), then, given ``act_dtype`` (vLLM),
    each layer's own ``process_weights_after_loading(act_dtype)`` (the
    attention layers: MLA's absorbed ``W_UK_T`` and ``W_UV``)."""
    steps: list = []
    for name, m in model.named_modules():
        qm = getattr(m, "quant_method", None)
        run = getattr(qm, "process_weights_after_loading", None)
        if qm is not None and callable(run):
            steps.append((f"{type(qm).__name__}.process_weights_after_loading"
                          f"({name or type(m).__name__})", m, functools.partial(run, m)))
    if act_dtype is None:
        return steps
    for name, m in model.named_modules():
        run = getattr(type(m), "process_weights_after_loading", None)
        if not callable(run):
            continue
        bound = getattr(m, "process_weights_after_loading")
        try:
            takes = len(inspect.signature(bound).parameters)
        except (TypeError, ValueError):
            takes = 1
        steps.append((f"{type(m).__name__}.process_weights_after_loading"
                      f"({name or type(m).__name__})", m,
                      functools.partial(bound, act_dtype) if takes else bound))
    return steps


def _where(owner: Any, name: str) -> str:
    """The table of module ``owner`` holding attribute ``name`` ("" for a
    plain attribute)."""
    for table in ("_parameters", "_buffers", "_modules"):
        if name in owner.__dict__.get(table, {}):
            return table
    return ""


def _place(owner: Any, name: str, value: Any, where: str) -> None:
    """Puts ``value`` back as attribute ``name`` of module ``owner``, in
    table ``where``, with no module hook run."""
    d = owner.__dict__
    for table in ("_parameters", "_buffers", "_modules"):
        if table in d:
            d[table].pop(name, None)
    d.pop(name, None)
    if where:
        d[where][name] = value
    else:
        d[name] = value


class EngineWeights:
    """The weights of ``model`` (one TP worker) for the checkpoint tensors
    ``checkpoint`` ((name, dtype, shape) triples). ``verify``: the dry run
    checks every parameter's bytes before and after (:func:`.weight_map.learn`).
    ``post_load(model)`` lists the engine's post-load steps as (name,
    module, run) (:func:`post_load_steps`); without it none is run again.
    Raises UnsupportedError naming a tensor no path keeps right."""

    def __init__(
        self,
        model: torch.nn.Module,
        checkpoint: Iterable[tuple[str, Any, Any]],
        load_weights: Optional[Callable[[list], Any]] = None,
        *,
        verify: bool = True,
        post_load: Optional[Callable[[torch.nn.Module], Iterable]] = None,
    ) -> None:
        self.model = model
        self.load_weights = load_weights or model.load_weights
        self.verify = verify
        self.post_load = post_load
        self.meta = {
            name: (_code(dtype), [int(x) for x in shape]) for name, dtype, shape in checkpoint
        }
        self.shadows: dict[str, torch.Tensor] = {}
        self.stats = {"scattered_tensors": 0, "scattered_elements": 0, "stock_loads": 0,
                      "skipped_deltas": 0, "relearned": 0, "post_load_runs": 0}
        self._pending: set[str] = set()  # stock-path tensors waiting for flush
        self._dirty: set[str] = set()  # post-load steps to run at flush
        # What a receiver was given, by tensor: ("param", placement, its memory's
        # address) or ("shadow", tensor).
        self._registered: Optional[dict[str, tuple]] = None
        self._stream_refused: dict[str, str] = {}  # tensors whose layout the stream refused
        # The map was learned again since the receiver last followed it; the
        # reason it cannot follow, once found.
        self._unfollowed = False
        self._cannot_follow: Optional[str] = None
        self.map: WeightMap = self._learn()

    def _learn(self) -> WeightMap:
        steps = list(self.post_load(self.model)) if self.post_load is not None else []
        wm = learn(self.model, [(n, d, s) for n, (d, s) in self.meta.items()],
                   self.load_weights, verify=self.verify, post_load=steps)
        if wm.refused:
            name = next(iter(wm.refused))
            more = f" ({len(wm.refused)} tensors in all)" if len(wm.refused) > 1 else ""
            raise UnsupportedError(f"deltasync: tensor '{name}': {wm.refused[name]}{more}")
        for name, why in self._stream_refused.items():
            if wm.placements.pop(name, None) is not None:
                wm.joint.pop(name, None)
                wm.unmapped[name] = why
        if wm.unmapped:
            log.warning("deltasync: %s", wm.report())
        if wm.skipped:
            log.info("deltasync: %d checkpoint tensors are held by no parameter of this "
                     "worker and are skipped", len(wm.skipped))
        return wm

    @property
    def fallback(self) -> list[str]:
        """The tensors that take the stock load_weights path."""
        return sorted(self.map.unmapped)

    @property
    def skipped(self) -> list[str]:
        """The tensors this worker holds none of: registered nowhere, no copy
        kept, their deltas dropped (``map.skipped`` says why for each)."""
        return sorted(self.map.skipped)

    def _check_name(self, name: str) -> None:
        if name not in self.meta:
            raise NotFoundError(f"tensor '{name}': not a tensor of this model's checkpoint")

    # --- parameters that move ------------------------------------------------

    def moved(self) -> dict[str, str]:
        """The parameters some delta is written into, and any added or gone,
        that are no longer where the map was learned, with why (a parameter
        only the stock load_weights writes may move as it likes)."""
        targets = {pl.param_name for pl in self.map.placements.values()}
        return {n: why for n, why in self.map.moved(self.model).items()
                if n in targets or why in (_GONE, _NEW)}

    def refresh(self, receiver: Any = None, *, force: bool = False) -> dict:
        """Checks every parameter (and, with ``force``, relearns anyway); when
        one moved, learns the map again. With ``receiver`` (the
        StreamReceiver :meth:`register` was given), each tensor whose
        parameter now has other memory but the same layout is pointed at it
        (``receiver.rebind``: the receiver then asks for a seed, so the next
        sync is refused and the one after reseeds); a tensor whose layout
        changed (other runs, another path, now held or no longer held)
        cannot follow: FailedPreconditionError says so, and the caller
        registers every tensor with a new receiver (:meth:`register`), the
        map being current already. Returns ``moved`` (parameter -> why),
        ``relearned`` and ``rebound`` (tensor names). Call it before each
        sync a receiver takes."""
        if receiver is not None and self._cannot_follow is not None:
            raise FailedPreconditionError(self._cannot_follow)
        moved = self.moved()
        relearned = bool(moved or force)
        if relearned:
            self._relearn(moved)
        rebound: list[str] = []
        if receiver is not None and self._registered is not None and self._unfollowed:
            rebound = self._follow(receiver)
        return {"moved": moved, "relearned": relearned, "rebound": rebound}

    def _relearn(self, moved: dict) -> None:
        if moved:
            first = sorted(moved)[0]
            log.warning("deltasync: %d parameters moved (%s: %s); learning the weight map again",
                        len(moved), first, moved[first])
        self.map = self._learn()
        self.stats["relearned"] += 1
        if self._registered is not None:
            self._unfollowed = True
        for name in list(self.shadows):
            if name not in self.map.unmapped:
                del self.shadows[name]

    def _follow(self, receiver: Any) -> list[str]:
        """Points ``receiver`` at the parameters' new memory (see refresh)."""
        reg = self._registered or {}
        rebind = []
        for name in self.meta:
            old = reg.get(name)
            placement = self.map.placements.get(name)
            if name in self.map.skipped:
                new_kind = None
            elif placement is not None:
                new_kind = "param"
            else:
                new_kind = "shadow"
            old_kind = old[0] if old is not None else None
            same = old_kind == new_kind
            if same and new_kind == "param":
                p0, p1 = old[1], placement
                same = (p0.run_tuples() == p1.run_tuples() and p0.dtype == p1.dtype
                        and p0.param.numel() == p1.param.numel()
                        and p0.param.dtype == p1.param.dtype)
                if same and (p0.param is not p1.param or old[2] != p1.param.data_ptr()):
                    rebind.append((name, placement))
            if not same:
                self._cannot_follow = (
                    f"deltasync: tensor '{name}' no longer fits the receiver it was registered "
                    f"with (it was {old_kind or 'not registered'}, it is now "
                    f"{new_kind or 'held by no parameter'}) after parameters moved: close the "
                    "receiver and register every tensor with a new one (EngineWeights.register)")
                raise FailedPreconditionError(self._cannot_follow)
        for name, placement in rebind:
            receiver.rebind(name, placement.param)
            reg[name] = ("param", placement, placement.param.data_ptr())
        self._unfollowed = False
        return [n for n, _ in rebind]

    def _current(self, name: str) -> None:
        """Learns the map again if the parameter ``name`` is written into has
        moved (a quick check of that parameter alone)."""
        placement = self.map.placements.get(name)
        if placement is None:
            return
        why = placement.moved()
        if why is not None:
            self._relearn({placement.param_name: why})

    # --- writing ---------------------------------------------------------------

    def load_full(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Loads whole tensors (the first sync, or a resync) through the stock
        path, keeping a shadow of each unmapped one; a tensor its loader
        writes only with others is written into its placement, or (stock
        path) loaded with its group once every member has a shadow. Then
        :meth:`flush`."""
        for name, t in named_tensors:
            self._check_name(name)
            dtype, shape = self.meta[name]
            if list(t.shape) != shape:
                raise InvalidArgumentError(
                    f"tensor '{name}': shape {list(t.shape)}, the checkpoint's is {shape}"
                )
        self.refresh()
        stock = []
        for name, t in named_tensors:
            if name in self.map.joint and name in self.map.placements:
                self._write_whole(name, t)
            elif name in self.map.unmapped and self._deferred(name):
                self.shadows[name] = t.detach().to("cpu", copy=True)
                self._pending.add(name)
            else:
                stock.append((name, t))
        if stock:
            with torch.no_grad():
                self.load_weights(list(stock))
            for name, t in stock:
                if name in self.map.unmapped:
                    self.shadows[name] = t.detach().to("cpu", copy=True)
                self._touch(name)
            self.stats["stock_loads"] += len(stock)
        self.flush()

    def _deferred(self, name: str) -> bool:
        """Whether the stock load of ``name`` waits for flush (its loader takes
        it only with others, or a post-load step follows it)."""
        return name in self.map.groups or bool(self.map.steps_of.get(name))

    def _touch(self, name: str) -> None:
        self._dirty.update(self.map.steps_of.get(name, ()))

    def _write_whole(self, name: str, t: torch.Tensor) -> None:
        placement = self.map.placements[name]
        param = placement.param
        src = t.detach().reshape(-1).to(param.device)
        with torch.no_grad():
            flat = param.data.view(-1)
            for first, count, offset, stride in placement.run_tuples():
                flat[offset:offset + (count - 1) * stride + 1:stride] = src[first:first + count]
        self.stats["scattered_tensors"] += 1
        self.stats["scattered_elements"] += placement.elements
        self._touch(name)

    def load_shadow(self, name: str) -> None:
        """Loads the shadow of ``name`` through the stock path (a tensor
        assembled from ranges), with its group; one that waits for others or
        a post-load step is left to :meth:`flush`."""
        if self._deferred(name):
            self._pending.add(name)
            return
        with torch.no_grad():
            self.load_weights([(name, self.shadows[name].to(self._device()))])
        self.stats["stock_loads"] += 1
        self._touch(name)

    def flush(self) -> list[str]:
        """Loads, group by group, the stock-path tensors left waiting (a group
        once each member has a shadow), then runs again each post-load step
        the writes since the last flush touched. Returns those steps' names."""
        if self._pending:
            ready: list[str] = []
            for name in self.meta:
                if name not in self._pending or name in ready:
                    continue
                if name not in self.map.unmapped:
                    self._pending.discard(name)
                    continue
                group = self.map.groups.get(name, [name])
                if all(n in self.shadows for n in group):
                    ready.extend(n for n in group if n not in ready)
            if ready:
                dev = self._device()
                with torch.no_grad():
                    self.load_weights([(n, self.shadows[n].to(dev)) for n in ready])
                self.stats["stock_loads"] += len(ready)
                self._pending.difference_update(ready)
                for n in ready:
                    self._touch(n)
        run = [st for st in self.map.steps if st.name in self._dirty]
        self._dirty.clear()
        for st in run:
            self._run_step(st)
        self.stats["post_load_runs"] += len(run)
        return [st.name for st in run]

    def _run_step(self, step: PostLoadStep) -> None:
        """Runs a post-load step again, then puts every weight it replaced
        back in its old memory with the new values (the memory the engine's
        kernels and captured graphs read)."""
        slots = [(owner, name, _attribute(owner, name), _where(owner, name))
                 for owner, name in step.slots]
        datas = [(t, t.data) for t in step.datas]
        with torch.no_grad():
            step.run()
            for t, old in datas:
                now = t.data
                if now.data_ptr() != old.data_ptr() or now.stride() != old.stride():
                    self._copy_back(step, "the memory of a weight", old, now)
                    t.data = old
            for owner, name, old, where in slots:
                new = _attribute(owner, name)
                if new is old or not isinstance(old, torch.Tensor):
                    continue
                if not isinstance(new, torch.Tensor):
                    raise FailedPreconditionError(
                        f"deltasync: the post-load step {step.name} removed {name} of module "
                        f"{type(owner).__name__}")
                if new.data_ptr() != old.data_ptr() or new.stride() != old.stride():
                    self._copy_back(step, f"{name} of module {type(owner).__name__}", old, new)
                _place(owner, name, old, where)

    @staticmethod
    def _copy_back(step: PostLoadStep, what: str, old: torch.Tensor, new: torch.Tensor) -> None:
        if tuple(new.shape) != tuple(old.shape) or new.dtype != old.dtype:
            raise FailedPreconditionError(
                f"deltasync: the post-load step {step.name} gave {what} another shape "
                f"({old.dtype} {list(old.shape)} became {new.dtype} {list(new.shape)})")
        old.data.copy_(new.data)

    def check_delta(self, name: str, positions: torch.Tensor, values: torch.Tensor) -> None:
        """Refuses (naming the tensor) a delta that does not fit the checkpoint."""
        self._check_name(name)
        dtype, shape = self.meta[name]
        numel = 1
        for x in shape:
            numel *= x
        if positions.dtype != torch.int64 or positions.dim() != 1:
            raise InvalidArgumentError(f"tensor '{name}': positions must be a 1-D int64 tensor")
        if values.dim() != 1 or values.numel() != positions.numel():
            raise InvalidArgumentError(
                f"tensor '{name}': {positions.numel()} positions but {values.numel()} values"
            )
        if _code(values.dtype) != dtype:
            raise InvalidArgumentError(
                f"tensor '{name}': values of {values.dtype}, the checkpoint's is {dtype}"
            )
        if positions.numel() and (int(positions.min()) < 0 or int(positions.max()) >= numel):
            raise InvalidArgumentError(
                f"tensor '{name}': a position outside its {numel} elements"
            )
        self._current(name)
        if name in self.map.unmapped:
            for n in self.map.groups.get(name, [name]):
                if n not in self.shadows:
                    raise InvalidArgumentError(
                        f"tensor '{name}': takes the stock path and has no full copy yet of "
                        f"'{n}' (send it whole first)"
                    )

    def apply_delta(self, name: str, positions: torch.Tensor, values: torch.Tensor) -> None:
        """Writes the changed elements of one tensor (check_delta first). A
        tensor a post-load step reads is written (or its shadow updated), and
        the step left to :meth:`flush`."""
        self._current(name)
        if name in self.map.skipped:
            self.stats["skipped_deltas"] += 1
            return
        placement = self.map.placements.get(name)
        if placement is None:
            shadow = self.shadows.get(name)
            if shadow is None:
                raise FailedPreconditionError(
                    f"tensor '{name}': its parameter moved and it now takes the stock path, "
                    "which needs a full copy of it (send it whole)")
            shadow.view(-1)[positions.to(shadow.device)] = values.to(shadow.device)
            if self.map.steps_of.get(name):
                self._pending.add(name)  # loaded with its group, then the step: flush
                return
            # A tensor its loader takes only with others goes with them.
            names = self.map.groups.get(name, [name])
            dev = self._device()
            with torch.no_grad():
                self.load_weights([(n, self.shadows[n].to(dev)) for n in names])
            self.stats["stock_loads"] += len(names)
            return
        param = placement.param
        pos = positions.to(param.device)
        held, dest = placement.destinations(pos)
        with torch.no_grad():
            flat = param.data.view(-1)
            flat[dest] = values.to(param.device)[held]
        self.stats["scattered_tensors"] += 1
        self.stats["scattered_elements"] += int(dest.numel())
        self._touch(name)

    def _device(self) -> torch.device:
        for p in self.model.parameters():
            return p.device
        return torch.device("cpu")

    def register(self, receiver: Any) -> None:
        """Registers every checkpoint tensor this worker holds with a
        StreamReceiver: mapped ones into their parameters (the parameter
        itself, with its runs, so that the receiver sees its memory move),
        the others into shadows (call :meth:`reload_shadows` after each
        receive). Tensors it holds none of (:attr:`skipped`) are not
        registered: the receiver must then be built with ``partial=True``.
        Call :meth:`refresh` with the receiver before each receive."""
        self.refresh()
        registered: dict[str, tuple] = {}
        for name, (dtype, shape) in self.meta.items():
            if name in self.map.skipped:
                continue
            placement = self.map.placements.get(name)
            if placement is not None:
                try:
                    receiver.register(name, placement.param, runs=placement.run_tuples(),
                                      shape=shape, dtype=placement.dtype)
                    registered[name] = ("param", placement, placement.param.data_ptr())
                    continue
                except InvalidArgumentError as e:
                    # The stream cannot hold this layout: the stock path.
                    del self.map.placements[name]
                    self.map.unmapped[name] = f"the stream refuses its layout ({e})"
                    self._stream_refused[name] = self.map.unmapped[name]
            shadow = self.shadows.get(name)
            if shadow is None:
                shadow = torch.zeros(shape, dtype=torch_dtype(dtype))
                self.shadows[name] = shadow
            receiver.register(name, shadow)
            registered[name] = ("shadow", shadow)
        self._registered = registered
        self._unfollowed = False
        self._cannot_follow = None

    def reload_shadows(self) -> None:
        """After a receive: loads every shadow through the stock load_weights
        (in one call), then runs every post-load step again (the receiver
        wrote into the parameters it reads)."""
        if self.shadows:
            dev = self._device()
            with torch.no_grad():
                self.load_weights([(n, s.to(dev)) for n, s in self.shadows.items()])
            self.stats["stock_loads"] += len(self.shadows)
        self._pending.clear()
        self._dirty.update(st.name for st in self.map.steps)
        self.flush()
