"""SGLang: deltas through ``update_weights_from_tensor``, applied in place.

Engine side: start SGLang with ``--custom-weight-loader
deltasync.adapters.sglang.custom_loader`` (:data:`LOAD_FORMAT`). For an
``update_weights_from_tensor(..., load_format=LOAD_FORMAT)`` request SGLang
then calls :func:`custom_loader` ``(model, named_tensors)`` in every TP
worker (and, with speculative decoding, for the draft model too).

Trainer side: :class:`SGLangPusher` ``(engine).push(state_dict)`` after each
step. The first push sends every tensor whole (through the model's stock
``load_weights``); every later one sends only the changed elements of each
changed tensor, as two tensors (positions, values), which each worker
scatters straight into the parameters the dry run mapped
(:mod:`.weight_map`). ``engine`` is ``sglang.Engine`` or, for a server,
:class:`SGLangHTTPClient`.

What SGLang does around the loader, and what this adapter does about it
(sources in sgl-project/sglang, file at commit):

* ``model_runner.py`` (0005834cdb2a5b7472789ccbf0d3361b5cf853b8),
  ``ModelRunner.update_weights_from_tensor``: each TP rank deserializes its
  own copy of the request and moves every tensor to its GPU before the
  loader runs; then it returns ``(True, "Success")`` whatever the loader
  did. So a push is split into calls of at most ``bucket_bytes`` (a tensor
  larger than that travels as element ranges), and the loader's verdict
  reaches the trainer through a status file per worker (below), not
  through SGLang's reply.
* ``scheduler.py`` (0003215cf1464f44b389cd0b18d0b4c56f2a3da6),
  ``run_scheduler_process``, with ``scheduler_update_weights_mixin.py``
  (018c9109680f6f5b0654114b9159101256e1e18b): an exception out of the
  loader is not caught on the way; the scheduler logs it and sends SIGQUIT
  to its parent, which takes the whole server down (with ``sglang.Engine``,
  the trainer's own process). So :func:`custom_loader` never raises: a bad
  or out-of-order payload is refused with every weight unchanged, the
  reason is recorded (:func:`sync_status`, the status file), the pusher
  raises it, and its next push sends every tensor whole, which repairs.
* ``eagle_worker.py`` (00559eacbf0841146db7e27e445d1971e35e6294) calls the
  draft runner's loader first and then the target's, with the same
  payload; ``scheduler_components/weight_updater.py``
  (00a2ca2e56d59f0a19186d7a8a58bdda5201023f) calls the target first, then
  the draft. Each model keeps its own state, so the payload is applied once
  to each whatever the order (a draft model that shares the target's
  embedding gets the same values written twice); a call applied to a model
  already is a no-op. A draft model whose ``load_weights`` cannot take the
  trainer's checkpoint refuses (the pusher raises, naming its class);
  ``SGLangPusher(skip_models=[class name])`` leaves such models alone.
* ``models/deepseek_v2.py`` (3e4a39ee73308590c5c753108bdcb8d333f7f1c6),
  ``DeepseekV2ForCausalLM.load_weights``: ``q_a_proj`` and
  ``kv_a_proj_with_mqa`` are written (as one fused copy) only when one call
  holds both, and ``post_load_weights`` derives ``w_kc``/``w_vc`` from each
  ``kv_b_proj`` the call loaded. A push may split the pair across calls, so
  both are mapped into the fused parameter (:mod:`.weight_map`) and written
  there whole or by delta; ``kv_b_proj`` takes the stock path, whose
  ``load_weights`` derives them again. The model loader's post-load steps
  (each quant method's ``process_weights_after_loading``) are followed as
  :mod:`.engine` describes.
* ``update_weights_from_distributed`` (same ``model_runner.py`` and
  ``weight_updater.py``) loads through ``model.load_weights`` only and never
  calls a custom loader, so deltasync's payload has the tensor path only,
  whose tensors travel as CUDA IPC handles or shared memory: trainer and
  engine share a host.
* ``http_server.py`` (0025436eab0556737d615b36a4dd3e1e26e82f3d), route
  ``/update_weights_from_tensor``: its body holds one serialized payload per
  TP rank (``serialized_named_tensors``), not the engine call's arguments;
  :class:`SGLangHTTPClient` builds it (``engine.py``,
  001067fffe33427bee0ed2f007fb7551a1d76b44, serializes the same way for
  ``sglang.Engine``).

Supported: SGLang releases with ``--custom-weight-loader`` (added by
sgl-project/sglang#7122, June 2025).

Payload (a list of (name, tensor) pairs): ``"__deltasync__"`` is a uint8
tensor of UTF-8 JSON, ``{"format": 1, "push": id, "call": id, "step": n,
"base_step": n-1 or null, "full": bool, "part": i, "parts": k, "tensors":
[...], "checkpoint": [[name, dtype, shape], ...] (the first call of a full
push), "status_dir": path, "skip_models": [...]}``. Each entry of
``tensors`` is ``{"name", "dtype", "shape", "count"}`` plus ``"first"``
for a range of a whole tensor or ``"chunk"`` for a piece of a delta. A
whole tensor travels under its name, a range as ``"<name>#range.<first>"``
(its flat elements), a delta as ``"<name>#positions"`` (int64) and
``"<name>#values"`` (the tensor's dtype), ``".<chunk>"`` appended for a
piece. A worker applies call ``i`` of push ``p`` only after call ``i-1``
of ``p``, the first call of a delta only on the step it names, checks
every part of a call before writing any, and refuses anything else.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import tempfile
import threading
import uuid
import weakref
from typing import Any, Callable, Iterable, Optional

import torch

from .. import codec, errors
from .._tensors import dtype_name, named
from ..errors import (
    CorruptionError,
    FailedPreconditionError,
    InternalError,
    InvalidArgumentError,
    UnsupportedError,
)
from .engine import EngineWeights, post_load_steps, torch_dtype

log = logging.getLogger("deltasync.adapters")

LOAD_FORMAT = "deltasync.adapters.sglang.custom_loader"
MANIFEST = "__deltasync__"
FORMAT = 1
DEFAULT_BUCKET_BYTES = 512 << 20

_STATE_ATTR = "_deltasync_engine_weights"
_SYNC_ATTR = "_deltasync_sync"
_LOCK = threading.Lock()


def engine_weights(model: torch.nn.Module) -> Optional[EngineWeights]:
    """The adapter's state in a worker's model (None before the first push)."""
    return getattr(model, _STATE_ATTR, None)


@dataclasses.dataclass
class _Sync:
    held: Optional[int] = None  # the step the weights hold; None: none, or a push cut short
    pending: Optional[dict] = None  # the push whose calls are arriving
    last_call: Optional[str] = None
    last_error: Optional[str] = None
    calls: int = 0
    refused: int = 0


def _sync_of(model: torch.nn.Module) -> _Sync:
    s = getattr(model, _SYNC_ATTR, None)
    if s is None:
        s = _Sync()
        setattr(model, _SYNC_ATTR, s)
    return s


def sync_status(model: torch.nn.Module) -> dict:
    """What a worker's model holds: ``step`` (None before the first push or
    after a push cut short), ``pending`` (a push whose calls are arriving),
    ``last_call`` (the call last applied), ``error`` (why the last call was
    refused, None if it was applied), ``calls`` and ``refused`` (counts)."""
    s = _sync_of(model)
    return {"step": s.held, "pending": s.pending is not None, "last_call": s.last_call,
            "error": s.last_error, "calls": s.calls, "refused": s.refused}


def _manifest(named_tensors: list) -> tuple[dict, dict]:
    parts = dict(named_tensors)
    if len(parts) != len(named_tensors):
        raise InvalidArgumentError("deltasync payload: a name appears twice")
    raw = parts.pop(MANIFEST, None)
    if raw is None:
        raise InvalidArgumentError(f"deltasync payload: no {MANIFEST} tensor")
    try:
        m = json.loads(raw.to("cpu").numpy().tobytes().decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise CorruptionError(f"deltasync payload: the manifest is not JSON ({e})") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        got = m.get("format") if isinstance(m, dict) else None
        raise CorruptionError(f"deltasync payload: manifest format {got!r}, "
                              f"this deltasync reads {FORMAT}")
    for key in ("step", "part", "parts"):
        if key in m and (not isinstance(m[key], int) or isinstance(m[key], bool)):
            raise CorruptionError(f"deltasync payload: manifest field {key} is not an integer")
    if not isinstance(m.get("tensors", []), list):
        raise CorruptionError("deltasync payload: manifest field tensors is not a list")
    return m, parts


def _key(e: dict, what: str) -> str:
    """The payload name of one part of entry ``e`` ("" for a whole tensor)."""
    name = e["name"]
    if what == "range":
        return f"{name}#range.{e['first']}"
    if what == "":
        return name
    return f"{name}#{what}" + (f".{e['chunk']}" if "chunk" in e else "")


def _numel(shape: list) -> int:
    n = 1
    for x in shape:
        n *= int(x)
    return n


def _plan(model: torch.nn.Module, sync: _Sync, m: dict, parts: dict) -> tuple:
    """Checks one call against the worker's state and returns what to write;
    raises (having changed nothing) for anything out of order or malformed."""
    step = m.get("step")
    full = bool(m.get("full"))
    part = m.get("part", 0)
    nparts = m.get("parts", 1)
    push = m.get("push")
    if not isinstance(step, int) or nparts < 1 or not 0 <= part < nparts:
        raise CorruptionError(f"deltasync payload: call {part} of {nparts}, step {step!r}")
    entries = m.get("tensors", [])
    for e in entries:
        if not isinstance(e, dict) or not isinstance(e.get("name"), str):
            raise CorruptionError("deltasync payload: a manifest entry without a name")
    state = engine_weights(model)
    new_state = None
    if part == 0:
        if full:
            ckpt = m.get("checkpoint")
            if ckpt is None:
                ckpt = [(e["name"], e.get("dtype"), e.get("shape")) for e in entries]
            meta = {n: (d, [int(x) for x in s]) for n, d, s in ckpt}
            if state is None or state.meta != meta:
                new_state = EngineWeights(model, [(n, d, s) for n, (d, s) in meta.items()],
                                          post_load=post_load_steps)
                state = new_state
        else:
            if state is None:
                raise FailedPreconditionError(
                    "deltasync: a delta before any full push (the trainer must push whole "
                    "tensors first)")
            if m.get("base_step") != sync.held or sync.held is None:
                held = "no consistent step (a push was cut short)" if sync.held is None \
                    else f"step {sync.held}"
                raise FailedPreconditionError(
                    f"deltasync: step {step} applies on step {m.get('base_step')}, "
                    f"this worker holds {held}")
        pending = {"push": push, "step": step, "full": full, "parts": nparts, "next": 0,
                   "ranged": {}, "done": set()}
    else:
        pending = sync.pending
        if (pending is None or pending["push"] != push or pending["next"] != part
                or pending["parts"] != nparts or pending["step"] != step
                or pending["full"] != full):
            expect = "no call of a push in progress" if pending is None else \
                f"call {pending['next'] + 1} of {pending['parts']} of push {pending['push']}"
            raise FailedPreconditionError(
                f"deltasync: call {part + 1} of {nparts} of push {push} (step {step}) out "
                f"of order: this worker expects {expect}")
        if state is None:
            raise FailedPreconditionError("deltasync: a call after the first with no state")
    used = set()
    whole, ranges, deltas = [], [], []
    ranged = dict(pending["ranged"])
    done = set(pending["done"])
    for e in entries:
        name = e["name"]
        if full:
            state._check_name(name)
            dtype, shape = state.meta[name]
            if e.get("dtype") != dtype or [int(x) for x in e.get("shape", [])] != shape:
                raise InvalidArgumentError(
                    f"tensor '{name}': {e.get('dtype')} {e.get('shape')} in the manifest, "
                    f"the checkpoint's is {dtype} {shape}")
            if "first" in e:
                key = _key(e, "range")
                t = parts.get(key)
                if t is None:
                    raise InvalidArgumentError(f"tensor '{name}': a range in the manifest, not sent")
                first, count, numel = e["first"], e.get("count"), _numel(shape)
                if (not isinstance(first, int) or t.dim() != 1 or t.numel() != count
                        or first < 0 or first + t.numel() > numel):
                    raise InvalidArgumentError(
                        f"tensor '{name}': a range of {t.numel()} elements at {first} does "
                        f"not fit its {numel} (the manifest says {count})")
                if dtype_name(t) != dtype:
                    raise InvalidArgumentError(
                        f"tensor '{name}': a range of {t.dtype}, the checkpoint's is {dtype}")
                ranged[name] = ranged.get(name, 0) + t.numel()
                if ranged[name] > numel:
                    raise InvalidArgumentError(f"tensor '{name}': ranges past its {numel} elements")
                if ranged[name] == numel:
                    done.add(name)
                ranges.append((name, first, t))
                used.add(key)
            else:
                t = parts.get(name)
                if t is None:
                    raise InvalidArgumentError(f"tensor '{name}': in the manifest, not sent")
                if list(t.shape) != shape or dtype_name(t) != dtype:
                    raise InvalidArgumentError(
                        f"tensor '{name}': {t.dtype} {list(t.shape)}, the checkpoint's is "
                        f"{dtype} {shape}")
                whole.append((name, t))
                done.add(name)
                used.add(name)
        else:
            pk, vk = _key(e, "positions"), _key(e, "values")
            pos, val = parts.get(pk), parts.get(vk)
            if pos is None or val is None:
                raise InvalidArgumentError(f"tensor '{name}': in the manifest, its delta not sent")
            if pos.numel() != e.get("count"):
                raise InvalidArgumentError(
                    f"tensor '{name}': {pos.numel()} positions, the manifest says {e.get('count')}")
            state.check_delta(name, pos, val)
            deltas.append((name, pos, val))
            used.update((pk, vk))
    extra = sorted(set(parts) - used)
    if extra:
        raise InvalidArgumentError(f"deltasync payload: tensor '{extra[0]}' sent, not in the manifest")
    if full and part == nparts - 1:
        missing = sorted(set(state.meta) - done)
        if missing:
            raise InvalidArgumentError(
                f"deltasync: full push {push} ends without tensor '{missing[0]}' "
                f"({len(missing)} missing)")
    pending = dict(pending, ranged=ranged, done=done)
    return new_state, state, pending, whole, ranges, deltas


def _write(state: EngineWeights, pending: dict, whole: list, ranges: list, deltas: list) -> None:
    if whole:
        state.load_full(whole)
    for name, first, t in ranges:
        if name in state.map.placements:
            pos = torch.arange(first, first + t.numel(), dtype=torch.int64, device=t.device)
            state.apply_delta(name, pos, t)
            continue
        if name in state.map.skipped:  # this worker holds none of it: no copy kept
            continue
        dtype, shape = state.meta[name]
        shadow = state.shadows.get(name)
        if shadow is None:
            shadow = torch.zeros(shape, dtype=torch_dtype(dtype))
            state.shadows[name] = shadow
        shadow.view(-1)[first:first + t.numel()] = t.to(shadow.device)
        if pending["ranged"].get(name) == shadow.numel():
            state.load_shadow(name)
    for name, pos, val in deltas:
        state.apply_delta(name, pos, val)
    # Stock-path groups left waiting, and the post-load steps the call touched.
    state.flush()


def _apply(model: torch.nn.Module, named_tensors: Iterable) -> tuple[Optional[dict], Optional[Exception], str]:
    """Applies one call to ``model``: (manifest or None, the refusal or None,
    what happened)."""
    sync = _sync_of(model)
    sync.calls += 1
    m = None
    try:
        m, parts = _manifest(list(named_tensors))
        if type(model).__name__ in (m.get("skip_models") or []):
            return m, None, "skipped"
        call = m.get("call")
        if call is not None and call == sync.last_call:
            return m, None, "already applied"
        new_state, state, pending, whole, ranges, deltas = _plan(model, sync, m, parts)
    except Exception as e:  # refused: nothing written
        sync.refused += 1
        sync.last_error = f"{type(e).__name__}: {e}"
        return m, e, "refused"
    # Writing: until the push's last call lands, the worker holds no step.
    if new_state is not None:
        setattr(model, _STATE_ATTR, new_state)
    sync.held = None
    sync.pending = None
    try:
        _write(state, pending, whole, ranges, deltas)
    except Exception as e:
        sync.refused += 1
        sync.last_error = (f"{type(e).__name__}: {e} (weights partly written: the next push "
                           "must send every tensor)")
        return m, e, "failed"
    pending["next"] = m.get("part", 0) + 1
    if pending["next"] == pending["parts"]:
        sync.held = pending["step"]
    else:
        sync.pending = pending
    sync.last_call = m.get("call")
    sync.last_error = None
    return m, None, "applied"


def _rank() -> Optional[int]:
    try:
        import torch.distributed as dist

        return dist.get_rank() if dist.is_available() and dist.is_initialized() else None
    except Exception:
        return None


def _report(model: torch.nn.Module, m: Optional[dict], err: Optional[Exception], what: str) -> None:
    """Writes this worker's verdict on the call into the manifest's
    status_dir (one file per worker model, replaced at each call)."""
    if not m or not m.get("status_dir"):
        return
    s = _sync_of(model)
    rec = {"call": m.get("call"), "push": m.get("push"), "part": m.get("part", 0),
           "step": m.get("step"), "ok": err is None, "what": what,
           "error": None if err is None else s.last_error,
           "error_type": None if err is None else type(err).__name__,
           "model": type(model).__name__, "pid": os.getpid(), "rank": _rank(), "held": s.held}
    path = os.path.join(m["status_dir"], f"{os.getpid()}-{id(model):x}.json")
    try:
        tmp = f"{path}.{threading.get_ident():x}.tmp"
        with open(tmp, "w") as f:
            json.dump(rec, f)
        os.replace(tmp, path)
    except OSError as e:
        log.warning("deltasync: cannot write the status file %s (%s)", path, e)


def custom_loader(model: torch.nn.Module, named_tensors: list) -> None:
    """SGLang's custom weight loader (:data:`LOAD_FORMAT`): applies one
    deltasync call to ``model``. Never raises: a payload out of order or
    malformed is refused with every weight unchanged, and the reason goes
    to :func:`sync_status` and the pusher's status file."""
    try:
        with _LOCK:
            m, err, what = _apply(model, named_tensors)
            _report(model, m, err, what)
        if err is not None:
            log.error("deltasync: %s refused a call: %s", type(model).__name__,
                      _sync_of(model).last_error)
    except Exception:  # nothing may reach SGLang's scheduler
        log.exception("deltasync: the custom loader failed")


def load_weights(model: torch.nn.Module, named_tensors: list) -> None:
    """The same as :func:`custom_loader` for a caller that wants the refusal
    raised (an engine in the caller's own process): raises for a payload out
    of order or malformed, having written nothing. Never name this one to
    SGLang: an exception out of a loader takes its server down."""
    with _LOCK:
        m, err, what = _apply(model, named_tensors)
        _report(model, m, err, what)
    if err is not None:
        raise err


def _manifest_tensor(m: dict) -> torch.Tensor:
    data = json.dumps(m).encode("utf-8")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _entry_bytes(e: dict) -> int:
    return len(json.dumps(e)) + 2


class _Piece:
    """One manifest entry and its tensors: (key, tensor, first, end); a
    slice [first, end) of a flat tensor is copied when its call is sent, so
    a call holds its own bytes only."""

    __slots__ = ("entry", "tensors", "nbytes")

    def __init__(self, entry: dict, tensors: list) -> None:
        self.entry = entry
        self.tensors = [x if len(x) == 4 else (x[0], x[1], None, None) for x in tensors]
        self.nbytes = sum((t.numel() if a is None else b - a) * t.element_size()
                          for _, t, a, b in self.tensors)

    def materialize(self) -> list:
        return [(k, t if a is None else t[a:b].clone()) for k, t, a, b in self.tensors]


def _verdict(result: Any) -> tuple[Optional[bool], str]:
    """SGLang's (success, message) from an engine's reply, if it has one."""
    if isinstance(result, (tuple, list)) and len(result) >= 2 and isinstance(result[0], bool):
        return result[0], str(result[1])
    if isinstance(result, dict) and "success" in result:
        return bool(result["success"]), str(result.get("message", ""))
    return None, ""


def _error_class(name: Optional[str]) -> type:
    cls = getattr(errors, name or "", None)
    if isinstance(cls, type) and issubclass(cls, errors.DeltasyncError):
        return cls
    return FailedPreconditionError


class SGLangPusher:
    """The trainer's side: pushes each step's change to an SGLang engine.

    ``engine`` is anything with SGLang's ``update_weights_from_tensor(
    named_tensors, load_format=..., flush_cache=...)``: ``sglang.Engine``, or
    :class:`SGLangHTTPClient` for a server (``update_weights_from_distributed``
    never reaches a custom loader, so trainer and engine share a host). It
    keeps a host snapshot of the weights last pushed (the diff runs in
    deltasync's core).

    ``bucket_bytes`` bounds each call (every TP rank moves every tensor of a
    call to its GPU before the loader runs); a push takes as many calls as
    it needs, a tensor larger than the bound travels as element ranges, and
    only the push's last call flushes SGLang's cache (``flush_cache``).
    Between the calls of one push the engine holds a mix of two steps: pause
    generation around a push that takes several. Each worker writes its
    verdict on each call into ``status_dir`` (default: a directory the
    pusher makes and removes; it must be writable by the engine's workers);
    a refused call raises here, naming the worker's reason, and the next
    push sends every tensor. ``workers`` is the number of verdicts a call
    must collect (TP size, twice that with a draft model); by default the
    count the first call collected. ``skip_models`` names model classes the
    loader leaves alone (a speculative draft model whose weights are not in
    the trainer's checkpoint).
    """

    def __init__(self, engine: Any, *, flush_cache: bool = True,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, status_dir: Optional[str] = None,
                 workers: Optional[int] = None, skip_models: Iterable[str] = ()) -> None:
        if not callable(getattr(engine, "update_weights_from_tensor", None)):
            raise InvalidArgumentError(
                "SGLangPusher: the engine has no update_weights_from_tensor (pass sglang.Engine, "
                "or SGLangHTTPClient for a server); update_weights_from_distributed never calls "
                "a custom loader, so deltasync needs the tensor path, with trainer and engine "
                "on one host")
        if int(bucket_bytes) < 4096:
            raise InvalidArgumentError(f"SGLangPusher: bucket_bytes {bucket_bytes} is under 4096")
        self.engine = engine
        self.flush_cache = flush_cache
        self.bucket_bytes = int(bucket_bytes)
        self.workers = workers
        self.skip_models = sorted(skip_models)
        self.step = 0
        self._snapshot: dict[str, torch.Tensor] = {}
        self._session = uuid.uuid4().hex[:12]
        self._pushes = 0
        self._calls = 0
        self._seen_workers = 0
        if status_dir is None:
            status_dir = tempfile.mkdtemp(prefix="deltasync-sglang-")
            self._cleanup = weakref.finalize(self, shutil.rmtree, status_dir, True)
        else:
            os.makedirs(status_dir, exist_ok=True)
            self._cleanup = None
        self.status_dir = os.path.abspath(status_dir)

    def close(self) -> None:
        """Removes the status directory the pusher made (if it made one)."""
        if self._cleanup is not None:
            self._cleanup()

    # --- one call ---------------------------------------------------------

    def _reports(self, call: str) -> list[dict]:
        out = []
        try:
            names = os.listdir(self.status_dir)
        except OSError:
            return out
        for fn in names:
            if not fn.endswith(".json"):
                continue
            try:
                with open(os.path.join(self.status_dir, fn)) as f:
                    rec = json.load(f)
            except (OSError, ValueError):
                continue
            if isinstance(rec, dict) and rec.get("call") == call:
                out.append(rec)
        return out

    def _send(self, payload: list, flush: bool, call: str, what: str) -> None:
        try:
            result = self.engine.update_weights_from_tensor(
                named_tensors=payload, load_format=LOAD_FORMAT, flush_cache=flush
            )
        except BaseException:
            # Some workers may hold the new step and some not: the next push
            # sends every tensor whole.
            self._snapshot = {}
            raise
        ok, message = _verdict(result)
        if ok is False:
            self._snapshot = {}
            raise FailedPreconditionError(f"SGLang refused {what}: {message}")
        reports = self._reports(call)
        expected = self.workers or self._seen_workers
        if not reports or len(reports) < expected:
            self._snapshot = {}
            raise FailedPreconditionError(
                f"{what}: {len(reports)} of {expected or 'at least 1'} workers reported (is "
                f"SGLang started with --custom-weight-loader {LOAD_FORMAT}, on this host, with "
                f"its workers able to write to {self.status_dir}?)")
        self._seen_workers = max(self._seen_workers, len(reports))
        refused = [r for r in reports if not r.get("ok")]
        if refused:
            self._snapshot = {}
            first = refused[0]
            lines = "; ".join(
                f"{r.get('model')} (pid {r.get('pid')}, rank {r.get('rank')}): {r.get('error')}"
                for r in refused)
            msg = f"{what}: refused by {len(refused)} of {len(reports)} workers: {lines}"
            classes = {r.get("model") for r in reports}
            if len(classes) > 1 and len({r.get("model") for r in refused}) < len(classes):
                msg += ("; a speculative draft model whose weights are not the trainer's can be "
                        "left alone with SGLangPusher(skip_models=[its class name])")
            msg += "; the next push sends every tensor"
            raise _error_class(first.get("error_type"))(msg)

    # --- a push -----------------------------------------------------------

    def _calls_of(self, pieces: list, over: int) -> list[tuple[list, list]]:
        """Packs pieces into calls under the bound: (entries, pieces) each."""
        budget = self.bucket_bytes - over
        calls: list[tuple[list, list]] = []
        entries: list = []
        group: list = []
        used = 0
        for p in pieces:
            cost = p.nbytes + _entry_bytes(p.entry)
            if cost > budget:
                raise InternalError(f"a piece of {cost} bytes over the call budget {budget}")
            if entries and used + cost > budget:
                calls.append((entries, group))
                entries, group, used = [], [], 0
            entries.append(p.entry)
            group.append(p)
            used += cost
        calls.append((entries, group))
        return calls

    def _cap(self, over: int, entry: dict) -> int:
        """Data bytes one piece may hold, ``over`` bytes of each call being
        the manifest's own."""
        cap = self.bucket_bytes - over - _entry_bytes(entry) - 48
        if cap < 64:
            raise InvalidArgumentError(
                f"SGLangPusher: bucket_bytes {self.bucket_bytes} cannot hold the manifest "
                f"({over} bytes) and a tensor; raise it")
        return cap

    def push(self, weights: Any, *, full: bool = False) -> dict:
        """Pushes ``weights`` (a state dict or (name, tensor) pairs): the whole
        tensors at the first push (or with ``full``, or after a refused
        call), else the changed elements. Returns ``step``, ``full``,
        ``tensors_changed``, ``changed_elements``, ``bytes``, ``calls``."""
        pairs = named(weights)
        first = not self._snapshot or full
        if not first and set(n for n, _ in pairs) != set(self._snapshot):
            raise InvalidArgumentError("push: not the tensors of the first push")
        self._pushes += 1
        push_id = f"{self._session}.{self._pushes}"
        head = {"format": FORMAT, "push": push_id, "call": f"{push_id}.000000",
                "step": self.step + 1, "base_step": None if first else self.step, "full": first,
                "part": 0, "parts": 0, "status_dir": self.status_dir,
                "skip_models": self.skip_models}
        pieces: list[_Piece] = []
        if first:
            host = {n: t.detach().to("cpu", copy=True).contiguous() for n, t in pairs}
            ckpt = [[n, dtype_name(t), list(t.shape)] for n, t in host.items()]
            first_extra = {"checkpoint": ckpt}
            over = len(json.dumps({**head, **first_extra, "tensors": []})) + 64
            for n, t in pairs:
                h = host[n]
                base = {"name": n, "dtype": dtype_name(h), "shape": list(h.shape), "count": h.numel()}
                cap = self._cap(over, dict(base, first=h.numel()))
                esize = h.element_size()
                if h.numel() * esize <= cap:
                    pieces.append(_Piece(base, [(n, t)]))
                    continue
                flat = t.detach().reshape(-1)
                step = max(1, cap // esize)
                for a in range(0, h.numel(), step):
                    b = min(a + step, h.numel())
                    e = dict(base, first=a, count=b - a)
                    pieces.append(_Piece(e, [(_key(e, "range"), flat, a, b)]))
            stats = {"tensors_changed": len(host),
                     "changed_elements": sum(t.numel() for t in host.values()),
                     "bytes": sum(t.numel() * t.element_size() for t in host.values())}
        else:
            first_extra = {}
            over = len(json.dumps({**head, "tensors": []})) + 64
            staged = []
            changed = nbytes = tensors_changed = 0
            for n, t in pairs:
                snap = self._snapshot[n]
                cur = t.detach().to("cpu").contiguous()
                if list(cur.shape) != list(snap.shape) or cur.dtype != snap.dtype:
                    raise InvalidArgumentError(f"tensor '{n}': not the shape and dtype of its first push")
                ch = codec.diff(cur, snap, name=n)
                if len(ch.positions) == 0:
                    continue
                pos, val = ch.as_torch(snap.dtype)
                staged.append((snap, pos, val))
                tensors_changed += 1
                changed += int(pos.numel())
                nbytes += pos.numel() * 8 + val.numel() * val.element_size()
                base = {"name": n, "dtype": dtype_name(snap), "shape": list(snap.shape),
                        "count": int(pos.numel())}
                cap = self._cap(over, dict(base, chunk=pos.numel()))
                per = 8 + val.element_size()
                if pos.numel() * per <= cap:
                    pieces.append(_Piece(base, [(_key(base, "positions"), pos),
                                                (_key(base, "values"), val)]))
                    continue
                step = max(1, cap // per)
                for j, a in enumerate(range(0, pos.numel(), step)):
                    b = min(a + step, pos.numel())
                    e = dict(base, count=b - a, chunk=j)
                    pieces.append(_Piece(e, [(_key(e, "positions"), pos, a, b),
                                             (_key(e, "values"), val, a, b)]))
            stats = {"tensors_changed": tensors_changed, "changed_elements": changed,
                     "bytes": nbytes}
        calls = self._calls_of(pieces, over)
        for i, (entries, group) in enumerate(calls):
            tensors = [kt for p in group for kt in p.materialize()]
            self._calls += 1
            m = dict(head, call=f"{push_id}.{i:06d}", part=i, parts=len(calls), tensors=entries)
            if i == 0:
                m.update(first_extra)
            mt = _manifest_tensor(m)
            total = mt.numel() + sum(t.numel() * t.element_size() for _, t in tensors)
            if total > self.bucket_bytes:
                raise InternalError(f"a call of {total} bytes over bucket_bytes {self.bucket_bytes}")
            what = (f"push {push_id} (step {m['step']}, {'full' if first else 'delta'}), "
                    f"call {i + 1} of {len(calls)}")
            self._send([(MANIFEST, mt)] + tensors,
                       self.flush_cache if i == len(calls) - 1 else False, m["call"], what)
        # Sent and applied everywhere: the snapshot advances.
        if first:
            self._snapshot = host
        else:
            for snap, pos, val in staged:
                snap.view(-1)[pos] = val
        self.step += 1
        return {"step": self.step, "full": first, **stats, "calls": len(calls)}


def _sglang_serializer() -> Callable[[Any], str]:
    try:
        from sglang.srt.utils import MultiprocessingSerializer
    except ImportError as e:
        raise UnsupportedError(
            f"SGLangHTTPClient: sglang is not importable here ({e}); pass serialize=") from None
    patch = None
    for mod in ("sglang.srt.utils.patch_torch", "sglang.srt.patch_torch"):
        try:
            patch = __import__(mod, fromlist=["monkey_patch_torch_reductions"])
            break
        except ImportError:
            continue

    def serialize(obj: Any) -> str:
        if patch is not None:
            patch.monkey_patch_torch_reductions()
        return MultiprocessingSerializer.serialize(obj, output_str=True)

    return serialize


def _post_json(url: str, body: dict, timeout_s: float) -> tuple[int, dict]:
    import urllib.error
    import urllib.request

    req = urllib.request.Request(url, data=json.dumps(body).encode("utf-8"),
                                 headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    try:
        reply = json.loads(raw.decode("utf-8") or "{}")
    except ValueError:
        reply = {"message": raw[:500].decode("utf-8", "replace")}
    return status, reply if isinstance(reply, dict) else {"message": str(reply)}


class SGLangHTTPClient:
    """``update_weights_from_tensor`` for an SGLang server (``url``), as
    :class:`SGLangPusher` calls it. The server's route takes one serialized
    payload per TP rank (``tp_size`` of them, SGLang's
    ``MultiprocessingSerializer`` with ``output_str=True``), so its tensors
    travel as CUDA IPC handles or shared memory: the trainer runs on the
    server's host. ``serialize`` and ``post(url, body, timeout_s) ->
    (status, reply)`` replace SGLang's serializer and the HTTP request."""

    def __init__(self, url: str, tp_size: int, *, timeout_s: float = 600.0,
                 serialize: Optional[Callable[[Any], str]] = None,
                 post: Optional[Callable[[str, dict, float], tuple]] = None) -> None:
        if int(tp_size) < 1:
            raise InvalidArgumentError(f"SGLangHTTPClient: tp_size {tp_size}")
        self.url = url.rstrip("/")
        self.tp_size = int(tp_size)
        self.timeout_s = timeout_s
        self._serialize = serialize
        self._post = post or _post_json

    def update_weights_from_tensor(self, named_tensors: list, load_format: Optional[str] = None,
                                   flush_cache: bool = True) -> tuple[bool, str]:
        """POSTs ``/update_weights_from_tensor``; returns SGLang's (success, message)."""
        ser = self._serialize or _sglang_serializer()
        body = {"serialized_named_tensors": [ser(list(named_tensors)) for _ in range(self.tp_size)],
                "load_format": load_format, "flush_cache": flush_cache}
        status, reply = self._post(self.url + "/update_weights_from_tensor", body, self.timeout_s)
        ok = reply.get("success")
        if not isinstance(ok, bool):
            ok = status == 200
        return ok, str(reply.get("message", f"HTTP {status}"))


__all__ = ["DEFAULT_BUCKET_BYTES", "LOAD_FORMAT", "SGLangHTTPClient", "SGLangPusher",
           "custom_loader", "engine_weights", "load_weights", "sync_status", "torch_dtype"]
