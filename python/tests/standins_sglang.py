"""A stand-in for an SGLang server's weight-update path, in one process, as
deltasync's SGLang adapter meets it. Each piece follows SGLang's source
(sgl-project/sglang, file at commit):

* ``entrypoints/engine.py`` (001067fffe33427bee0ed2f007fb7551a1d76b44),
  ``Engine.update_weights_from_tensor``: serializes the (name, tensor) list
  once per TP rank and returns the tokenizer manager's (success, message).
* ``entrypoints/http_server.py`` (0025436eab0556737d615b36a4dd3e1e26e82f3d),
  route ``/update_weights_from_tensor``: the body is
  ``UpdateWeightsFromTensorReqInput`` (``serialized_named_tensors``, one
  base64 string per TP rank, ``load_format``, ``flush_cache``); it answers
  ``{"success", "message"}`` with 200 or 400.
* ``managers/scheduler_update_weights_mixin.py``
  (018c9109680f6f5b0654114b9159101256e1e18b): ``worker = self.draft_worker
  or self.tp_worker``, no handler around the update; ``managers/scheduler.py``
  (0003215cf1464f44b389cd0b18d0b4c56f2a3da6), ``run_scheduler_process``: an
  exception out of the event loop is logged and the parent gets SIGQUIT, so
  the server dies. Here the scheduler marks itself dead and every later
  request raises :class:`SchedulerDied`.
* ``speculative/eagle_worker.py`` (00559eacbf0841146db7e27e445d1971e35e6294):
  the draft runner gets the deserialized payload first, then the target's
  runner the same list, stopping at the first failure;
  ``managers/scheduler_components/weight_updater.py``
  (00a2ca2e56d59f0a19186d7a8a58bdda5201023f) runs the target first, then the
  draft (``draft_first=False``).
* ``model_executor/model_runner.py`` (0005834cdb2a5b7472789ccbf0d3361b5cf853b8):
  ``update_weights_from_tensor`` moves every tensor to the device, then
  dispatches on ``load_format`` ("direct", a name listed in
  ``--custom-weight-loader``: that function by its dotted path, None:
  ``model.load_weights``, else NotImplementedError) and returns
  ``(True, "Success")``; ``update_weights_from_distributed`` receives the
  broadcast and runs ``model.load_weights`` inside a handler that returns
  ``(False, message)``: it never calls a custom loader.
"""

from __future__ import annotations

import base64
import importlib
import pickle
import traceback
from typing import Any, Callable, Iterable, Optional

import torch
from torch import nn

from standins import HIDDEN, INTER, VOCAB, TinyTPModel, same_bits


class SchedulerDied(RuntimeError):
    """The stand-in's scheduler hit an exception: in SGLang the server is gone."""


class MTPDraft(nn.Module):
    """A draft model as SGLang's NextN/MTP drafts are: its loader takes the
    few checkpoint tensors it holds (here layer 1's down_proj, column
    sliced) and skips the rest; the embedding is the target's own parameter
    (``set_embed_and_head``). ``strict``: an EAGLE-style draft whose loader
    does not know the trainer's names and raises on them."""

    def __init__(self, target: TinyTPModel, strict: bool = False) -> None:
        super().__init__()
        self.rank, self.size, self.strict = target.rank, target.size, strict
        dtype = target.params["lm_head.weight"].dtype
        device = target.params["lm_head.weight"].device
        self.embed = target.params["model.embed_tokens.weight"]  # shared, not a copy
        self.down = nn.Parameter(torch.zeros(HIDDEN, INTER // self.size, dtype=dtype, device=device),
                                 requires_grad=False)

    def named_parameters(self, *args: Any, **kwargs: Any):
        yield "model.embed_tokens.weight", self.embed
        yield "mtp.down_proj.weight", self.down

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, w in weights:
            if name == "model.embed_tokens.weight":
                shard = VOCAB // self.size
                self.embed.data.copy_(w.narrow(0, self.rank * shard, shard))
            elif name == "model.layers.1.mlp.down_proj.weight":
                shard = INTER // self.size
                self.down.data.copy_(w.narrow(1, self.rank * shard, shard))
            elif self.strict:
                raise KeyError(f"model.{name}")


class EagleDraft(MTPDraft):
    """An EAGLE-style draft (its loader raises on the target's names)."""

    def __init__(self, target: TinyTPModel) -> None:
        super().__init__(target, strict=True)


def draft_matches_reference(draft: MTPDraft, ckpt: dict) -> bool:
    ref_target = TinyTPModel(draft.rank, draft.size, device=draft.down.device)
    ref = MTPDraft(ref_target)
    ref.load_weights([(n, t.to(draft.down.device)) for n, t in ckpt.items()])
    return all(same_bits(a.data, b.data) for (_, a), (_, b) in
               zip(draft.named_parameters(), ref.named_parameters()))


class _Request:
    def __init__(self, serialized: list, load_format: Optional[str], flush_cache: bool) -> None:
        self.serialized_named_tensors = serialized
        self.load_format = load_format
        self.flush_cache = flush_cache


class _ModelRunner:
    def __init__(self, server: "SGLangServerStandIn", model: nn.Module, rank: int, role: str) -> None:
        self.server, self.model, self.tp_rank, self.role = server, model, rank, role

    def update_weights_from_tensor(self, named_tensors: list, load_format: Optional[str]):
        s = self.server
        named_tensors = [(n, t.to(s.device)) for n, t in named_tensors]
        s.device_bytes.append((self.tp_rank, self.role,
                               sum(t.numel() * t.element_size() for _, t in named_tensors)))
        if load_format == "direct":
            raise NotImplementedError
        elif load_format in s.custom_weight_loader:
            s.loader_calls.append((self.tp_rank, self.role, named_tensors))
            module, _, fn = load_format.rpartition(".")
            getattr(importlib.import_module(module), fn)(self.model, named_tensors)
        elif load_format is None:
            self.model.load_weights(named_tensors)
        else:
            raise NotImplementedError(f"Unknown load_format={load_format}")
        return True, "Success"

    def update_weights_from_distributed(self, names, dtypes, shapes, group_name, load_format=None):
        try:
            weights = []
            for name, dtype, shape in zip(names, dtypes, shapes):
                weights.append((name, self.server.broadcast(name, dtype, shape).to(self.server.device)))
            self.model.load_weights(weights)
            return True, "Succeeded to update parameter online."
        except Exception as e:
            return False, (f"Failed to update parameter online: {e}. The full weights of the "
                           "ModelRunner are partially updated. Please discard the whole weights.")


class _TpWorker:
    def __init__(self, runner: _ModelRunner) -> None:
        self.model_runner = runner

    def update_weights_from_tensor(self, req: _Request):
        named_tensors = pickle.loads(req.serialized_named_tensors[self.model_runner.tp_rank])
        return self.model_runner.update_weights_from_tensor(named_tensors, req.load_format)


class _DraftWorker:
    def __init__(self, draft: _ModelRunner, target: _ModelRunner, draft_first: bool) -> None:
        self.order = [draft, target] if draft_first else [target, draft]

    def update_weights_from_tensor(self, req: _Request):
        named_tensors = pickle.loads(req.serialized_named_tensors[self.order[0].tp_rank])
        success, message = True, "Success"
        for runner in self.order:
            success, message = runner.update_weights_from_tensor(named_tensors, req.load_format)
            if not success:
                break
        return success, message


class SGLangServerStandIn:
    """``tp_size`` TP ranks of one SGLang server, each a scheduler with a
    TinyTPModel (and, with ``draft="mtp"`` or ``"eagle"``, a draft model
    beside it). ``update_weights_from_tensor`` is ``sglang.Engine``'s call;
    ``http_post`` is the HTTP route; ``update_weights_from_distributed`` the
    broadcast path (its tensors come from ``broadcast(name, dtype, shape)``).
    ``tamper(rank, named_tensors)`` may alter each rank's deserialized
    payload (a payload damaged or malformed on its way)."""

    def __init__(self, tp_size: int, custom_weight_loader: list[str], *, draft: Optional[str] = None,
                 draft_first: bool = True, device: str = "cpu") -> None:
        self.tp_size = tp_size
        self.custom_weight_loader = list(custom_weight_loader)
        self.draft_kind = draft
        self.draft_first = draft_first
        self.device = device
        self.alive = True
        self.death: Optional[str] = None
        self.requests: list[dict] = []
        self.loader_calls: list = []
        self.device_bytes: list = []
        self.distributed_calls = 0
        self.flushes = 0
        self.tamper: Optional[Callable[[int, list], list]] = None
        self.broadcast: Callable = lambda name, dtype, shape: torch.zeros(shape)
        self.restart()

    def restart(self) -> None:
        """A fresh server: new models (zeros), no adapter state."""
        self.workers = [TinyTPModel(r, self.tp_size, device=self.device) for r in range(self.tp_size)]
        self.drafts = []
        self._schedulers = []
        for r, model in enumerate(self.workers):
            target = _ModelRunner(self, model, r, "target")
            if self.draft_kind is None:
                self._schedulers.append(_TpWorker(target))
                continue
            d = (EagleDraft if self.draft_kind == "eagle" else MTPDraft)(model)
            self.drafts.append(d)
            self._schedulers.append(_DraftWorker(_ModelRunner(self, d, r, "draft"), target,
                                                 self.draft_first))
        self.alive = True

    def _run(self, req: _Request) -> tuple[bool, str]:
        if not self.alive:
            raise SchedulerDied(f"the server is dead: {self.death}")
        self.requests.append({"bytes": [len(s) for s in req.serialized_named_tensors],
                              "flush_cache": req.flush_cache, "load_format": req.load_format})
        results = []
        for rank, worker in enumerate(self._schedulers):
            try:
                if self.tamper is not None:
                    named_tensors = pickle.loads(req.serialized_named_tensors[rank])
                    req_r = _Request(list(req.serialized_named_tensors), req.load_format,
                                     req.flush_cache)
                    req_r.serialized_named_tensors[rank] = pickle.dumps(self.tamper(rank, named_tensors))
                else:
                    req_r = req
                success, message = worker.update_weights_from_tensor(req_r)
            except Exception:
                self.alive = False
                self.death = traceback.format_exc()
                raise SchedulerDied(f"TP{rank} scheduler hit an exception: SIGQUIT to the "
                                    f"server\n{self.death}") from None
            if success and req.flush_cache:
                self.flushes += 1
            results.append((success, message))
        return results[0]  # the tokenizer manager answers with rank 0's output

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        serialized = [pickle.dumps(list(named_tensors)) for _ in range(self.tp_size)]
        return self._run(_Request(serialized, load_format, flush_cache))

    def http_post(self, path: str, body: dict) -> tuple[int, dict]:
        """POST ``path`` with the JSON ``body``: (status, reply)."""
        if path != "/update_weights_from_tensor":
            return 404, {"message": "Not Found"}
        payloads = body.get("serialized_named_tensors")
        if not isinstance(payloads, list) or not all(isinstance(p, str) for p in payloads):
            return 400, {"message": "serialized_named_tensors: a list of strings is required"}
        extra = set(body) - {"serialized_named_tensors", "load_format", "flush_cache",
                             "abort_all_requests", "weight_version"}
        if extra:
            return 400, {"message": f"unexpected fields {sorted(extra)}"}
        req = _Request([base64.b64decode(p, validate=True) for p in payloads],
                       body.get("load_format"), body.get("flush_cache", True))
        success, message = self._run(req)
        return (200 if success else 400), {"success": success, "message": message}

    def update_weights_from_distributed(self, names, dtypes, shapes, group_name="weight_update_group",
                                        flush_cache=True, load_format=None):
        self.distributed_calls += 1
        results = [w.order[-1 if self.draft_first else 0].update_weights_from_distributed(
                       names, dtypes, shapes, group_name, load_format)
                   if isinstance(w, _DraftWorker) else
                   w.model_runner.update_weights_from_distributed(
                       names, dtypes, shapes, group_name, load_format)
                   for w in self._schedulers]
        return results[0]


def http_serialize(obj: Any) -> str:
    """What ``MultiprocessingSerializer.serialize(obj, output_str=True)`` gives
    the route here: base64 of a pickle (in-process, no IPC handles)."""
    return base64.b64encode(pickle.dumps(obj)).decode("ascii")
