"""Stand-ins for the parts of vLLM the vLLM adapter meets beyond the
weight transfer engine and its factory (standins.install_vllm_standin):
the plugin loader workers run, a data-parallel ParallelConfig, the draft
hooks of the engine base class, the ``LLM`` and ``AsyncLLM`` clients with
the arguments each takes, and vLLM's layerwise reload with a worker that
runs it itself. Each names the vLLM file (vllm-project/vllm) and the commit
its behaviour was read from."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import inspect
import re
import sys
import weakref
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

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


# --- layerwise reload: vllm/model_executor/model_loader/reload/ ---------------


def default_weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
    param.data.copy_(loaded_weight)


def _params_buffers(layer: nn.Module) -> tuple[dict, dict]:
    """``get_layer_params_buffers``: the layer's own tensors (``reload/utils.py``
    at 1fe187b43d0dd269fbb5e9da0087dfd6bb16d9f3)."""
    return ({n: p for n, p in layer._parameters.items() if p is not None},
            {n: b for n, b in layer._buffers.items() if b is not None})


def _tensors(layer: nn.Module) -> dict:
    params, buffers = _params_buffers(layer)
    return {**params, **buffers}


class CopyCounter(TorchDispatchMode):
    """Counts the elements ``copy_`` writes (``reload/utils.py`` above)."""

    def __init__(self) -> None:
        super().__init__()
        self.copied_numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.copy_.default:
            self.copied_numel += args[0].numel()
        return func(*args, **(kwargs or {}))


def _to_meta(t: torch.Tensor) -> torch.Tensor:
    """``to_meta_tensor``: class and attributes (``weight_loader``) kept."""
    meta = t.data.to("meta")
    meta.__class__ = t.__class__
    meta.__dict__ = t.__dict__.copy()
    return meta


def _materialize(meta: torch.Tensor) -> torch.Tensor:
    """``materialize_meta_tensor``: uninitialized memory of the meta tensor's layout."""
    t = torch.empty_strided(tuple(meta.size()), tuple(meta.stride()), dtype=meta.dtype)
    t.__class__ = meta.__class__
    t.__dict__ = meta.__dict__.copy()
    return t


class LayerReloadingInfo:
    """``LayerReloadingInfo`` (``reload/types.py``) as ``layerwise.py`` at
    fc26ee2a3ecf4f2fba5a6dc4b357d86f4854ac53 uses it."""

    def __init__(self) -> None:
        self.restore_metadata: tuple = ({}, {})
        self.reset()

    def reset(self) -> None:
        self.load_numel = 0
        self.load_numel_total = None
        self.loaded_weights: list = []
        self.kernel_tensors = None

    def can_process(self) -> bool:
        return self.load_numel_total is not None


LAYERWISE_INFO: "weakref.WeakKeyDictionary[nn.Module, LayerReloadingInfo]" = (
    weakref.WeakKeyDictionary())


def _info(layer: nn.Module) -> LayerReloadingInfo:
    if layer not in LAYERWISE_INFO:
        LAYERWISE_INFO[layer] = LayerReloadingInfo()
    return LAYERWISE_INFO[layer]


def record_metadata_for_reloading(model: nn.Module) -> None:
    """Records every layer's tensors as meta tensors (the model loader does
    this when it builds the model)."""
    for layer in model.modules():
        params, buffers = _params_buffers(layer)
        _info(layer).restore_metadata = ({n: _to_meta(p) for n, p in params.items()},
                                         {n: _to_meta(b) for n, b in buffers.items()})


def _loader(t: torch.Tensor):
    return getattr(t, "weight_loader", default_weight_loader)


def _original_loader(t: torch.Tensor):
    loader = _loader(t)
    while loader.__name__ == "online_process_loader":
        loader = loader.__wrapped__
    return loader


def _place_kernel_tensors(layer: nn.Module, info: LayerReloadingInfo) -> None:
    for name in _tensors(layer):
        delattr(layer, name)
    params, buffers = info.kernel_tensors
    for name, p in params.items():
        layer.register_parameter(name, p)
    for name, b in buffers.items():
        layer.register_buffer(name, b)


def _layerwise_process(layer: nn.Module, info: LayerReloadingInfo) -> None:
    """Materializes the layer, loads what was buffered, runs its quant
    method's processing, copies every tensor into the kernel tensors and
    puts those back."""
    for name, t in _tensors(layer).items():
        if t.is_meta:
            setattr(layer, name, _materialize(t))
    for t in _tensors(layer).values():
        t.weight_loader = _original_loader(t)
    for name, args in info.loaded_weights:
        param = getattr(layer, name)
        args.arguments["param"] = param
        param.weight_loader(*args.args, **args.kwargs)
    quant_method = getattr(layer, "quant_method", None)
    if quant_method is not None:
        quant_method.process_weights_after_loading(layer)
    params, buffers = info.kernel_tensors
    for name, p in params.items():
        p.data.copy_(getattr(layer, name))
    for name, b in buffers.items():
        b.data.copy_(getattr(layer, name))
    _place_kernel_tensors(layer, info)
    info.reset()


def _online_process_loader(layer: nn.Module, param_name: str):
    info = _info(layer)
    original = _original_loader(getattr(layer, param_name))
    signature = inspect.signature(original)

    @functools.wraps(original, assigned=("__doc__", "__annotations__"))
    def online_process_loader(*args, **kwargs):
        if not info.can_process():
            return None
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        info.loaded_weights.append((param_name, bound))
        with CopyCounter() as counter:
            ret = original(*bound.args, **bound.kwargs)
        info.load_numel += counter.copied_numel
        if info.load_numel >= info.load_numel_total:
            _layerwise_process(layer, info)
        return ret

    return online_process_loader


@torch.no_grad()
def initialize_layerwise_reload(model: nn.Module) -> None:
    """vLLM's ``initialize_layerwise_reload`` (``reload/layerwise.py`` at
    fc26ee2a3ecf4f2fba5a6dc4b357d86f4854ac53, ``restore_layer_on_meta`` of
    ``reload/meta.py`` at 08f95fe5616661c4f8547a46ebdaa1ed22736edb): for
    every layer, keeps its tensors aside as the kernel tensors, registers
    the recorded meta tensors in their place and wraps their weight
    loaders, which buffer what ``load_weights`` gives them; once a layer has
    all its elements it is materialized, loaded, processed and copied into
    the kernel tensors, which go back into the layer."""
    for layer in model.modules():
        info = _info(layer)
        if info.can_process():
            continue
        info.kernel_tensors = _params_buffers(layer)
        params, buffers = info.restore_metadata
        for name in set(_tensors(layer)) | set(params) | set(buffers):
            if hasattr(layer, name):
                delattr(layer, name)
        for name, p in params.items():
            layer.register_parameter(name, p)
        for name, b in buffers.items():
            layer.register_buffer(name, b)
        info.load_numel = 0
        info.load_numel_total = sum(t.numel() for t in _tensors(layer).values())
        for name, t in _tensors(layer).items():
            if _loader(t).__name__ != "online_process_loader":
                t.weight_loader = _online_process_loader(layer, name)


@torch.no_grad()
def finalize_layerwise_reload(model: nn.Module, model_config: Any) -> None:
    """vLLM's ``finalize_layerwise_reload`` (``layerwise.py`` above, no
    attention layer here): a layer nothing was loaded into gets its kernel
    tensors back as they are; one loaded in part is processed with the rest
    of its tensors uninitialized."""
    for layer in model.modules():
        info = _info(layer)
        if info.can_process() and info.load_numel <= 0:
            _place_kernel_tensors(layer, info)
        elif 0 < info.load_numel < (info.load_numel_total or 0):
            _layerwise_process(layer, info)
        info.reset()


RH, RKV, RI, RLAYERS = 32, 16, 48, 2  # hidden, one KV head's rows, intermediate, layers


class ShardedLinear(nn.Module):
    """A linear layer whose ``weight`` carries its ``weight_loader`` as an
    attribute, as vLLM's layers set it (``QKVParallelLinear`` and
    ``MergedColumnParallelLinear`` with shards, one TP rank)."""

    def __init__(self, gen: torch.Generator, rows: int, cols: int, shards: Any = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(rows, cols, generator=gen).to(torch.bfloat16),
                                   requires_grad=False)
        self.shards = shards
        self.weight.weight_loader = self.weight_loader if shards else default_weight_loader

    def weight_loader(self, param: torch.Tensor, loaded_weight: torch.Tensor,
                      loaded_shard_id: Any) -> None:
        offset, size = self.shards[loaded_shard_id]
        param.data.narrow(0, offset, size).copy_(loaded_weight)


class ReloadLayer(nn.Module):
    def __init__(self, gen: torch.Generator) -> None:
        super().__init__()
        self.self_attn = nn.Module()
        self.self_attn.qkv_proj = ShardedLinear(
            gen, RH + 2 * RKV, RH, {"q": (0, RH), "k": (RH, RKV), "v": (RH + RKV, RKV)})
        self.mlp = nn.Module()
        self.mlp.gate_up_proj = ShardedLinear(gen, 2 * RI, RH, {0: (0, RI), 1: (RI, RI)})
        self.mlp.down_proj = ShardedLinear(gen, RH, RI)
        self.input_layernorm = ShardedLinear(gen, 1, RH)


class ReloadModel(nn.Module):
    """A Llama-shaped model whose ``load_weights`` goes through each
    parameter's ``weight_loader`` (``stacked_params_mapping`` of
    ``vllm/model_executor/models/llama.py``), so vLLM's layerwise reload
    can wrap it."""

    def __init__(self, seed: int = 7) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.model = nn.Module()
        self.model.layers = nn.ModuleList([ReloadLayer(g) for _ in range(RLAYERS)])

    def shapes(self) -> dict:
        out = {}
        for i in range(RLAYERS):
            pre = f"model.layers.{i}."
            for n, rows in (("q", RH), ("k", RKV), ("v", RKV)):
                out[pre + f"self_attn.{n}_proj.weight"] = (torch.bfloat16, [rows, RH])
            out[pre + "mlp.gate_proj.weight"] = (torch.bfloat16, [RI, RH])
            out[pre + "mlp.up_proj.weight"] = (torch.bfloat16, [RI, RH])
            out[pre + "mlp.down_proj.weight"] = (torch.bfloat16, [RH, RI])
            out[pre + "input_layernorm.weight"] = (torch.bfloat16, [1, RH])
        return out

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set:
        stacked = [("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"),
                   ("qkv_proj", "v_proj", "v"), ("gate_up_proj", "gate_proj", 0),
                   ("gate_up_proj", "up_proj", 1)]
        params = dict(self.named_parameters())
        loaded = set()
        for name, w in weights:
            for param_name, shard_name, shard_id in stacked:
                if re.search(rf"\.{shard_name}\.", name):
                    param = params[name.replace(shard_name, param_name)]
                    param.weight_loader(param, w, shard_id)
                    break
            else:
                param = params[name]
                _loader(param)(param, w)
            loaded.add(name)
        return loaded


class LayerwiseReloadWorker:
    """The weight-sync calls of a worker that runs vLLM's layerwise reload
    itself, as vLLM's GPU worker did until vllm-project/vllm#44353 moved it
    into the engines (``vllm/v1/worker/gpu_worker.py`` before it; from
    0.25.0 the worker calls the engine's start/finish, as
    standins.VLLMClientStandIn does, and ``vllm/distributed/weight_transfer/
    base.py`` at 02f250b03f38822ccdb63f27a3005d10ca81f385 leaves them no-ops
    for an in-place engine). ``start_weight_update(is_checkpoint_format=
    True)`` runs ``initialize_layerwise_reload(model)``; ``update_weights``
    gives the engine's ``receive_weights`` the typed update info and
    ``load_weights``: ``model.load_weights``, or for kernel format a copy
    into ``model.get_parameter(name)``; ``finish_weight_update`` runs
    ``finalize_layerwise_reload(model, model_config)`` for checkpoint
    format. The engine's own start and finish are not called."""

    def __init__(self, engine: Any, model: nn.Module, model_config: Any) -> None:
        self.engine, self.model, self.model_config = engine, model, model_config
        self.active = False
        self.is_checkpoint_format = True

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.engine.init_transfer_engine(self.engine.parse_init_info(init_info))

    def start_weight_update(self, is_checkpoint_format: bool = True) -> None:
        if self.active:
            raise RuntimeError("start_weight_update called while a weight update is already "
                               "active. Call finish_weight_update first.")
        if is_checkpoint_format:
            initialize_layerwise_reload(self.model)
        self.is_checkpoint_format = is_checkpoint_format
        self.active = True

    def update_weights(self, update_info: dict) -> None:
        if not self.active:
            raise RuntimeError("start_weight_update must be called before update_weights.")
        typed = self.engine.parse_update_info(update_info)
        if self.is_checkpoint_format:
            self.engine.receive_weights(typed, load_weights=self.model.load_weights)
            return

        def load_weights_direct(weights: list) -> None:
            for name, weight in weights:
                self.model.get_parameter(name).copy_(weight)

        self.engine.receive_weights(typed, load_weights=load_weights_direct)

    def finish_weight_update(self) -> None:
        if not self.active:
            raise RuntimeError("start_weight_update must be called before finish_weight_update.")
        if self.is_checkpoint_format:
            finalize_layerwise_reload(self.model, self.model_config)
        self.active = False
        self.is_checkpoint_format = True


class LayerwiseReloadClient(VLLMClientStandIn):
    """The control plane over :class:`LayerwiseReloadWorker` workers, whose
    ``start_weight_update`` passes them ``is_checkpoint_format`` (the flag
    of ``LLM.start_weight_update`` then)."""

    def __init__(self, workers: list, is_checkpoint_format: bool = True) -> None:
        super().__init__(workers)
        self.is_checkpoint_format = is_checkpoint_format

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.calls.append("init")
        self._all(lambda w: w.init_weight_transfer_engine(init_info))

    def start_weight_update(self) -> None:
        self.calls.append("start")
        self._all(lambda w: w.start_weight_update(self.is_checkpoint_format))

    def update_weights(self, update_info: dict) -> None:
        self.calls.append("update")
        self._all(lambda w: w.update_weights(update_info))

    def finish_weight_update(self, weight_version=None) -> None:
        self.calls.append("finish")
        self._all(lambda w: w.finish_weight_update())
