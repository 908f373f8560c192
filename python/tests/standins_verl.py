"""A stand-in for the parts of verl a checkpoint engine meets, as read from
verl-project/verl at commit 1dda039b9c6311889a9c9a26040677e1254814f9:

* ``verl/checkpoint_engine/base.py``: ``CheckpointEngineRegistry``
  (``register(backend)`` a plain function of the class used as a
  decorator, ``get`` raising ValueError that lists the registered
  backends, ``new(backend, *args, **kwargs)``), the abstract
  ``CheckpointEngine`` (``wire_format = "named_tensors"``; ``prepare()``,
  the classmethod ``build_topology(actor_wg_world_size,
  rollout_world_size, metadata)`` returning the actor's and the rollout's
  kwargs as lists one per worker, ``init_process_group(**kwargs)``,
  ``finalize()``, ``async send_weights(weights, global_steps=None)``,
  ``async receive_weights(global_steps=None)``), the ``"naive"`` engine
  registered beside them, ``CheckpointEngineWorker`` (the rollout side:
  builds its engine with ``CheckpointEngineRegistry.new(backend,
  bucket_size=..., **engine_kwargs)`` after importing
  ``custom_backend_module``, and its ``update_weights`` hands
  ``receive_weights(global_steps=...)`` to the server adapter's
  ``update_weights(weights, global_steps=..., wire_format=...)``) and
  ``CheckpointEngineManager`` (each step: ``prepare`` on every trainer rank
  then every rollout worker, ``build_topology``, a check that each kwarg
  list is as long as its group, ``init_process_group`` everywhere, the
  trainer's and the rollout's ``update_weights`` together, the trainer
  ranks' metrics merged, ``finalize`` everywhere; the replicas' abort,
  KV-cache release and resume around it touch no checkpoint engine and
  are left out);
* ``verl/workers/engine_workers.py``: the trainer side builds its engine
  with ``is_master=(rank == 0)`` and ``bucket_size`` plus
  ``engine_kwargs[backend]``, and each rank's ``update_weights`` awaits
  ``send_weights(per_tensor_param, global_steps=...)`` with the training
  engine's ``get_per_tensor_param()`` generator (every rank iterates it:
  FSDP gathers each tensor collectively) and returns its metrics or ``{}``;
* ``verl/workers/config/rollout.py``: ``CheckpointEngineConfig`` (backend,
  update_weights_bucket_megabytes, engine_kwargs, custom_backend_module);
* ``verl/workers/rollout/utils.py``: ``ensure_async_iterator``;
  ``verl/workers/rollout/vllm_rollout/bucketed_weight_transfer.py``: the
  server adapter copies each yielded tensor into its own buffer (the
  yielded tensor is not kept); ``tests/checkpoint_engine/test_utils.py``:
  a server adapter consumes the weights with ``async for``.

Ray's processes are threads here, one per worker and call, each with its
own event loop; a manager's call on every worker returns when all have
returned (or raises, as ``ray.get`` does, listing each worker's error).
"""

from __future__ import annotations

import abc
import asyncio
import dataclasses
import importlib
import sys
import threading
import types
from typing import Any, Callable, Optional

import torch

MODULES = ("verl", "verl.checkpoint_engine", "verl.checkpoint_engine.base")


def install() -> types.ModuleType:
    """Installs ``verl``, ``verl.checkpoint_engine`` and
    ``verl.checkpoint_engine.base`` (a fresh registry holding ``"naive"``);
    returns the base module."""
    uninstall()
    base = types.ModuleType("verl.checkpoint_engine.base")

    class CheckpointEngineRegistry:
        _registry: dict = {}
        _import_errors: dict = {}

        def register(backend: str):  # noqa: N805 - as verl's: a function of the class
            def wrapper(cls):
                CheckpointEngineRegistry._registry[backend] = cls
                return cls

            return wrapper

        @classmethod
        def record_import_error(cls, module, error):
            cls._import_errors[module] = error

        @classmethod
        def get(cls, backend):
            if backend not in cls._registry:
                message = (f"Checkpoint engine {backend} not registered, registered backends: "
                           f"{sorted(cls._registry)}")
                raise ValueError(message)
            return cls._registry[backend]

        @classmethod
        def new(cls, backend, *args, **kwargs):
            return cls.get(backend)(*args, **kwargs)

    class CheckpointEngine(abc.ABC):
        wire_format = "named_tensors"

        @abc.abstractmethod
        def prepare(self):
            raise NotImplementedError

        @classmethod
        @abc.abstractmethod
        def build_topology(cls, actor_wg_world_size, rollout_world_size, metadata):
            raise NotImplementedError

        @abc.abstractmethod
        def init_process_group(self, **kwargs):
            raise NotImplementedError

        @abc.abstractmethod
        def finalize(self):
            raise NotImplementedError

        @abc.abstractmethod
        async def send_weights(self, weights, global_steps=None):
            raise NotImplementedError

        @abc.abstractmethod
        async def receive_weights(self, global_steps=None):
            raise NotImplementedError

    @CheckpointEngineRegistry.register("naive")
    class ColocatedCheckpointEngine(CheckpointEngine):
        def __init__(self, bucket_size, is_master=False):
            self.bucket_size = bucket_size
            self.is_master = is_master

        def prepare(self):
            raise NotImplementedError

        def init_process_group(self, **kwargs):
            raise NotImplementedError

        def finalize(self):
            raise NotImplementedError

        @classmethod
        def build_topology(cls, *args, **kwargs):
            raise NotImplementedError

        def send_weights(self, weights, global_steps=None):
            self.weights = weights

        def receive_weights(self, global_steps=None):
            yield from self.weights
            self.weights = None

    base.CheckpointEngineRegistry = CheckpointEngineRegistry
    base.CheckpointEngine = CheckpointEngine
    base.ColocatedCheckpointEngine = ColocatedCheckpointEngine
    verl = types.ModuleType("verl")
    package = types.ModuleType("verl.checkpoint_engine")
    package.CheckpointEngine = CheckpointEngine
    package.CheckpointEngineRegistry = CheckpointEngineRegistry
    package.ColocatedCheckpointEngine = ColocatedCheckpointEngine
    package.base = base
    verl.checkpoint_engine = package
    for name, module in zip(MODULES, (verl, package, base)):
        sys.modules[name] = module
    return base


def uninstall() -> None:
    for name in MODULES:
        sys.modules.pop(name, None)


@dataclasses.dataclass
class CheckpointEngineConfig:
    """verl/workers/config/rollout.py's CheckpointEngineConfig."""

    backend: Optional[str] = "naive"
    update_weights_bucket_megabytes: int = 2048
    engine_kwargs: dict = dataclasses.field(default_factory=dict)
    custom_backend_module: Optional[str] = None


def import_external_libs(external_libs=None) -> None:
    """verl/utils/import_utils.py's import_external_libs."""
    if external_libs is None:
        return
    if not isinstance(external_libs, list):
        external_libs = [external_libs]
    for lib in external_libs:
        importlib.import_module(lib)


async def ensure_async_iterator(iterable):
    if hasattr(iterable, "__aiter__"):
        async for item in iterable:
            yield item
    else:
        for item in iterable:
            yield item


def _registry():
    return sys.modules["verl.checkpoint_engine.base"].CheckpointEngineRegistry


class TrainerWorker:
    """One trainer rank: its model (every rank holds the same full tensors,
    as FSDP's full export yields them) and its checkpoint engine."""

    def __init__(self, rank: int, config: CheckpointEngineConfig,
                 export: Callable[[int], Any]) -> None:
        self.rank = rank
        self.export = export  # rank -> the (name, tensor) generator of this step
        backend = config.backend
        import_external_libs(config.custom_backend_module or None)
        self.checkpoint_engine = _registry().new(
            backend, is_master=(rank == 0),
            bucket_size=config.update_weights_bucket_megabytes << 20,
            **config.engine_kwargs.get(backend, {}))

    async def update_weights(self, global_steps=None):
        metrics = await self.checkpoint_engine.send_weights(self.export(self.rank),
                                                            global_steps=global_steps)
        return metrics or {}

    def execute_checkpoint_engine(self, method, *args, **kwargs):
        return getattr(self.checkpoint_engine, method)(*args, **kwargs)


class ServerAdapter:
    """The inference engine's side: copies each yielded tensor into its own
    weights (as the bucketed IPC transfer copies into its buffer)."""

    def __init__(self) -> None:
        self.weights: dict[str, torch.Tensor] = {}
        self.updates: list[list[str]] = []

    async def update_weights(self, weights, global_steps=None, wire_format="named_tensors",
                             **kwargs):
        assert wire_format == "named_tensors", wire_format
        names = []
        async for name, t in ensure_async_iterator(weights):
            held = self.weights.get(name)
            if held is None or held.shape != t.shape or held.dtype != t.dtype:
                held = self.weights[name] = torch.empty_like(t, device="cpu")
            held.copy_(t)
            names.append(name)
        self.updates.append(names)


class RolloutWorker:
    """verl's CheckpointEngineWorker: one rollout worker of one replica."""

    def __init__(self, config: CheckpointEngineConfig, server_adapter: ServerAdapter) -> None:
        backend = config.backend
        self.server_adapter = server_adapter
        import_external_libs(config.custom_backend_module or None)
        self.checkpoint_engine = _registry().new(
            backend, bucket_size=config.update_weights_bucket_megabytes << 20,
            **config.engine_kwargs.get(backend, {}))

    async def update_weights(self, global_steps=None):
        weights = self.checkpoint_engine.receive_weights(global_steps=global_steps)
        await self.server_adapter.update_weights(
            weights, global_steps=global_steps,
            wire_format=getattr(self.checkpoint_engine, "wire_format", "named_tensors"))

    def execute_checkpoint_engine(self, method, *args, **kwargs):
        return getattr(self.checkpoint_engine, method)(*args, **kwargs)


class WorkerErrors(Exception):
    """Some workers of a call raised: ``errors`` maps each worker's index
    (trainer ranks first) to its exception."""

    def __init__(self, errors: dict) -> None:
        super().__init__("; ".join(f"worker {i}: {e!r}" for i, e in sorted(errors.items())))
        self.errors = errors


def call_all(calls: list, timeout_s: float = 60.0) -> list:
    """Runs every call (a function returning a value or a coroutine) in its
    own thread, together; returns their results, or raises WorkerErrors
    (a worker still running after ``timeout_s`` counts as a TimeoutError)."""
    results: list = [None] * len(calls)
    errors: dict = {}

    def run(i, fn):
        try:
            value = fn()
            if asyncio.iscoroutine(value):
                value = asyncio.run(value)
            results[i] = value
        except BaseException as e:  # reported to the caller
            errors[i] = e

    threads = [threading.Thread(target=run, args=(i, fn), daemon=True)
               for i, fn in enumerate(calls)]
    for t in threads:
        t.start()
    for i, t in enumerate(threads):
        t.join(timeout_s)
        if t.is_alive():
            errors[i] = TimeoutError(f"worker {i} did not return within {timeout_s} s")
    if errors:
        raise WorkerErrors(errors)
    return results


class CheckpointEngineManager:
    """verl's CheckpointEngineManager over the workers above (trainer ranks
    are verl's actor worker group, rollout workers every replica's workers
    in order)."""

    def __init__(self, config: CheckpointEngineConfig, trainers: list, rollouts: list) -> None:
        self.config = config
        import_external_libs(config.custom_backend_module or None)
        self.backend_cls = _registry().get(config.backend)
        self.trainers = trainers
        self.rollouts = rollouts

    def _execute(self, per_worker: list) -> list:
        workers = self.trainers + self.rollouts
        return call_all([(lambda w=w, a=a: w.execute_checkpoint_engine(a[0], **a[1]))
                         for w, a in zip(workers, per_worker)])

    def build_process_group(self) -> None:
        a, r = len(self.trainers), len(self.rollouts)
        metadata = self._execute([("prepare", {})] * (a + r))
        actor_kwargs, rollout_kwargs = self.backend_cls.build_topology(a, r, metadata)
        for k, v in actor_kwargs.items():
            assert len(v) == a, f"actor_wg_kwargs[{k}] must have length of {a}"
        for k, v in rollout_kwargs.items():
            assert len(v) == r, f"rollout_kwargs[{k}] must have length of {r}"
        per_worker = [("init_process_group", {k: v[i] for k, v in actor_kwargs.items()})
                      for i in range(a)]
        per_worker += [("init_process_group", {k: v[j] for k, v in rollout_kwargs.items()})
                       for j in range(r)]
        self._execute(per_worker)

    def update_weights(self, global_steps=None) -> dict:
        self.build_process_group()
        workers = self.trainers + self.rollouts
        results = call_all([(lambda w=w: w.update_weights(global_steps=global_steps))
                            for w in workers])
        metrics: dict = {}
        for result in results[:len(self.trainers)]:
            if isinstance(result, dict):
                metrics.update(result)
        self._execute([("finalize", {})] * len(workers))
        return metrics
