"""Stand-ins for engine models whose ``load_weights`` does what the engines'
loaders do beyond plain copies of views, each after the engine source
named (repository, file at commit):

* :class:`KVScaleModel`: a one-element KV-cache scale loaded with
  ``param.data.fill_(loaded_weight.item())``, as vLLM's
  ``default_weight_loader`` does for a one-element parameter
  (vllm-project/vllm ``vllm/model_executor/model_loader/weight_utils.py``
  at 0a1ee72ed53f07ca8e57e5e82fdbd89734b39026), and its value kept beside it
  as a host float attribute of the attention layer (``layer._k_scale =
  k_scale`` in ``vllm/model_executor/layers/quantization/kv_cache.py`` at
  0531c2226a6a25cd96ccc856f3bda3f0bb4efb5f).
* :class:`PaddedEmbeddingModel`: an embedding whose rows are padded past the
  vocabulary, loaded as vLLM's ``VocabParallelEmbedding.weight_loader``
  does: a copy of the rows, then ``param[rows:].data.fill_(0)``
  (vllm-project/vllm ``vllm/model_executor/layers/vocab_parallel_embedding.py``
  at 7f5d141a0abde5fdedc220f55d9f19831c9a5b9e).
* :class:`PoolModel`: a DeepSeek-shaped loader that hands every copy to a
  ``concurrent.futures.ThreadPoolExecutor``, fuses ``q_a_proj`` and
  ``kv_a_proj_with_mqa`` (``torch.cat`` into ``fused_qkv_a_proj_with_mqa``)
  only once one call has given it both (``cached_a_proj``, local to the
  call), skips the layers of other pipeline stages
  (``start_layer``/``end_layer``) and then derives ``w_kc`` and ``w_vc``
  of each layer whose ``kv_b_proj`` the call loaded (``post_load_weights(
  weight_names=...)``: ``unflatten``/``split`` of ``kv_b_proj.weight``,
  copied into the old tensors by ``bind_or_assign``), as SGLang's
  ``DeepseekV2ForCausalLM.load_weights`` does (sgl-project/sglang
  ``python/sglang/srt/models/deepseek_v2.py`` at
  3e4a39ee73308590c5c753108bdcb8d333f7f1c6).
* :class:`AdoptingModel`: a loader that makes a parameter adopt the loaded
  tensor's memory (``param.set_(loaded_weight)``) and then derives a module
  attribute from it.
* :class:`MoEModel`: experts stacked per expert-parallel rank, whose
  ``weight_loader`` maps the global expert id through ``expert_map`` and
  returns at once for another rank's expert, as vLLM's
  ``FusedMoE.weight_loader`` does (vllm-project/vllm
  ``vllm/model_executor/layers/fused_moe/layer.py`` at
  c439a139790cafaecb54e8dea123b78049f1442b); layers of other pipeline stages
  are ``PPMissingLayer`` and their tensors skipped by
  ``is_pp_missing_parameter`` (vllm-project/vllm
  ``vllm/model_executor/models/utils.py`` at
  d30d0c133c3f47a6436788f82398b21eb23df8c0, used by
  ``vllm/model_executor/models/llama.py`` at
  e06c9ba2a6ea923a84add30f5dafaea126429b81); a tied ``lm_head`` is the
  embedding's parameter and its checkpoint tensor is skipped
  (``AutoWeightsLoader(skip_prefixes=["lm_head."])`` in that ``llama.py``).
  :meth:`MoEModel.rebalance` rebuilds a layer's experts for another
  assignment, as expert rebalancing does.
* :class:`VLLMModel` with :func:`vllm_process`: what vLLM's post-load
  processing makes of the loaded weights: the unquantized fused-MoE method
  swapping ``w13`` into ``[w3; w1]`` (FlashInfer-CUTLASS), shuffling it
  (AITER) or padding it (FlashInfer-TRT-LLM), and MLA attention deriving
  its absorbed weights from ``kv_b_proj`` (views, quantized copies, or
  copies into the tensors of the first load); each class names the files
  and commits it follows.
"""

from __future__ import annotations

import concurrent.futures
import queue
import re
import threading
from typing import Any, Iterable, Optional

import torch
from torch import nn

DT = torch.bfloat16


def _param(gen: torch.Generator, *shape: int, dtype: torch.dtype = DT) -> nn.Parameter:
    return nn.Parameter(torch.randn(*shape, generator=gen).to(dtype), requires_grad=False)


def default_weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
    if param.numel() == 1 and loaded_weight.numel() == 1:
        # One element: "broadcast" instead of copy.
        param.data.fill_(loaded_weight.item())
    else:
        assert param.size() == loaded_weight.size(), (param.size(), loaded_weight.size())
        param.data.copy_(loaded_weight)


# The expert loop of vLLM's MoE load_weights: an expert's HF tensor goes to
# the layer's stacked w13/w2 parameter through the FusedMoE weight loader
# (shard w1, w3 or w2, expert id), as MoEModel in the module docstring
# cites. True when `name` was an expert's.
_EXPERT_SHARDS = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


def _load_expert(model, params, name, w) -> bool:
    m = re.match(r"(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(\w+)\.weight", name)
    if not m:
        return False
    pname = m.group(1) + (".w2_weight" if m.group(3) == "down_proj" else ".w13_weight")
    moe = model.get_submodule(m.group(1))
    moe.weight_loader(params[pname], w, _EXPERT_SHARDS[m.group(3)], int(m.group(2)))
    return True

class Weight(nn.Module):
    def __init__(self, gen: torch.Generator, *shape: int, dtype: torch.dtype = DT) -> None:
        super().__init__()
        self.weight = _param(gen, *shape, dtype=dtype)


class PPMissingLayer(nn.Identity):
    """A layer of another pipeline stage."""


def is_pp_missing_parameter(name: str, model: nn.Module) -> bool:
    missing = [n + "." for n, m in model.named_modules() if isinstance(m, PPMissingLayer)]
    return any(name.startswith(p) for p in missing)


def layer_id(name: str) -> Optional[int]:
    m = re.search(r"\.layers\.(\d+)\.", name)
    return int(m.group(1)) if m else None


def reference(make: Any, ckpt: dict, seed: int = 99) -> nn.Module:
    """A fresh model from ``make(seed)`` loaded with the whole checkpoint."""
    m = make(seed)
    m.load_weights([(n, t.clone()) for n, t in ckpt.items()])
    return m


def randn_checkpoint(shapes: dict, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g).to(d) for n, (d, s) in shapes.items()}


# --- a one-element KV-cache scale (fill_ of item()) ------------------------------

H, KV, LAYERS = 32, 16, 2


class Attention(nn.Module):
    def __init__(self, gen: torch.Generator) -> None:
        super().__init__()
        self.qkv_proj = Weight(gen, H + 2 * KV, H)
        self.attn = nn.Module()
        self.attn.k_scale = _param(gen, 1, dtype=torch.float32)
        self.attn.v_scale = _param(gen, 1, dtype=torch.float32)
        self.attn._k_scale = float(self.attn.k_scale)  # the host copy
        self.attn._v_scale = float(self.attn.v_scale)


class KVScaleModel(nn.Module):
    def __init__(self, seed: int = 7) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.layers = nn.ModuleList(
            [nn.ModuleDict({"self_attn": Attention(g)}) for _ in range(LAYERS)])

    @staticmethod
    def shapes() -> dict:
        out = {}
        for i in range(LAYERS):
            pre = f"model.layers.{i}.self_attn."
            out[pre + "q_proj.weight"] = (DT, [H, H])
            out[pre + "k_proj.weight"] = (DT, [KV, H])
            out[pre + "v_proj.weight"] = (DT, [KV, H])
            out[pre + "k_scale"] = (torch.float32, [])
            out[pre + "v_scale"] = (torch.float32, [])
        return out

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set:
        params = dict(self.named_parameters())
        offsets = {"q_proj": (0, H), "k_proj": (H, KV), "v_proj": (H + KV, KV)}
        done = set()
        for name, w in weights:
            name = name.replace("model.", "", 1)
            for shard, (off, n) in offsets.items():
                if shard in name:
                    param = params[name.replace(shard, "qkv_proj")]
                    param.data.narrow(0, off, n).copy_(w)
                    break
            else:
                if name.endswith("_scale"):
                    name = name.replace(".k_scale", ".attn.k_scale").replace(
                        ".v_scale", ".attn.v_scale")
                default_weight_loader(params[name], w)
                if name.endswith("_scale"):
                    owner, attr = name.rsplit(".", 1)
                    setattr(self.get_submodule(owner), "_" + attr, float(w))
            done.add(name)
        return done


# --- an embedding padded past the vocabulary (fill_(0) of the padding) ------------

VOCAB, PAD = 64, 8


class PaddedEmbeddingModel(nn.Module):
    def __init__(self, seed: int = 7) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.embed_tokens = Weight(g, VOCAB + PAD, H)
        self.norm = Weight(g, H)

    @staticmethod
    def shapes() -> dict:
        return {"embed_tokens.weight": (DT, [VOCAB, H]), "norm.weight": (DT, [H])}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        for name, w in weights:
            param = params[name]
            if name == "embed_tokens.weight":
                param[: w.shape[0]].data.copy_(w)
                param[w.shape[0]:].data.fill_(0)
            else:
                default_weight_loader(param, w)


# --- a thread pool, fused projections, pipeline stages, a post-load step ---------

QA, KVA, KVB, INTER = 24, 16, 32, 40
NOPE, VHEAD = 8, 8  # kv_b_proj: 2 heads of (qk_nope_head_dim + v_head_dim) rows


class MLAAttention(nn.Module):
    def __init__(self, gen: torch.Generator) -> None:
        super().__init__()
        self.fused_qkv_a_proj_with_mqa = Weight(gen, QA + KVA, H)
        self.kv_b_proj = Weight(gen, KVB, KVA)
        self.o_proj = Weight(gen, H, H)
        self.w_kc: Optional[torch.Tensor] = None  # derived after loading
        self.w_vc: Optional[torch.Tensor] = None


class DenseMLP(nn.Module):
    def __init__(self, gen: torch.Generator) -> None:
        super().__init__()
        self.gate_up_proj = Weight(gen, 2 * INTER, H)
        self.down_proj = Weight(gen, H, INTER)

    def weight_loader(self, param: torch.Tensor, w: torch.Tensor, shard: int) -> None:
        param.data.narrow(0, shard * INTER, INTER).copy_(w)


class PoolLayer(nn.Module):
    def __init__(self, gen: torch.Generator) -> None:
        super().__init__()
        self.self_attn = MLAAttention(gen)
        self.mlp = DenseMLP(gen)
        self.input_layernorm = Weight(gen, H)


def bind_or_assign(target: Optional[torch.Tensor], source: torch.Tensor) -> torch.Tensor:
    if target is not None:
        target.copy_(source)
        return target
    return source


class PoolModel(nn.Module):
    """Layers ``start_layer .. end_layer-1`` of ``layers`` are this stage's."""

    def __init__(self, seed: int = 7, pp_rank: int = 0, pp_size: int = 1,
                 layers: int = 4) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        per = layers // pp_size
        self.start_layer, self.end_layer = pp_rank * per, (pp_rank + 1) * per
        self.model = nn.Module()
        self.model.layers = nn.ModuleList(
            [PoolLayer(g) if self.start_layer <= i < self.end_layer else PPMissingLayer()
             for i in range(layers)])
        self.n_layers = layers

    def shapes(self) -> dict:
        out = {}
        for i in range(self.n_layers):
            pre = f"model.layers.{i}."
            out[pre + "self_attn.q_a_proj.weight"] = (DT, [QA, H])
            out[pre + "self_attn.kv_a_proj_with_mqa.weight"] = (DT, [KVA, H])
            out[pre + "self_attn.kv_b_proj.weight"] = (DT, [KVB, KVA])
            out[pre + "self_attn.o_proj.weight"] = (DT, [H, H])
            out[pre + "mlp.gate_proj.weight"] = (DT, [INTER, H])
            out[pre + "mlp.up_proj.weight"] = (DT, [INTER, H])
            out[pre + "mlp.down_proj.weight"] = (DT, [H, INTER])
            out[pre + "input_layernorm.weight"] = (DT, [H])
        return out

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        stacked = [("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1)]
        cached_a_proj: dict = {}
        with concurrent.futures.ThreadPoolExecutor(max_workers=4) as executor:
            futures = []
            params = dict(self.named_parameters())
            weight_names = []
            for name, w in weights:
                lid = layer_id(name)
                if lid is not None and not self.start_layer <= lid < self.end_layer:
                    continue
                weight_names.append(name)
                for pname, wname, shard in stacked:
                    if wname not in name:
                        continue
                    name = name.replace(wname, pname)
                    mlp = self.model.layers[lid].mlp
                    futures.append(executor.submit(mlp.weight_loader, params[name], w, shard))
                    break
                else:
                    if "q_a_proj" in name or "kv_a_proj_with_mqa" in name:
                        cached_a_proj[name] = w
                        qa = name.replace("kv_a_proj_with_mqa", "q_a_proj")
                        kva = name.replace("q_a_proj", "kv_a_proj_with_mqa")
                        if qa in cached_a_proj and kva in cached_a_proj:
                            fused = torch.cat([cached_a_proj.pop(qa), cached_a_proj.pop(kva)])
                            param = params[qa.replace("q_a_proj", "fused_qkv_a_proj_with_mqa")]
                            futures.append(executor.submit(default_weight_loader, param, fused))
                        continue
                    futures.append(executor.submit(default_weight_loader, params[name], w))
            for f in concurrent.futures.as_completed(futures):
                f.result()
        self.post_load_weights(weight_names)

    def post_load_weights(self, weight_names: list) -> None:
        layer_ids = {layer_id(n) for n in weight_names if "kv_b_proj" in n}
        for lid in sorted(layer_ids):
            attn = self.model.layers[lid].self_attn
            w = attn.kv_b_proj.weight
            w_kc, w_vc = w.unflatten(0, (-1, NOPE + VHEAD)).split([NOPE, VHEAD], dim=1)
            attn.w_kc = bind_or_assign(attn.w_kc, w_kc.transpose(1, 2).contiguous().transpose(1, 2))
            attn.w_vc = bind_or_assign(attn.w_vc, w_vc.contiguous().transpose(1, 2))


# --- a parameter that adopts the loaded tensor's memory (set_) ---------------------

class AdoptingModel(nn.Module):
    def __init__(self, seed: int = 7) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.proj = Weight(g, H, H)
        self.norm = Weight(g, H, dtype=torch.float32)
        self.norm_inv = 1.0 / self.norm.weight.detach()  # derived after loading

    @staticmethod
    def shapes() -> dict:
        return {"proj.weight": (DT, [H, H]), "norm.weight": (torch.float32, [H])}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        for name, w in weights:
            if name == "norm.weight":
                with torch.no_grad():
                    params[name].set_(w)  # adopt the loaded memory, no copy
                self.norm_inv = 1.0 / self.norm.weight.detach()
            else:
                params[name].data.copy_(w)


# --- a loader writing on threads it starts ---------------------------------------

class ThreadModel(nn.Module):
    """Starts a thread for each copy and joins it."""

    def __init__(self, seed: int = 7) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.proj = Weight(g, H, H)
        self.norm = Weight(g, H)

    @staticmethod
    def shapes() -> dict:
        return {"proj.weight": (DT, [H, H]), "norm.weight": (DT, [H])}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        threads = [threading.Thread(target=default_weight_loader, args=(params[n], w))
                   for n, w in weights]
        for t in threads:
            t.start()
        for t in threads:
            t.join()


# --- a loader writing on a thread the dry run does not see -----------------------

class QueueWorkerModel(nn.Module):
    """Hands each copy to a worker thread started with the model (before any
    dry run) through a queue, and waits for it."""

    def __init__(self, seed: int = 7) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.proj = Weight(g, H, H)
        self._work: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    @staticmethod
    def shapes() -> dict:
        return {"proj.weight": (DT, [H, H])}

    def _serve(self) -> None:
        while True:
            param, w, done = self._work.get()
            param.data.copy_(w)
            done.set()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        for name, w in weights:
            done = threading.Event()
            self._work.put((params[name], w, done))
            done.wait(10)


# --- expert parallelism, pipeline stages, a tied lm_head --------------------------

V, E, MI = 64, 4, 24  # vocabulary, experts, expert intermediate size


class FusedMoE(nn.Module):
    """``local`` global expert ids, stacked in that order."""

    def __init__(self, gen: torch.Generator, local: list) -> None:
        super().__init__()
        self.register_buffer("expert_map", torch.full((E,), -1, dtype=torch.int32),
                             persistent=False)
        self._assign(gen, local)

    def _assign(self, gen: torch.Generator, local: list) -> None:
        self.expert_map.fill_(-1)
        for i, e in enumerate(local):
            self.expert_map[e] = i
        self.w13_weight = _param(gen, len(local), 2 * MI, H)
        self.w2_weight = _param(gen, len(local), H, MI)

    def weight_loader(self, param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: str,
                      expert_id: int) -> None:
        expert_id = self.expert_map[expert_id].item()  # global id -> local id
        if expert_id == -1:
            return  # another rank's expert
        expert_data = param.data[expert_id]
        if shard_id == "w2":
            expert_data.copy_(loaded_weight)
        else:
            off = 0 if shard_id == "w1" else MI
            expert_data.narrow(0, off, MI).copy_(loaded_weight)

    def rebalance(self, local: list, ckpt: dict, prefix: str) -> None:
        """Rebuilds the experts for another assignment (new parameters),
        filled with the checkpoint's current values of the experts it now
        holds, as expert rebalancing moves them between ranks."""
        with torch.no_grad():
            self._assign(torch.Generator().manual_seed(1), local)
            for i, e in enumerate(local):
                ex = f"{prefix}.experts.{e}."
                self.w13_weight[i, :MI] = ckpt[ex + "gate_proj.weight"]
                self.w13_weight[i, MI:] = ckpt[ex + "up_proj.weight"]
                self.w2_weight[i] = ckpt[ex + "down_proj.weight"]


class MoELayer(nn.Module):
    def __init__(self, gen: torch.Generator, local: list) -> None:
        super().__init__()
        self.self_attn = nn.Module()
        self.self_attn.qkv_proj = Weight(gen, H + 2 * KV, H)
        self.mlp = nn.Module()
        self.mlp.experts = FusedMoE(gen, local)
        self.input_layernorm = Weight(gen, H)


class MoEModel(nn.Module):
    """Expert-parallel rank ``ep_rank`` of ``ep_size`` (experts split in
    contiguous blocks), pipeline stage ``pp_rank`` of ``pp_size``; with
    ``tie``, ``lm_head`` is the embedding's parameter."""

    def __init__(self, seed: int = 7, ep_rank: int = 0, ep_size: int = 1, pp_rank: int = 0,
                 pp_size: int = 1, tie: bool = True, layers: int = 2) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.tie = tie
        self.n_layers = layers
        per = layers // pp_size
        first, last = pp_rank == 0, pp_rank == pp_size - 1
        start, end = pp_rank * per, (pp_rank + 1) * per
        local = list(range(ep_rank * E // ep_size, (ep_rank + 1) * E // ep_size))
        self.model = nn.Module()
        self.model.embed_tokens = Weight(g, V, H) if first else PPMissingLayer()
        self.model.layers = nn.ModuleList(
            [MoELayer(g, local) if start <= i < end else PPMissingLayer() for i in range(layers)])
        self.model.norm = Weight(g, H) if last else PPMissingLayer()
        if not last:
            self.lm_head = PPMissingLayer()
        elif tie:
            assert first, "a tied lm_head lives with the embedding"
            self.lm_head = nn.Module()
            self.lm_head.weight = self.model.embed_tokens.weight  # tie_weights
        else:
            self.lm_head = Weight(g, V, H)

    def shapes(self) -> dict:
        out = {"model.embed_tokens.weight": (DT, [V, H])}
        for i in range(self.n_layers):
            pre = f"model.layers.{i}."
            out[pre + "self_attn.q_proj.weight"] = (DT, [H, H])
            out[pre + "self_attn.k_proj.weight"] = (DT, [KV, H])
            out[pre + "self_attn.v_proj.weight"] = (DT, [KV, H])
            for e in range(E):
                for w in ("gate_proj", "up_proj"):
                    out[pre + f"mlp.experts.{e}.{w}.weight"] = (DT, [MI, H])
                out[pre + f"mlp.experts.{e}.down_proj.weight"] = (DT, [H, MI])
            out[pre + "input_layernorm.weight"] = (DT, [H])
        out["model.norm.weight"] = (DT, [H])
        out["lm_head.weight"] = (DT, [V, H])
        return out

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set:
        params = dict(self.named_parameters())
        qkv = {"q_proj": (0, H), "k_proj": (H, KV), "v_proj": (H + KV, KV)}
        done = set()
        for name, w in weights:
            if self.tie and name.startswith("lm_head."):
                continue  # the embedding's parameter
            if is_pp_missing_parameter(name, self):
                continue
            if not _load_expert(self, params, name, w):
                for shard, (off, n) in qkv.items():
                    if shard in name:
                        params[name.replace(shard, "qkv_proj")].data.narrow(0, off, n).copy_(w)
                        break
                else:
                    default_weight_loader(params[name], w)
            done.add(name)
        return done


# --- vLLM: what process_weights_after_loading makes of the loaded weights --------

VE, VI, VH = 4, 32, 32  # experts, expert intermediate size, hidden size
MLA_HEADS, MLA_NOPE, MLA_V, MLA_LORA = 2, 8, 8, 16  # heads, qk_nope, v_head, kv_lora_rank


def swap_w13_to_w31(x: torch.Tensor) -> torch.Tensor:
    """vllm-project/vllm ``vllm/model_executor/layers/quantization/utils/
    flashinfer_utils.py`` at 487151de954b26f8f2d3263b88d2a182f2a1b0cd."""
    return x.reshape(-1, 2, x.shape[-2] // 2, x.shape[-1]).flip(dims=[1]).reshape(x.shape)


def shuffle_weight(x: torch.Tensor, layout: tuple = (16, 16)) -> torch.Tensor:
    """ROCm/aiter ``aiter/ops/shuffle.py`` at
    0122c48149c1f523bb5ca9154766bf795c1d371b (its default branch)."""
    IN, IK = layout
    BK = IK * 2
    K = 16 // x.element_size()
    BN = IN
    x_ = x.view(-1, x.shape[-2] // BN, BN, x.shape[-1] // BK, BK // K, K)
    x_ = x_.permute(0, 1, 3, 4, 2, 5)
    x_ = x_.contiguous()
    x_ = x_.view(*x.shape)
    x_.is_shuffled = True
    return x_


def align_moe_weights_for_fi(w13: torch.Tensor, w2: torch.Tensor,
                             min_alignment: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pads the intermediate dim (``align_fp8_moe_weights_for_fi`` in the
    flashinfer_utils.py above; ``align_moe_weights_for_fi`` of later ones)."""
    num_experts, hidden_size, intermediate = w2.shape
    padded = -(-intermediate // min_alignment) * min_alignment
    if padded == intermediate:
        return w13, w2
    padded_w13 = w13.new_zeros((num_experts, 2 * padded, hidden_size))
    padded_w13[:, : w13.shape[1], :] = w13
    padded_w2 = w2.new_zeros((num_experts, hidden_size, padded))
    padded_w2[:, :, :intermediate] = w2
    return padded_w13, padded_w2


def convert_to_block_layout(input_tensor: torch.Tensor, block_k: int) -> torch.Tensor:
    """flashinfer-ai/flashinfer ``flashinfer/fused_moe/core.py`` at
    4c433fd2a9590124a0d409953c6f3241d6788b76."""
    M, K = input_tensor.shape
    assert K % block_k == 0, "K must be divisible by blockK"
    return input_tensor.view(M, K // block_k, block_k).permute(1, 0, 2).contiguous()


def replace_parameter(layer: nn.Module, name: str, new: torch.Tensor,
                      prefer_copy: bool = False) -> None:
    """vLLM's ``replace_parameter`` (``vllm/model_executor/utils.py``): with
    ``prefer_copy``, a compatible old parameter takes the new values in
    place; else a new Parameter over ``new``'s memory is set."""
    old = getattr(layer, name, None)
    if isinstance(new, nn.Parameter):
        new = new.data
    if prefer_copy and old is not None and old.shape == new.shape and old.dtype == new.dtype:
        old.copy_(new)
        return
    setattr(layer, name, nn.Parameter(new, requires_grad=False))


class UnquantizedFusedMoEMethod:
    """vLLM's unquantized fused-MoE method, ``process_weights_after_loading``
    per kernel backend: "triton" keeps the loaded layout; "aiter" shuffles
    ``w13``/``w2`` and sets ``layer.w13_weight.data`` to the result
    (vllm-project/vllm ``vllm/model_executor/layers/fused_moe/
    unquantized_fused_moe_method.py`` at
    017b8f23ef355dd8eb8733d2724f6b125a503acb, with AITER's shuffle_weight);
    "flashinfer_cutlass" swaps the halves of ``w13`` into ``[w3; w1]``;
    "flashinfer_trtllm" pads the intermediate dim to a multiple of 128 and
    turns each expert into the 4-D block layout (``block_k`` 128 there, 16
    here); each result is then set as a new parameter (``_setup_kernel`` in
    that file at c853e15405fb9f281256a5ce916aa24e8962cab6, calling
    ``convert_to_unquantized_kernel_format`` of
    ``vllm/model_executor/layers/fused_moe/oracle/unquantized.py`` at
    011fbfd6c93d3f75dc5d7d1a0d4957d74d079bea, and ``replace_parameter``)."""

    def __init__(self, backend: str) -> None:
        self.backend = backend

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if self.backend == "aiter":
            w13, w2 = (shuffle_weight(t) for t in (layer.w13_weight.data, layer.w2_weight.data))
            layer.w13_weight.data = w13
            layer.w2_weight.data = w2
            return
        w13, w2 = layer.w13_weight, layer.w2_weight
        if self.backend == "flashinfer_cutlass":
            w13 = swap_w13_to_w31(w13)
        elif self.backend == "flashinfer_trtllm":
            w13, w2 = align_moe_weights_for_fi(w13, w2, min_alignment=128)
            w13 = torch.stack([convert_to_block_layout(w, 16) for w in w13])
            w2 = torch.stack([convert_to_block_layout(w, 16) for w in w2])
        replace_parameter(layer, "w13_weight", w13.contiguous())
        replace_parameter(layer, "w2_weight", w2.contiguous())


class VFusedMoE(nn.Module):
    """vLLM's ``FusedMoE``: ``w13_weight`` ([experts, 2 * I, H], w1 then w3)
    and ``w2_weight``, loaded by ``weight_loader`` (vllm-project/vllm
    ``vllm/model_executor/layers/fused_moe/layer.py`` at
    c439a139790cafaecb54e8dea123b78049f1442b), processed by its quant
    method."""

    def __init__(self, gen: torch.Generator, backend: str) -> None:
        super().__init__()
        self.w13_weight = _param(gen, VE, 2 * VI, VH)
        self.w2_weight = _param(gen, VE, VH, VI)
        self.quant_method = UnquantizedFusedMoEMethod(backend)

    def weight_loader(self, param: torch.Tensor, w: torch.Tensor, shard_id: str,
                      expert_id: int) -> None:
        expert_data = param.data[expert_id]
        if shard_id == "w2":
            expert_data.copy_(w)
        else:
            expert_data.narrow(0, 0 if shard_id == "w1" else VI, VI).copy_(w)


def dynamic_per_batched_tensor_quant(x: torch.Tensor, dtype: torch.dtype) -> tuple:
    """``vllm/model_executor/layers/attention/mla_attention.py`` at
    0014ca6b9929614f1b72c4bb11e5238de49cba89 (there into FP8)."""
    dtype_max = torch.finfo(dtype).max
    min_val, max_val = x.aminmax()
    amax = torch.maximum(min_val.abs(), max_val.abs()).clamp(min=1e-10)
    scale = dtype_max / amax
    x_scl_sat = (x * scale).clamp(min=-dtype_max, max=dtype_max)
    return x_scl_sat.to(dtype).contiguous(), scale.float().reciprocal()


class VMLAAttention(nn.Module):
    """vLLM's ``MLAAttention`` holding ``kv_b_proj``, whose
    ``process_weights_after_loading(act_dtype)`` (run after every quant
    method, ``vllm/model_executor/model_loader/utils.py`` at
    3d333269ca2218f2ec4c19d2bfd738f555be3000) derives the absorbed weights
    from ``kv_b_proj.weight``: ``derive="view"`` keeps ``W_UV`` and
    ``W_UK_T`` as views of it and ``derive="aiter"`` sets quantized copies
    ``W_K``/``W_K_scale``/``W_V``/``W_V_scale`` (``mla_attention.py`` at
    0014ca6b9929614f1b72c4bb11e5238de49cba89, FP16 standing for FP8 here);
    ``derive="copy"`` copies contiguous ``W_UK_T`` and ``W_UV`` into the
    parameters it made at the first load
    (``CommonMLAProcessingPolicy.process_weights`` of
    ``vllm/model_executor/model_loader/reload/mla.py`` at
    2fdb4edea59b0575558313e07149c26885662438, ``prefer_copy=True``)."""

    def __init__(self, kv_b_proj: nn.Module, derive: str) -> None:
        super().__init__()
        self.kv_b_proj = kv_b_proj
        self.derive = derive

    def process_weights_after_loading(self, act_dtype: torch.dtype) -> None:
        shape = (MLA_LORA, MLA_HEADS, MLA_NOPE + MLA_V)
        if self.derive == "copy":
            weight = self.kv_b_proj.weight.to(act_dtype).T.contiguous().view(*shape)
            w_uk, w_uv = weight.split([MLA_NOPE, MLA_V], dim=-1)
            replace_parameter(self, "W_UK_T", w_uk.permute(1, 2, 0).contiguous(), prefer_copy=True)
            replace_parameter(self, "W_UV", w_uv.transpose(0, 1).contiguous(), prefer_copy=True)
            return
        kv_b_proj_weight = self.kv_b_proj.weight.to(act_dtype).T.view(*shape)
        W_UK, W_UV = kv_b_proj_weight.split([MLA_NOPE, MLA_V], dim=-1)
        if self.derive == "aiter":
            self.W_K, self.W_K_scale = dynamic_per_batched_tensor_quant(
                W_UK.transpose(0, 1), torch.float16)
            self.W_V, self.W_V_scale = dynamic_per_batched_tensor_quant(
                W_UV.permute(1, 2, 0), torch.float16)
        else:
            self.W_UV = W_UV.transpose(0, 1)
            self.W_UK_T = W_UK.permute(1, 2, 0)

    def derived(self) -> list:
        names = {"copy": ["W_UK_T", "W_UV"], "view": ["W_UK_T", "W_UV"],
                 "aiter": ["W_K", "W_K_scale", "W_V", "W_V_scale"]}[self.derive]
        return [getattr(self, n) for n in names]


class VLLMLayer(nn.Module):
    def __init__(self, gen: torch.Generator, backend: str, derive: str) -> None:
        super().__init__()
        self.self_attn = nn.Module()
        self.self_attn.kv_b_proj = Weight(gen, MLA_HEADS * (MLA_NOPE + MLA_V), MLA_LORA)
        self.self_attn.mla_attn = VMLAAttention(self.self_attn.kv_b_proj, derive)
        self.mlp = nn.Module()
        self.mlp.experts = VFusedMoE(gen, backend)
        self.input_layernorm = Weight(gen, VH)


class VLLMModel(nn.Module):
    """A DeepSeek-shaped vLLM model: MLA attention and unquantized fused
    MoE (kernel ``backend``, MLA ``derive`` as in the classes above).
    ``load_weights`` writes the loaded layout; :func:`vllm_process` is the
    model loader's post-load processing."""

    def __init__(self, seed: int = 7, backend: str = "triton", derive: str = "view",
                 layers: int = 2) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.model = nn.Module()
        self.model.layers = nn.ModuleList([VLLMLayer(g, backend, derive) for _ in range(layers)])
        self.n_layers = layers

    def shapes(self) -> dict:
        out = {}
        for i in range(self.n_layers):
            pre = f"model.layers.{i}."
            out[pre + "self_attn.kv_b_proj.weight"] = (DT, [MLA_HEADS * (MLA_NOPE + MLA_V),
                                                            MLA_LORA])
            for e in range(VE):
                out[pre + f"mlp.experts.{e}.gate_proj.weight"] = (DT, [VI, VH])
                out[pre + f"mlp.experts.{e}.up_proj.weight"] = (DT, [VI, VH])
                out[pre + f"mlp.experts.{e}.down_proj.weight"] = (DT, [VH, VI])
            out[pre + "input_layernorm.weight"] = (DT, [VH])
        return out

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set:
        params = dict(self.named_parameters())
        done = set()
        for name, w in weights:
            if not _load_expert(self, params, name, w):
                default_weight_loader(params[name], w)
            done.add(name)
        return done


def vllm_process(model: nn.Module, act_dtype: torch.dtype = DT) -> nn.Module:
    """vLLM's ``process_weights_after_loading(model, model_config, device)``
    (``vllm/model_executor/model_loader/utils.py`` at
    3d333269ca2218f2ec4c19d2bfd738f555be3000): every quant method's, then
    every attention layer's with the model's dtype."""
    for _, m in model.named_modules():
        qm = getattr(m, "quant_method", None)
        if qm is not None:
            qm.process_weights_after_loading(m)
    for _, m in model.named_modules():
        if isinstance(m, VMLAAttention):
            m.process_weights_after_loading(act_dtype)
    return model
