"""Stand-ins for the parts of vLLM the vLLM adapter meets beyond the
weight transfer engine and its factory (standins.install_vllm_standin):
the plugin loader workers run, a data-parallel ParallelConfig, the draft
hooks of the engine base class, and the ``LLM`` and ``AsyncLLM`` clients
with the arguments each takes. Each names the vLLM file (vllm-project/vllm)
and the commit its behaviour was read from."""

from __future__ import annotations

import asyncio
import dataclasses
import sys
from dataclasses import dataclass, field
from typing import Any

from standins import VLLMClientStandIn, install_vllm_standin

PLUGINS_GROUP = "vllm.general_plugins"


def install() -> type:
    """standins.install_vllm_standin() plus what newer vLLM's
    ``vllm/distributed/weight_transfer/base.py`` has (commit
    02f250b03f38822ccdb63f27a3005d10ca81f385): the API-level requests
    ``WeightTransferInitRequest(init_info: dict)`` and
    ``WeightTransferUpdateRequest(update_info: dict)``, and the engine's
    draft hooks (``supports_draft_weight_update = True`` by default,
    ``set_weight_update_target(model, model_config)`` /
    ``reset_weight_update_target()`` retargeting ``self.model``). Returns
    the factory class."""
    factory = install_vllm_standin()
    base = sys.modules["vllm.distributed.weight_transfer.base"]

    @dataclass
    class WeightTransferInitRequest:
        init_info: dict = field(default_factory=dict)

    @dataclass
    class WeightTransferUpdateRequest:
        update_info: dict = field(default_factory=dict)

    base.WeightTransferInitRequest = WeightTransferInitRequest
    base.WeightTransferUpdateRequest = WeightTransferUpdateRequest
    engine = base.WeightTransferEngine
    engine.supports_draft_weight_update = True

    def set_weight_update_target(self, model, model_config):
        if not hasattr(self, "_default_model"):
            self._default_model = self.model
        self.model = model

    def reset_weight_update_target(self):
        self.model = getattr(self, "_default_model", self.model)

    engine.set_weight_update_target = set_weight_update_target
    engine.reset_weight_update_target = reset_weight_update_target
    return factory


class Config:
    """``WeightTransferConfig`` naming the deltasync backend."""

    backend = "deltasync"


@dataclass
class ParallelConfig:
    """The fields of ``vllm/config/parallel.py``'s ParallelConfig that
    vLLM's own NCCL engine reads to number a worker (``vllm/distributed/
    weight_transfer/nccl_engine.py``, commit
    04b06efe2a8eca78e3ce13cd80992f7f440c928a: ``rank =
    data_parallel_index * world_size + rank + init_info.rank_offset``):
    ``rank`` within the replica (set by WorkerBase), ``world_size`` (TP x
    PP), ``data_parallel_index`` (the replica, equal to the data-parallel
    rank)."""

    rank: int = 0
    world_size: int = 1
    data_parallel_index: int = 0
    data_parallel_size: int = 1

    @property
    def data_parallel_rank(self) -> int:
        return self.data_parallel_index


@dataclass
class ModelConfig:
    """The field of ``vllm/config/model.py``'s ModelConfig that vLLM's
    ``process_weights_after_loading`` (``vllm/model_executor/model_loader/
    utils.py``, commit 3d333269ca2218f2ec4c19d2bfd738f555be3000) gives the
    attention layers: the model's ``dtype``."""

    dtype: Any = None


@dataclass
class VllmConfig:
    parallel_config: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    model_config: ModelConfig = dataclasses.field(default_factory=ModelConfig)


# --- plugins: vllm/plugins/__init__.py ---------------------------------------


def load_general_plugins() -> list[str]:
    """vLLM's ``load_general_plugins`` (``vllm/plugins/__init__.py``, commit
    01425553bdbed63400efa72ff14a8f4ffe20bada), which every worker runs in its
    own process from ``WorkerWrapperBase.init_worker``
    (``vllm/v1/worker/worker_base.py``, commit
    09aa6b34bf7bd7f309464cefb570552144db41c3): it discovers plugins only
    through ``importlib.metadata.entry_points(group="vllm.general_plugins")``,
    loads each and calls it. Returns the names it ran."""
    from importlib.metadata import entry_points

    ran = []
    for plugin in entry_points(group=PLUGINS_GROUP):
        plugin.load()()
        ran.append(plugin.name)
    return ran


def plugin_probe(dist_dir: str, queue: Any) -> None:
    """A worker process's start, run in a spawned process: the installed
    distributions on sys.path (``dist_dir`` added), vLLM's modules, the
    plugin loader run twice (vLLM warns plugins may be loaded more than
    once), then what the factory holds. Nothing registers the backend but
    the plugins found."""
    try:
        sys.path.insert(0, dist_dir)
        factory = install()
        ran = load_general_plugins()
        ran += load_general_plugins()
        loader = factory._registry.get("deltasync")
        engine = loader() if loader else None
        queue.put({"ran": ran, "backends": sorted(factory._registry),
                   "engine": f"{engine.__module__}.{engine.__qualname__}" if engine else None})
    except BaseException as e:  # reported to the test
        queue.put({"error": f"{type(e).__name__}: {e}"})


# --- clients: vllm/entrypoints/llm.py, vllm/v1/engine/async_llm.py ------------


class LLMStandIn:
    """``vllm.LLM``'s weight-sync calls (``vllm/entrypoints/llm.py``, commit
    10fdb8f0d75a3ad1122b87020f1359d3fc51f2ca): ``init_weight_transfer_engine(
    request)`` and ``update_weights(request)`` take a request object or a
    dict and read ``request["init_info"]`` / ``request["update_info"]``
    from a dict, then run the worker call on every worker; later releases
    add ``start_weight_update()`` and ``finish_weight_update()`` the same
    way."""

    def __init__(self, engines: list) -> None:
        self.workers = VLLMClientStandIn(engines)
        self.calls = self.workers.calls

    def init_weight_transfer_engine(self, request) -> None:
        init_info = request["init_info"] if isinstance(request, dict) else request.init_info
        self.workers.init_weight_transfer_engine(init_info)

    def start_weight_update(self) -> None:
        self.workers.start_weight_update()

    def update_weights(self, request) -> None:
        update_info = request["update_info"] if isinstance(request, dict) else request.update_info
        self.workers.update_weights(update_info)

    def finish_weight_update(self) -> None:
        self.workers.finish_weight_update()


class AsyncLLMStandIn:
    """``AsyncLLM``'s weight-sync calls (``vllm/v1/engine/async_llm.py``,
    commit 00080ee13c7a451fce071ccb8d0e94d395acf5a7): coroutines on the
    engine's event loop; ``init_weight_transfer_engine(request:
    WeightTransferInitRequest)`` reads ``request.init_info`` (an earlier
    version refuses anything but a WeightTransferInitRequest with a
    TypeError), ``update_weights(request: WeightTransferUpdateRequest)``
    reads ``request.update_info``, ``finish_weight_update(weight_version=
    None)``. The worker calls run off the loop, as its collective_rpc
    awaits the workers without blocking the loop."""

    def __init__(self, engines: list) -> None:
        self.workers = VLLMClientStandIn(engines)
        self.calls = self.workers.calls

    async def _off_loop(self, fn, *args) -> None:
        await asyncio.get_running_loop().run_in_executor(None, fn, *args)

    async def init_weight_transfer_engine(self, request) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        if not isinstance(request, WeightTransferInitRequest):
            raise TypeError(f"Expected WeightTransferInitRequest, got {type(request)}")
        await self._off_loop(self.workers.init_weight_transfer_engine, request.init_info)

    async def start_weight_update(self) -> None:
        await self._off_loop(self.workers.start_weight_update)

    async def update_weights(self, request) -> None:
        await self._off_loop(self.workers.update_weights, request.update_info)

    async def finish_weight_update(self, weight_version=None) -> None:
        await self._off_loop(self.workers.finish_weight_update)
