"""SGLang: deltas through ``update_weights_from_tensor``, applied in place.

Engine side: start SGLang with ``--custom-weight-loader
deltasync.adapters.sglang.load_weights``. SGLang then calls
:func:`load_weights` ``(model, named_tensors)`` in every TP worker for an
``update_weights_from_tensor(..., load_format=LOAD_FORMAT)`` request.

Trainer side: :class:`SGLangPusher` ``(engine).push(state_dict)`` after each
step. The first push sends every tensor whole (through the model's stock
``load_weights``); every later one sends only the changed elements of each
changed tensor, as two tensors (positions, values), which each worker
scatters straight into the parameters the dry run mapped
(:mod:`.weight_map`).

Payload (a list of (name, tensor) pairs): ``"__deltasync__"`` is a uint8
tensor of UTF-8 JSON, ``{"format": 1, "step": n, "base_step": n-1 or null,
"full": bool, "tensors": [{"name", "dtype", "shape", "count"}]}``; a whole
tensor travels under its name, a delta as ``"<name>#positions"`` (int64)
and ``"<name>#values"`` (the tensor's dtype). A worker applies step ``n``
only on top of step ``n-1``, checks every part first, and raises (writing
nothing) on anything out of order or malformed.
"""

from __future__ import annotations

import json
from typing import Any, Optional

import torch

from .. import codec
from .._tensors import dtype_name, named
from ..errors import CorruptionError, FailedPreconditionError, InvalidArgumentError
from .engine import EngineWeights, torch_dtype

LOAD_FORMAT = "deltasync.adapters.sglang.load_weights"
MANIFEST = "__deltasync__"
FORMAT = 1

_STATE_ATTR = "_deltasync_engine_weights"
_STEP_ATTR = "_deltasync_step"


def engine_weights(model: torch.nn.Module) -> Optional[EngineWeights]:
    """The adapter's state in a worker's model (None before the first push)."""
    return getattr(model, _STATE_ATTR, None)


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
        raise CorruptionError(f"deltasync payload: manifest format {m.get('format')!r}, "
                              f"this deltasync reads {FORMAT}")
    return m, parts


def load_weights(model: torch.nn.Module, named_tensors: list) -> None:
    """SGLang's custom weight loader: applies one deltasync payload to
    ``model`` (see the module docstring). Raises, writing nothing, for a
    payload out of order or malformed."""
    m, parts = _manifest(list(named_tensors))
    state = engine_weights(model)
    step = getattr(model, _STEP_ATTR, None)
    entries = m.get("tensors", [])
    if m.get("full"):
        if state is None:
            state = EngineWeights(model, [(e["name"], e["dtype"], e["shape"]) for e in entries])
        full = []
        for e in entries:
            t = parts.get(e["name"])
            if t is None:
                raise InvalidArgumentError(f"tensor '{e['name']}': in the manifest, not sent")
            full.append((e["name"], t))
        state.load_full(full)
        setattr(model, _STATE_ATTR, state)
        setattr(model, _STEP_ATTR, m["step"])
        return
    if state is None:
        raise FailedPreconditionError(
            "deltasync: a delta before any full push (the trainer must push whole tensors first)"
        )
    if m.get("base_step") != step:
        raise FailedPreconditionError(
            f"deltasync: step {m.get('step')} applies on step {m.get('base_step')}, "
            f"this worker holds step {step}"
        )
    deltas = []
    for e in entries:
        name = e["name"]
        pos = parts.get(name + "#positions")
        val = parts.get(name + "#values")
        if pos is None or val is None:
            raise InvalidArgumentError(f"tensor '{name}': in the manifest, its delta not sent")
        if pos.numel() != e.get("count"):
            raise InvalidArgumentError(
                f"tensor '{name}': {pos.numel()} positions, the manifest says {e.get('count')}"
            )
        state.check_delta(name, pos, val)
        deltas.append((name, pos, val))
    for name, pos, val in deltas:
        state.apply_delta(name, pos, val)
    setattr(model, _STEP_ATTR, m["step"])


def _manifest_tensor(m: dict) -> torch.Tensor:
    data = json.dumps(m).encode("utf-8")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


class SGLangPusher:
    """The trainer's side: pushes each step's change to an SGLang engine.

    ``engine`` is anything with SGLang's ``update_weights_from_tensor(
    named_tensors, load_format=..., flush_cache=...)`` (``sglang.Engine``, or
    a client of the HTTP server's route). It keeps a host snapshot of the
    weights last pushed (the diff runs in deltasync's core).
    """

    def __init__(self, engine: Any, *, flush_cache: bool = True) -> None:
        self.engine = engine
        self.flush_cache = flush_cache
        self.step = 0
        self._snapshot: dict[str, torch.Tensor] = {}

    def _send(self, payload: list) -> None:
        try:
            self.engine.update_weights_from_tensor(
                named_tensors=payload, load_format=LOAD_FORMAT, flush_cache=self.flush_cache
            )
        except BaseException:
            # Some workers may hold the new step and some not: the next push
            # sends every tensor whole.
            self._snapshot = {}
            raise

    def push(self, weights: Any, *, full: bool = False) -> dict:
        """Pushes ``weights`` (a state dict or (name, tensor) pairs): the whole
        tensors at the first push (or with ``full``), else the changed
        elements. Returns ``step``, ``full``, ``tensors_changed``,
        ``changed_elements``, ``bytes``."""
        pairs = named(weights)
        first = not self._snapshot or full
        if first:
            host = {n: t.detach().to("cpu", copy=True).contiguous() for n, t in pairs}
            entries = [{"name": n, "dtype": dtype_name(t), "shape": list(t.shape), "count": t.numel()}
                       for n, t in host.items()]
            m = {"format": FORMAT, "step": self.step + 1, "base_step": None, "full": True,
                 "tensors": entries}
            payload = [(MANIFEST, _manifest_tensor(m))] + [(n, t) for n, t in pairs]
            self._send(payload)
            self._snapshot = host
            self.step += 1
            return {"step": self.step, "full": True, "tensors_changed": len(entries),
                    "changed_elements": sum(t.numel() for t in host.values()),
                    "bytes": sum(t.numel() * t.element_size() for t in host.values())}
        if set(n for n, _ in pairs) != set(self._snapshot):
            raise InvalidArgumentError("push: not the tensors of the first push")
        entries = []
        payload = []
        staged = []
        nbytes = 0
        changed = 0
        for n, t in pairs:
            snap = self._snapshot[n]
            cur = t.detach().to("cpu").contiguous()
            if list(cur.shape) != list(snap.shape) or cur.dtype != snap.dtype:
                raise InvalidArgumentError(f"tensor '{n}': not the shape and dtype of its first push")
            ch = codec.diff(cur, snap, name=n)
            if len(ch.positions) == 0:
                continue
            pos, val = ch.as_torch(snap.dtype)
            entries.append({"name": n, "dtype": dtype_name(snap), "shape": list(snap.shape),
                            "count": int(pos.numel())})
            payload += [(n + "#positions", pos), (n + "#values", val)]
            staged.append((snap, cur, pos, val))
            changed += int(pos.numel())
            nbytes += pos.numel() * 8 + val.numel() * val.element_size()
        m = {"format": FORMAT, "step": self.step + 1, "base_step": self.step, "full": False,
             "tensors": entries}
        self._send([(MANIFEST, _manifest_tensor(m))] + payload)
        # Sent and applied: the snapshot advances.
        for snap, cur, pos, val in staged:
            snap.view(-1)[pos] = val
        self.step += 1
        return {"step": self.step, "full": False, "tensors_changed": len(entries),
                "changed_elements": changed, "bytes": nbytes}


__all__ = ["LOAD_FORMAT", "SGLangPusher", "engine_weights", "load_weights", "torch_dtype"]
