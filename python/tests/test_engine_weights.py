"""EngineWeights against loaders that do more than copy views: the dry run
writes nothing the model holds (fill_ of item(), a thread pool, set_, a
post-load step), tensors a worker holds none of are skipped (experts of
other expert-parallel ranks, layers of other pipeline stages, a tied
lm_head) and the rest synced bit-exactly, a parameter that moves is found
before anything is written into it, and what the kernel reads beyond what
load_weights wrote (a pair fused only together, a layout or a weight made
after loading) matches a fresh model loaded whole with its post-load
processing, or the model is refused naming the tensor."""

import threading

import pytest
import torch
from torch import nn

import deltasync as ds
from deltasync.adapters import EngineWeights, weight_map
from deltasync.adapters.engine import post_load_steps
from standins_engines import (
    DT,
    AdoptingModel,
    E,
    KVScaleModel,
    MoEModel,
    PaddedEmbeddingModel,
    PoolModel,
    QueueWorkerModel,
    ThreadModel,
    VLLMModel,
    randn_checkpoint,
    reference,
    vllm_process,
)


def meta(shapes):
    return [(n, d, s) for n, (d, s) in shapes.items()]


def bits(t):
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


def weights_of(model):
    out = dict(model.named_parameters())
    out.update(dict(model.named_buffers()))
    return out


def snapshot(model):
    return {n: (p.data_ptr(), bits(p).clone()) for n, p in weights_of(model).items()}


def assert_untouched(model, before):
    now = weights_of(model)
    assert sorted(now) == sorted(before)
    for n, (ptr, b) in before.items():
        assert now[n].data_ptr() == ptr, f"{n}: its memory moved"
        assert torch.equal(bits(now[n]), b), f"{n}: its bytes changed"


def assert_same(model, ref, attrs=()):
    a, b = weights_of(model), weights_of(ref)
    assert sorted(a) == sorted(b)
    for n in a:
        assert torch.equal(bits(a[n]), bits(b[n])), f"parameter {n} differs from a full load"
    for get in attrs:
        assert torch.equal(bits(get(model)), bits(get(ref))), "a derived weight differs"


def loaded(model, ckpt):
    """The model as an engine starts it: its weights loaded from disk."""
    model.load_weights([(n, t.clone()) for n, t in ckpt.items()])
    return model


def step(ckpt, k):
    g = torch.Generator().manual_seed(100 + k)
    for t in ckpt.values():
        flat = t.view(-1)
        mask = torch.rand(flat.numel(), generator=g) < 0.05
        mask[k % flat.numel()] = True
        flat[mask] = (flat[mask].float() + 0.25).to(t.dtype)


def push(states, ckpt, snap):
    """One delta of every tensor to every worker, through check_delta and
    apply_delta (the path SGLang's loader takes)."""
    for n, t in ckpt.items():
        pos, val = ds.diff(t.reshape(-1), snap[n].reshape(-1), name=n).as_torch(t.dtype)
        for s in states:
            s.check_delta(n, pos, val)
        for s in states:
            s.apply_delta(n, pos, val)
        snap[n].copy_(t)


def synced(states, ckpt):
    for s in states:
        s.load_full([(n, t.clone()) for n, t in ckpt.items()])
    return {n: t.clone() for n, t in ckpt.items()}


# --- a dry run writes nothing the model holds ---------------------------------


def test_a_one_element_scale_filled_from_item_is_refused_and_takes_the_stock_path():
    shapes = KVScaleModel.shapes()
    ckpt = randn_checkpoint(shapes, 1)
    model = loaded(KVScaleModel(), ckpt)
    before = snapshot(model)
    host = [(a._k_scale, a._v_scale) for a in _attns(model)]
    state = EngineWeights(model, meta(shapes))
    assert_untouched(model, before)
    assert [(a._k_scale, a._v_scale) for a in _attns(model)] == host
    scales = sorted(n for n in shapes if n.endswith("_scale"))
    assert state.fallback == scales
    assert "fill_" in state.map.unmapped[scales[0]]
    assert "model.layers.0.self_attn.k_proj.weight" in state.map.placements
    snap = synced([state], ckpt)
    for k in range(1, 3):
        step(ckpt, k)
        push([state], ckpt, snap)
        ref = reference(KVScaleModel, ckpt)
        assert_same(model, ref)
        assert [(a._k_scale, a._v_scale) for a in _attns(model)] == \
            [(a._k_scale, a._v_scale) for a in _attns(ref)]
    assert state.stats["scattered_tensors"] > 0


def _attns(model):
    return [layer["self_attn"].attn for layer in model.layers]


def test_a_fill_of_padding_that_holds_the_value_already_changes_nothing():
    shapes = PaddedEmbeddingModel.shapes()
    ckpt = randn_checkpoint(shapes, 10)
    # Before the engine loaded it the padding holds other values: the fill
    # would change them, so it is refused.
    fresh = PaddedEmbeddingModel()
    before = snapshot(fresh)
    state = EngineWeights(fresh, meta(shapes))
    assert_untouched(fresh, before)
    assert "fill_" in state.map.unmapped["embed_tokens.weight"]
    # Loaded, the padding holds zeros: zeroing it again writes nothing.
    model = loaded(PaddedEmbeddingModel(), ckpt)
    before = snapshot(model)
    state = EngineWeights(model, meta(shapes))
    assert_untouched(model, before)
    assert state.fallback == [] and state.map.placements["embed_tokens.weight"].elements == \
        64 * 32
    snap = synced([state], ckpt)
    for k in range(1, 3):
        step(ckpt, k)
        push([state], ckpt, snap)
        assert_same(model, reference(PaddedEmbeddingModel, ckpt))


def _hookable():
    import concurrent.futures

    return (concurrent.futures.ThreadPoolExecutor.submit, threading.Thread.start,
            "__setattr__" in torch.Tensor.__dict__, nn.Module.__setattr__, nn.Module.__delattr__,
            nn.Module.register_parameter, nn.Module.register_buffer, nn.Module.add_module)


def _w_kc(layer):
    return lambda m: m.model.layers[layer].self_attn.w_kc


def _w_vc(layer):
    return lambda m: m.model.layers[layer].self_attn.w_vc


def test_a_thread_pool_loader_is_intercepted_on_its_threads():
    model = PoolModel()
    shapes = model.shapes()
    ckpt = randn_checkpoint(shapes, 2)
    loaded(model, ckpt)
    before = snapshot(model)
    derived = [bits(_w_kc(i)(model)).clone() for i in range(4)]
    hooked = _hookable()
    state = EngineWeights(model, meta(shapes))
    assert _hookable() == hooked  # the process-wide hooks are gone again
    assert_untouched(model, before)
    for i in range(4):
        assert torch.equal(bits(_w_kc(i)(model)), derived[i])  # the post-load step refused
    pre = "model.layers.0."
    # Copies made on the pool's threads are placements.
    for n in ("self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
              "mlp.down_proj.weight", "input_layernorm.weight"):
        assert pre + n in state.map.placements, n
    assert state.map.placements[pre + "mlp.up_proj.weight"].param_name == \
        pre + "mlp.gate_up_proj.weight"
    # Fused only together: mapped from one dry run with both. Derived
    # after loading inside load_weights: the stock path.
    qa, kva = pre + "self_attn.q_a_proj.weight", pre + "self_attn.kv_a_proj_with_mqa.weight"
    assert state.map.joint[qa] == state.map.joint[kva] == [qa, kva]
    assert state.map.placements[qa].param_name == pre + "self_attn.fused_qkv_a_proj_with_mqa.weight"
    assert "not a parameter" in state.map.unmapped[pre + "self_attn.kv_b_proj.weight"]
    assert not state.skipped
    snap = synced([state], ckpt)
    for k in range(1, 3):
        step(ckpt, k)
        push([state], ckpt, snap)
        assert_same(model, reference(PoolModel, ckpt),
                    [_w_kc(i) for i in range(4)] + [_w_vc(i) for i in range(4)])


def test_a_loader_that_starts_threads_is_intercepted_on_them():
    shapes = ThreadModel.shapes()
    ckpt = randn_checkpoint(shapes, 12)
    model = loaded(ThreadModel(), ckpt)
    before = snapshot(model)
    state = EngineWeights(model, meta(shapes))
    assert_untouched(model, before)
    assert sorted(state.map.placements) == sorted(shapes) and state.fallback == []
    snap = synced([state], ckpt)
    step(ckpt, 1)
    push([state], ckpt, snap)
    assert_same(model, reference(ThreadModel, ckpt))


def test_a_set_that_adopts_the_loaded_memory_is_refused_and_nothing_derived_changes():
    shapes = AdoptingModel.shapes()
    ckpt = randn_checkpoint(shapes, 3)
    model = loaded(AdoptingModel(), ckpt)
    before = snapshot(model)
    inv = model.norm_inv.clone()
    state = EngineWeights(model, meta(shapes))
    assert_untouched(model, before)
    assert torch.equal(bits(model.norm_inv), bits(inv))
    assert state.fallback == ["norm.weight"] and "set_" in state.map.unmapped["norm.weight"]
    assert "proj.weight" in state.map.placements
    snap = synced([state], ckpt)
    for k in range(1, 3):
        step(ckpt, k)
        push([state], ckpt, snap)
        assert_same(model, reference(AdoptingModel, ckpt), [lambda m: m.norm_inv])


def test_a_write_on_a_thread_the_dry_run_does_not_see_is_detected():
    model = QueueWorkerModel()
    with pytest.raises(ds.InternalError, match="parameter proj.weight"):
        EngineWeights(model, meta(QueueWorkerModel.shapes()))


# --- tensors this worker holds none of ----------------------------------------


def _local(rank, size):
    return set(range(rank * E // size, (rank + 1) * E // size))


def _experts_not_in(shapes, local):
    return {n for n in shapes if ".experts." in n and int(n.split(".experts.")[1].split(".")[0])
            not in local}


class _Receivers:
    """Receivers on threads of their own, one receive each per sync."""

    def __init__(self, rxs):
        self.rxs = rxs

    def sync(self, tx, ckpt):
        out = [None] * len(self.rxs)

        def run(i):
            try:
                out[i] = self.rxs[i].receive()
            except BaseException as e:  # handed to the test
                out[i] = e

        ts = [threading.Thread(target=run, args=(i,)) for i in range(len(self.rxs))]
        [t.start() for t in ts]
        try:
            sent = tx.sync(ckpt)
        except ds.DeltasyncError as e:
            sent = e
        [t.join(30) for t in ts]
        return sent, out


def test_experts_of_other_ranks_and_a_tied_lm_head_are_skipped_over_the_stream(rendezvous):
    models = [MoEModel(ep_rank=r, ep_size=2) for r in range(2)]
    shapes = models[0].shapes()
    ckpt = randn_checkpoint(shapes, 4)
    states = [EngineWeights(loaded(m, ckpt), meta(shapes)) for m in models]
    for r, s in enumerate(states):
        expected = _experts_not_in(shapes, _local(r, 2)) | {"lm_head.weight"}
        assert s.skipped == sorted(expected)
        assert s.fallback == []
        assert not set(s.map.placements) & expected
    rxs = [ds.StreamReceiver(ds.Group(rendezvous, r + 1, 3, timeout_s=20), partial=True)
           for r in range(2)]
    tx = ds.StreamSender(ds.Group(rendezvous, 0, 3, timeout_s=20))
    try:
        for s, rx in zip(states, rxs):
            s.register(rx)
        net = _Receivers(rxs)
        for k in range(3):
            if k:
                step(ckpt, k)
            sent, got = net.sync(tx, ckpt)
            assert not isinstance(sent, Exception), sent
            assert all(not isinstance(g, Exception) for g in got), got
            assert all(g["partial"] for g in got)
            for r, m in enumerate(models):
                s = states[r]
                s.reload_shadows()
                assert_same(m, reference(lambda seed: MoEModel(seed, ep_rank=r, ep_size=2), ckpt))
        # Nothing is kept on the host for them (nor for anything else here).
        for s in states:
            assert s.shadows == {}
    finally:
        tx.close()
        for rx in rxs:
            rx.close()


def test_layers_of_other_pipeline_stages_are_skipped():
    models = [MoEModel(pp_rank=r, pp_size=2, tie=False) for r in range(2)]
    shapes = models[0].shapes()
    ckpt = randn_checkpoint(shapes, 5)
    states = [EngineWeights(loaded(m, ckpt), meta(shapes)) for m in models]
    stage0 = {n for n in shapes
              if n.startswith("model.layers.0.") or n == "model.embed_tokens.weight"}
    assert states[0].skipped == sorted(set(shapes) - stage0)
    assert states[1].skipped == sorted(stage0)
    # SGLang's DeepSeek loader: other stages' layers skipped, a fused pair
    # loaded only together still held.
    pool = PoolModel(pp_rank=1, pp_size=2)
    pshapes = pool.shapes()
    pckpt = randn_checkpoint(pshapes, 6)
    pstate = EngineWeights(loaded(pool, pckpt), meta(pshapes))
    assert pstate.skipped == sorted(n for n in pshapes if n.startswith(("model.layers.0.",
                                                                        "model.layers.1.")))
    assert "model.layers.2.self_attn.q_a_proj.weight" in pstate.map.joint
    snaps = synced(states, ckpt), synced([pstate], pckpt)
    for k in range(1, 3):
        step(ckpt, k)
        step(pckpt, k)
        push(states, ckpt, snaps[0])
        push([pstate], pckpt, snaps[1])
        for r, m in enumerate(models):
            assert_same(m, reference(lambda seed: MoEModel(seed, pp_rank=r, pp_size=2, tie=False),
                                     ckpt))
        assert_same(pool, reference(lambda seed: PoolModel(seed, pp_rank=1, pp_size=2), pckpt),
                    [_w_kc(i) for i in (2, 3)])
    for s in states + [pstate]:
        assert not set(s.shadows) & set(s.skipped)
        assert s.stats["skipped_deltas"] > 0


# --- parameters that move ---------------------------------------------------------


def test_a_moved_or_replaced_parameter_gets_the_next_delta_and_its_old_memory_nothing():
    model = MoEModel()
    shapes = model.shapes()
    ckpt = randn_checkpoint(shapes, 7)
    state = EngineWeights(loaded(model, ckpt), meta(shapes))
    snap = synced([state], ckpt)
    step(ckpt, 1)
    push([state], ckpt, snap)
    # The memory moves under the parameter...
    qkv = model.model.layers[0].self_attn.qkv_proj
    old_qkv = qkv.weight.data
    qkv.weight.data = qkv.weight.data.clone()
    # ... and the parameter object is replaced (the tie kept).
    emb = model.model.embed_tokens
    old_emb = emb.weight
    emb.weight = nn.Parameter(old_emb.data.clone(), requires_grad=False)
    model.lm_head.weight = emb.weight
    old = {"qkv": bits(old_qkv).clone(), "emb": bits(old_emb).clone()}
    assert sorted(state.moved()) == ["model.embed_tokens.weight",
                                     "model.layers.0.self_attn.qkv_proj.weight"]
    for k in range(2, 4):
        step(ckpt, k)
        push([state], ckpt, snap)
        assert_same(model, reference(MoEModel, ckpt))
    assert torch.equal(bits(old_qkv), old["qkv"]) and torch.equal(bits(old_emb), old["emb"])
    assert state.stats["relearned"] == 1


def test_expert_rebalancing_rebuilds_the_map_and_a_receiver_cannot_follow_it(rendezvous):
    model = MoEModel(ep_rank=0, ep_size=2)
    shapes = model.shapes()
    ckpt = randn_checkpoint(shapes, 8)
    state = EngineWeights(loaded(model, ckpt), meta(shapes))
    rx = ds.StreamReceiver(ds.Group(rendezvous, 1, 2, timeout_s=20), partial=True)
    state.register(rx)
    snap = synced([state], ckpt)
    step(ckpt, 1)
    push([state], ckpt, snap)
    moe = model.model.layers[1].mlp.experts
    old_w13 = moe.w13_weight
    old = bits(old_w13).clone()
    moe.rebalance([3, 1], ckpt, "model.layers.1.mlp")  # experts 3 and 1 now here
    for _ in range(2):  # and it keeps saying so
        with pytest.raises(ds.FailedPreconditionError, match="register every tensor with a new"):
            state.refresh(rx)
    rx.close()
    pre = "model.layers.1.mlp.experts."
    assert pre + "3.up_proj.weight" in state.map.placements
    assert pre + "0.up_proj.weight" in state.skipped
    for k in range(2, 4):
        step(ckpt, k)
        push([state], ckpt, snap)

        def rebalanced(seed):
            m = MoEModel(seed, ep_rank=0, ep_size=2)
            m.model.layers[1].mlp.experts.rebalance([3, 1], ckpt, "model.layers.1.mlp")
            return m

        assert_same(model, reference(rebalanced, ckpt))
    assert torch.equal(bits(old_w13), old)


def test_a_receiver_follows_a_parameter_whose_memory_moved(rendezvous):
    model = MoEModel()
    shapes = model.shapes()
    ckpt = randn_checkpoint(shapes, 9)
    state = EngineWeights(loaded(model, ckpt), meta(shapes))
    rx = ds.StreamReceiver(ds.Group(rendezvous, 1, 2, timeout_s=20), partial=True)
    tx = ds.StreamSender(ds.Group(rendezvous, 0, 2, timeout_s=20))
    net = _Receivers([rx])
    try:
        state.register(rx)
        sent, (got,) = net.sync(tx, ckpt)
        assert not isinstance(got, Exception), got
        assert_same(model, reference(MoEModel, ckpt))
        qkv = model.model.layers[0].self_attn.qkv_proj
        old_qkv = qkv.weight.data
        qkv.weight.data = qkv.weight.data.clone()
        norm = model.model.norm
        old_norm = norm.weight
        norm.weight = nn.Parameter(old_norm.data.clone(), requires_grad=False)
        old = {"qkv": bits(old_qkv).clone(), "norm": bits(old_norm).clone()}
        r = state.refresh(rx)
        assert r["relearned"] and sorted(r["moved"]) == ["model.layers.0.self_attn.qkv_proj.weight",
                                                        "model.norm.weight"]
        assert r["rebound"] == [f"model.layers.0.self_attn.{x}_proj.weight" for x in "qkv"] + \
            ["model.norm.weight"]
        # New memory holds what the stream cannot know: one sync asks for a
        # seed, the next one reseeds it.
        step(ckpt, 1)
        sent, (got,) = net.sync(tx, ckpt)
        assert isinstance(got, ds.FailedPreconditionError) and "seed" in str(got), got
        sent, (got,) = net.sync(tx, ckpt)
        assert not isinstance(sent, Exception), sent
        assert sent["seeded"] == 1
        assert_same(model, reference(MoEModel, ckpt))
        step(ckpt, 2)
        sent, (got,) = net.sync(tx, ckpt)
        assert not isinstance(got, Exception), got
        assert_same(model, reference(MoEModel, ckpt))
        assert torch.equal(bits(old_qkv), old["qkv"]) and torch.equal(bits(old_norm), old["norm"])
        assert state.refresh(rx) == {"moved": {}, "relearned": False, "rebound": []}
    finally:
        tx.close()
        rx.close()


# --- what the kernel reads beyond what load_weights wrote ----------------------------


def _pair(layer=0):
    pre = f"model.layers.{layer}.self_attn."
    return pre + "q_a_proj.weight", pre + "kv_a_proj_with_mqa.weight"


def _one_tensor_delta(states, ckpt, snap, name):
    """A delta to ``name`` alone."""
    flat = ckpt[name].view(-1)
    flat[::7] = (flat[::7].float() + 0.5).to(flat.dtype)
    pos, val = ds.diff(ckpt[name].reshape(-1), snap[name].reshape(-1), name=name).as_torch(DT)
    for s in states:
        s.check_delta(name, pos, val)
        s.apply_delta(name, pos, val)
        s.flush()
    snap[name].copy_(ckpt[name])


def _deepseek_attrs():
    return [_w_kc(i) for i in range(4)] + [_w_vc(i) for i in range(4)]


def test_a_pair_fused_only_when_both_arrive_in_one_call_is_mapped_and_takes_either_alone():
    model = PoolModel()
    shapes = model.shapes()
    ckpt = randn_checkpoint(shapes, 21)
    state = EngineWeights(loaded(model, ckpt), meta(shapes))
    qa, kva = _pair()
    assert state.map.joint[qa] == [qa, kva] and kva in state.map.placements
    # A full sync whose calls each hold one tensor: the loader alone would
    # cache q_a_proj and drop it.
    step(ckpt, 1)
    for n, t in ckpt.items():
        state.load_full([(n, t.clone())])
    assert_same(model, reference(PoolModel, ckpt), _deepseek_attrs())
    snap = {n: t.clone() for n, t in ckpt.items()}
    for name in (qa, _pair(3)[1]):
        _one_tensor_delta([state], ckpt, snap, name)
        assert_same(model, reference(PoolModel, ckpt), _deepseek_attrs())
    assert state.shadows.keys() == {f"model.layers.{i}.self_attn.kv_b_proj.weight"
                                    for i in range(4)}


def test_a_fused_pair_too_large_to_follow_loads_as_one_group_whatever_the_calls(monkeypatch):
    monkeypatch.setattr(weight_map, "_JOINT_MAX_ELEMENTS", 0)
    model = PoolModel()
    shapes = model.shapes()
    ckpt = randn_checkpoint(shapes, 22)
    state = EngineWeights(loaded(model, ckpt), meta(shapes))
    qa, kva = _pair()
    assert "together" in state.map.unmapped[qa] and state.map.groups[qa] == [qa, kva]
    step(ckpt, 1)
    for n, t in ckpt.items():
        state.load_full([(n, t.clone())])
    assert_same(model, reference(PoolModel, ckpt), _deepseek_attrs())
    snap = {n: t.clone() for n, t in ckpt.items()}
    _one_tensor_delta([state], ckpt, snap, qa)
    assert_same(model, reference(PoolModel, ckpt), _deepseek_attrs())


def _vllm_steps(model):
    return post_load_steps(model, DT)


def _vllm_reference(make, ckpt):
    """A fresh model loaded whole from ``ckpt``, then processed as vLLM's
    model loader does."""
    return vllm_process(reference(make, ckpt))


def _vllm_sync(state, ckpt, snap, make, attrs=()):
    for k in range(1, 3):
        step(ckpt, k)
        push([state], ckpt, snap)
        state.flush()
        assert_same(state.model, _vllm_reference(make, ckpt), attrs)


def _loaded_state(make, ckpt_seed):
    """A processed vLLM model loaded from a fresh checkpoint and its
    EngineWeights (whose mapping writes nothing): shapes, checkpoint, model,
    state."""
    shapes = make().shapes()
    ckpt = randn_checkpoint(shapes, ckpt_seed)
    model = vllm_process(loaded(make(), ckpt))
    before = snapshot(model)
    state = EngineWeights(model, meta(shapes), post_load=_vllm_steps)
    assert_untouched(model, before)
    return shapes, ckpt, model, state


@pytest.mark.parametrize("backend", ["flashinfer_cutlass", "aiter"])
def test_a_kernel_layout_made_after_loading_is_made_again_from_the_loaded_one(backend):
    def make(seed=7):
        return VLLMModel(seed, backend=backend)

    shapes, ckpt, model, state = _loaded_state(make, 23)
    kinds = ("gate_proj", "up_proj") + (("down_proj",) if backend == "aiter" else ())
    rewritten = sorted(n for n in shapes if n.split(".")[-2] in kinds)
    assert state.fallback == rewritten
    first = "model.layers.0.mlp.experts.0.gate_proj.weight"
    assert "rewrites into another layout" in state.map.unmapped[first]
    assert len(state.map.groups[first]) == len(rewritten) // 2  # the layer's, together
    assert "model.layers.0.self_attn.kv_b_proj.weight" in state.map.placements
    memory = {n: (p, p.data_ptr()) for n, p in model.named_parameters()}
    snap = synced([state], ckpt)
    _vllm_sync(state, ckpt, snap, make)
    # The engine's weights kept their objects and memory.
    assert {n: (p, p.data_ptr()) for n, p in model.named_parameters()} == memory
    assert state.stats["post_load_runs"] > 0


def test_a_kernel_layout_of_another_shape_is_refused_naming_the_tensor():
    def make(seed=7):
        return VLLMModel(seed, backend="flashinfer_trtllm")

    shapes = make().shapes()
    model = vllm_process(loaded(make(), randn_checkpoint(shapes, 24)))
    assert model.model.layers[0].mlp.experts.w13_weight.dim() == 4  # the block layout
    before = snapshot(model)
    with pytest.raises(ds.UnsupportedError,
                       match=r"tensor 'model\.layers\.0\.mlp\.experts\.0\.gate_proj\.weight': "
                             r"it lands in parameter model\.layers\.0\.mlp\.experts\.w13_weight, "
                             r"whose post-load step UnquantizedFusedMoEMethod.* raised on a "
                             r"dry run"):
        EngineWeights(model, meta(shapes), post_load=_vllm_steps)
    assert_untouched(model, before)


def _derived(layer, i):
    return lambda m: m.model.layers[layer].self_attn.mla_attn.derived()[i]


@pytest.mark.parametrize("derive", ["copy", "aiter", "view"])
def test_mla_weights_derived_from_kv_b_proj_follow_its_deltas(derive):
    def make(seed=7):
        return VLLMModel(seed, derive=derive)

    shapes, ckpt, model, state = _loaded_state(make, 25)
    kvb = "model.layers.0.self_attn.kv_b_proj.weight"
    assert kvb in state.map.placements and state.fallback == []
    if derive == "view":  # views of kv_b_proj: they follow it
        assert state.map.steps == []
    else:
        assert state.map.steps_of[kvb] == [
            "VMLAAttention.process_weights_after_loading(model.layers.0.self_attn.mla_attn)"]
    n = len(model.model.layers[0].self_attn.mla_attn.derived())
    attrs = [_derived(i, j) for i in range(2) for j in range(n)]
    kept = [(a(model), a(model).data_ptr()) for a in attrs]
    snap = synced([state], ckpt)
    _vllm_sync(state, ckpt, snap, make, attrs)
    assert all(a(model) is t and t.data_ptr() == p for a, (t, p) in zip(attrs, kept))


# --- on a CUDA device -------------------------------------------------------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_on_a_cuda_device_nothing_is_written_and_deltas_land_where_the_parameters_are():
    makers = [KVScaleModel, PoolModel, PaddedEmbeddingModel,
              lambda seed=7: MoEModel(seed, ep_rank=1, ep_size=2)]
    for make in makers:
        shapes = make().shapes()
        ckpt = randn_checkpoint(shapes, 11)
        model = loaded(make().cuda(), ckpt)
        before = snapshot(model)
        state = EngineWeights(model, meta(shapes))
        assert_untouched(model, before)
        assert state.map.placements
        snap = synced([state], ckpt)
        for k in range(1, 4):
            if k == 2:  # a mapped parameter's memory moves
                param = next(iter(state.map.placements.values())).param
                param.data = param.data.clone()
            step(ckpt, k)
            push([state], ckpt, snap)
            assert_same(model, reference(lambda seed: make(seed).cuda(), ckpt))
        assert state.stats["relearned"] == 1
