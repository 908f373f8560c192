"""Stand-ins for SGLang and vLLM with their exact call signatures, and a small
tensor-parallel model whose load_weights does what theirs does: TP row and
column slices, fused q/k/v and gate/up, stacked experts, a vocab-parallel
embedding, a renamed tensor, and a tensor its loader transforms (which the
adapters must send through the stock path)."""

from __future__ import annotations

import re
import sys
import types
from typing import Any, Iterable

import torch
from torch import nn

HIDDEN, Q, KV, INTER, VOCAB, LAYERS, EXPERTS = 64, 64, 32, 96, 128, 2, 2


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor) -> None:
    assert param.size() == loaded.size(), (param.size(), loaded.size())
    param.data.copy_(loaded)


class TinyTPModel(nn.Module):
    """A Llama/Qwen-shaped model sliced for TP rank ``rank`` of ``size``."""

    def __init__(self, rank: int, size: int, dtype=torch.bfloat16, device="cpu") -> None:
        super().__init__()
        self.rank, self.size = rank, size
        p = lambda *shape: nn.Parameter(torch.zeros(*shape, dtype=dtype, device=device),
                                        requires_grad=False)
        self.params: dict[str, nn.Parameter] = {}
        self.params["model.embed_tokens.weight"] = p(VOCAB // size, HIDDEN)
        for i in range(LAYERS):
            pre = f"model.layers.{i}."
            self.params[pre + "self_attn.qkv_proj.weight"] = p((Q + 2 * KV) // size, HIDDEN)
            self.params[pre + "self_attn.o_proj.weight"] = p(HIDDEN, Q // size)
            self.params[pre + "mlp.gate_up_proj.weight"] = p(2 * INTER // size, HIDDEN)
            self.params[pre + "mlp.down_proj.weight"] = p(HIDDEN, INTER // size)
            self.params[pre + "mlp.experts.w13"] = p(EXPERTS, INTER // size, HIDDEN)
            self.params[pre + "input_layernorm.weight"] = p(HIDDEN)
            self.params[pre + "rotary.scale"] = p(HIDDEN)
        self.params["model.final_layernorm.weight"] = p(HIDDEN)
        self.params["lm_head.weight"] = p(VOCAB // size, HIDDEN)
        self.plist = nn.ParameterList(list(self.params.values()))

    def named_parameters(self, *args: Any, **kwargs: Any):  # the checkpoint's names, as engines
        for k, v in self.params.items():
            yield k, v

    def _rows(self, loaded: torch.Tensor, dim: int) -> torch.Tensor:
        shard = loaded.shape[dim] // self.size
        return loaded.narrow(dim, self.rank * shard, shard)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set:
        stacked = [("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"),
                   ("qkv_proj", "v_proj", "v"), ("gate_up_proj", "gate_proj", 0),
                   ("gate_up_proj", "up_proj", 1)]
        params = dict(self.named_parameters())
        loaded_names = set()
        for name, w in weights:
            if name == "model.norm.weight":  # renamed in this engine
                name = "model.final_layernorm.weight"
            m = re.match(r"(model\.layers\.\d+\.mlp)\.experts\.(\d+)\.w1\.weight", name)
            if m:
                param = params[m.group(1) + ".experts.w13"]
                param.data[int(m.group(2))].copy_(self._rows(w, 0))
                loaded_names.add(name)
                continue
            for pname, wname, shard in stacked:
                if wname not in name:
                    continue
                param = params[name.replace(wname, pname)]
                if shard in ("q", "k", "v"):
                    sizes = {"q": Q // self.size, "k": KV // self.size, "v": KV // self.size}
                    offset = {"q": 0, "k": sizes["q"], "v": sizes["q"] + sizes["k"]}[shard]
                    param.data.narrow(0, offset, sizes[shard]).copy_(self._rows(w, 0))
                else:
                    n = INTER // self.size
                    param.data.narrow(0, shard * n, n).copy_(self._rows(w, 0))
                break
            else:
                param = params[name]
                if name.endswith("o_proj.weight") or name.endswith("down_proj.weight"):
                    param.data.copy_(self._rows(w, 1))  # column slice
                elif name.endswith("embed_tokens.weight") or name == "lm_head.weight":
                    param.data.copy_(self._rows(w, 0))
                elif name.endswith("rotary.scale"):
                    param.data.copy_(w.flip(0))  # computed: not a view of the input
                else:
                    default_weight_loader(param, w)
            loaded_names.add(name)
        return loaded_names


def checkpoint_shapes() -> dict[str, list[int]]:
    out = {"model.embed_tokens.weight": [VOCAB, HIDDEN]}
    for i in range(LAYERS):
        pre = f"model.layers.{i}."
        out[pre + "self_attn.q_proj.weight"] = [Q, HIDDEN]
        out[pre + "self_attn.k_proj.weight"] = [KV, HIDDEN]
        out[pre + "self_attn.v_proj.weight"] = [KV, HIDDEN]
        out[pre + "self_attn.o_proj.weight"] = [HIDDEN, Q]
        out[pre + "mlp.gate_proj.weight"] = [INTER, HIDDEN]
        out[pre + "mlp.up_proj.weight"] = [INTER, HIDDEN]
        out[pre + "mlp.down_proj.weight"] = [HIDDEN, INTER]
        for e in range(EXPERTS):
            out[pre + f"mlp.experts.{e}.w1.weight"] = [INTER, HIDDEN]
        out[pre + "input_layernorm.weight"] = [HIDDEN]
        out[pre + "rotary.scale"] = [HIDDEN]
    out["model.norm.weight"] = [HIDDEN]
    out["lm_head.weight"] = [VOCAB, HIDDEN]
    return out


def make_checkpoint(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g).to(torch.bfloat16) for n, s in checkpoint_shapes().items()}


def rl_step(ckpt: dict[str, torch.Tensor], step: int, density: float = 0.02) -> None:
    """Changes about ``density`` of the elements in place (a true NaN too)."""
    g = torch.Generator().manual_seed(1000 + step)
    for i, t in enumerate(ckpt.values()):
        flat = t.view(-1)
        mask = torch.rand(flat.numel(), generator=g) < density
        flat[mask] = (flat[mask].float() + 0.01 * torch.randn(int(mask.sum()), generator=g)).to(t.dtype)
        if i == 3 and step % 2 == 1:
            flat[5] = float("nan")


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def reference(rank: int, size: int, ckpt: dict[str, torch.Tensor], device="cpu") -> TinyTPModel:
    m = TinyTPModel(rank, size, device=device)
    m.load_weights([(n, t.to(device)) for n, t in ckpt.items()])
    return m


def assert_matches_reference(model: TinyTPModel, ckpt: dict[str, torch.Tensor]) -> None:
    device = next(iter(model.params.values())).device
    ref = reference(model.rank, model.size, ckpt, device)
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert same_bits(p.data, q.data), f"parameter {n} differs from a full load"


# --- SGLang: the model runner's update_weights_from_tensor -----------------


class SGLangEngineStandIn:
    """``sgl.Engine`` as the trainer sees it, with ``tp_size`` workers in this
    process. update_weights_from_tensor does what SGLang's ModelRunner does:
    moves each tensor to the worker's device, then dispatches on load_format
    (None: model.load_weights; a name listed in --custom-weight-loader: that
    function, imported by its dotted path)."""

    def __init__(self, tp_size: int, custom_weight_loader: list[str], device: str = "cpu") -> None:
        self.device = device
        self.workers = [TinyTPModel(r, tp_size, device=device) for r in range(tp_size)]
        self.custom_weight_loader = list(custom_weight_loader)

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        import importlib

        for model in self.workers:
            tensors = [(n, t.to(self.device)) for n, t in named_tensors]
            if load_format == "direct":
                raise NotImplementedError
            elif load_format in self.custom_weight_loader:
                module, _, fn = load_format.rpartition(".")
                getattr(importlib.import_module(module), fn)(model, tensors)
            elif load_format is None:
                model.load_weights(tensors)
            else:
                raise NotImplementedError(f"Unknown load_format={load_format}")
        return True, "Success"


# --- vLLM: the weight transfer engine API ------------------------------------


def install_vllm_standin() -> type:
    """Installs modules ``vllm.distributed.weight_transfer.base`` and
    ``.factory`` with vLLM's WeightTransferEngine and its factory (the
    signatures of vLLM's main branch), and returns the factory class."""
    import abc
    import importlib

    base = types.ModuleType("vllm.distributed.weight_transfer.base")

    class WeightTransferEngine(abc.ABC):
        init_info_cls: type
        update_info_cls: type

        def __init__(self, config, vllm_config, device, model) -> None:
            self.config = config
            self.vllm_config = vllm_config
            self.parallel_config = vllm_config.parallel_config
            self.device = device
            self.model = model

        def parse_init_info(self, init_dict):
            try:
                return self.init_info_cls(**init_dict)
            except TypeError as e:
                raise ValueError(f"Invalid init_info for {self.__class__.__name__}: {e}") from e

        def parse_update_info(self, update_dict):
            try:
                return self.update_info_cls(**update_dict)
            except TypeError as e:
                raise ValueError(f"Invalid update_info for {self.__class__.__name__}: {e}") from e

        @abc.abstractmethod
        def init_transfer_engine(self, init_info) -> None: ...

        @abc.abstractmethod
        def start_weight_update(self) -> None: ...

        @abc.abstractmethod
        def finish_weight_update(self) -> None: ...

        def update_weights(self, update_info: dict) -> None:
            self.receive_weights(self.parse_update_info(update_info))

        @abc.abstractmethod
        def receive_weights(self, update_info) -> None: ...

        @abc.abstractmethod
        def shutdown(self) -> None: ...

    base.WeightTransferEngine = WeightTransferEngine
    factory = types.ModuleType("vllm.distributed.weight_transfer.factory")

    class WeightTransferEngineFactory:
        _registry: dict = {}

        @classmethod
        def register_engine(cls, name, module_path_or_cls, class_name=None):
            if name in cls._registry:
                raise ValueError(f"Weight transfer engine '{name}' is already registered.")
            if isinstance(module_path_or_cls, str):
                def loader():
                    return getattr(importlib.import_module(module_path_or_cls), class_name)
                cls._registry[name] = loader
            else:
                cls._registry[name] = lambda: module_path_or_cls

        @classmethod
        def create_engine(cls, config, vllm_config, device, model):
            if config.backend not in cls._registry:
                raise ValueError(f"Invalid weight transfer backend: {config.backend}")
            return cls._registry[config.backend]()(config, vllm_config, device, model)

    factory.WeightTransferEngineFactory = WeightTransferEngineFactory
    for name in ("vllm", "vllm.distributed", "vllm.distributed.weight_transfer"):
        sys.modules.setdefault(name, types.ModuleType(name))
    sys.modules["vllm.distributed.weight_transfer.base"] = base
    sys.modules["vllm.distributed.weight_transfer.factory"] = factory
    sys.modules.pop("deltasync.adapters.vllm", None)
    return WeightTransferEngineFactory


class VLLMClientStandIn:
    """The engine side of vLLM's weight-sync control plane
    (VLLMWeightSyncClient) over in-process workers: each call runs on every
    worker, as the engine core's collective_rpc does."""

    def __init__(self, engines: list) -> None:
        self.engines = engines
        self.calls: list[str] = []

    def _all(self, fn) -> None:
        import threading

        errors = []

        def run(e):
            try:
                fn(e)
            except BaseException as ex:
                errors.append(ex)

        ts = [threading.Thread(target=run, args=(e,)) for e in self.engines]
        [t.start() for t in ts]
        [t.join() for t in ts]
        if errors:
            raise errors[0]

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.calls.append("init")
        self._all(lambda e: e.init_transfer_engine(e.parse_init_info(init_info)))

    def start_weight_update(self) -> None:
        self.calls.append("start")
        self._all(lambda e: e.start_weight_update())

    def update_weights(self, update_info: dict) -> None:
        self.calls.append("update")
        self._all(lambda e: e.update_weights(update_info))

    def finish_weight_update(self, weight_version=None) -> None:
        self.calls.append("finish")
        self._all(lambda e: e.finish_weight_update())
