"""The vLLM adapter against vLLM's behaviour (stand-ins in standins_vllm.py
and standins.py): the backend reaches workers that only load plugins, a
worker's rank counts its data-parallel replica, an ``nccl`` group gets the
worker's GPU, ``LLM`` and ``AsyncLLM`` clients each get the arguments they
take, a failed round returns at once, draft models are refused, what
vLLM's post-load processing makes of the loaded weights (a kernel layout,
derived weights) follows every sync, a worker that runs vLLM's
layerwise reload itself is refused before anything is written, a worker
that holds part of the model (its experts, its pipeline stage) syncs it and
keeps nothing of the rest, and a weight the engine gives new memory between
syncs is followed, its old memory never written."""

import asyncio
import importlib
import multiprocessing
import os
import sys
import threading
import time
import tomllib

import pytest
import torch

import deltasync as ds
import standins_vllm as sv
from standins import (
    TinyTPModel,
    VLLMClientStandIn,
    assert_matches_reference,
    make_checkpoint,
    rl_step,
    same_bits,
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def adapter():
    """The adapter module as imported over the stand-in just installed."""
    return importlib.import_module("deltasync.adapters.vllm")


@pytest.fixture(autouse=True)
def fresh_adapter():
    """Each test imports the adapter over its own stand-in; none leaves its
    module behind (in sys.modules or as the package's attribute)."""
    yield
    import deltasync.adapters as package

    sys.modules.pop("deltasync.adapters.vllm", None)
    if hasattr(package, "vllm"):
        delattr(package, "vllm")


def build_engines(factory, configs, models):
    return [factory.create_engine(sv.Config(), sv.VllmConfig(pc), torch.device("cpu"), m)
            for pc, m in zip(configs, models)]


def spy_groups(monkeypatch, ds_vllm):
    """Records every Group the adapter forms (and forms it)."""
    seen = []
    real = ds_vllm.Group

    def spy(*args, **kwargs):
        g = real(*args, **kwargs)
        seen.append(g)
        return g

    monkeypatch.setattr(ds_vllm, "Group", spy)
    return seen


def shutdown(trainer, engines):
    update = getattr(trainer, "_update", None) if trainer is not None else None
    if trainer is not None:
        trainer.close()
    for e in engines:
        e.shutdown()
    # The workers' side of a failed round ends once their receivers close:
    # the test leaves no thread inside the library behind it.
    if update is not None:
        update.join(timeout=30)
        assert not update.is_alive(), "the workers' update thread did not end"


# --- 1. the backend reaches workers through vLLM's plugin entry point ---------


def test_workers_find_the_backend_through_the_plugin_entry_point(tmp_path):
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    plugins = project.get("entry-points", {}).get(sv.PLUGINS_GROUP, {})
    assert plugins, f"pyproject.toml declares no [project.entry-points.\"{sv.PLUGINS_GROUP}\"]"
    # What `pip install .` writes for the package: its dist-info.
    dist = tmp_path / f"deltasync-{project['version']}.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: deltasync\nVersion: {project['version']}\n")
    (dist / "entry_points.txt").write_text(
        f"[{sv.PLUGINS_GROUP}]\n" + "".join(f"{k} = {v}\n" for k, v in plugins.items()))
    ctx = multiprocessing.get_context("spawn")  # a worker: a fresh interpreter
    queue = ctx.Queue()
    p = ctx.Process(target=sv.plugin_probe, args=(str(tmp_path), queue))
    p.start()
    try:
        out = queue.get(timeout=60)
    finally:
        p.join(timeout=30)
    assert "error" not in out, out["error"]
    assert out["ran"] == list(plugins) * 2  # run twice: registering is idempotent
    assert "deltasync" in out["backends"]
    assert out["engine"] == "deltasync.adapters.vllm.DeltasyncWeightTransferEngine"


def test_register_is_idempotent_and_refuses_an_old_engine_interface():
    factory = sv.install()
    ds_vllm = adapter()
    ds_vllm.register()
    ds_vllm.register()
    ds_vllm.vllm_plugin()
    assert list(factory._registry) == ["deltasync"]
    # An engine base built with (config, parallel_config), as vLLM 0.16.0's.
    base = sys.modules["vllm.distributed.weight_transfer.base"]

    class Old:
        def __init__(self, config, parallel_config):
            pass

    base.WeightTransferEngine = Old
    factory._registry.clear()
    with pytest.raises(ds.UnsupportedError, match=ds_vllm.VLLM_MIN_VERSION):
        ds_vllm.register()
    ds_vllm.vllm_plugin()  # logs, changes nothing, never breaks vLLM's start
    assert not factory._registry


# --- 2. ranks across data-parallel replicas ---------------------------------


def test_data_parallel_workers_take_distinct_ranks(rendezvous, monkeypatch):
    factory = sv.install()
    ds_vllm = adapter()
    ds_vllm.register()
    groups = spy_groups(monkeypatch, ds_vllm)
    # DP=2 replicas of TP=2: vLLM numbers them dp_index * world_size + rank.
    configs = [sv.ParallelConfig(rank=r, world_size=2, data_parallel_index=d, data_parallel_size=2)
               for d in range(2) for r in range(2)]
    models = [TinyTPModel(pc.rank, 2) for pc in configs]
    engines = build_engines(factory, configs, models)
    ckpt = make_checkpoint(5)
    trainer = None
    try:
        trainer = ds_vllm.DeltasyncTrainer(VLLMClientStandIn(engines), ckpt,
                                           rendezvous=rendezvous, workers=4, timeout_s=30)
        assert [e.rank for e in engines] == [1, 2, 3, 4]
        assert sorted(g.rank for g in groups) == [0, 1, 2, 3, 4]
        for step in range(2):
            if step:
                rl_step(ckpt, step)
            trainer.send_weights(ckpt)
            for m in models:
                assert_matches_reference(m, ckpt)
    finally:
        shutdown(trainer, engines)


def test_a_rank_outside_the_group_names_data_parallelism(rendezvous):
    factory = sv.install()
    ds_vllm = adapter()
    ds_vllm.register()
    pc = sv.ParallelConfig(rank=1, world_size=2, data_parallel_index=1, data_parallel_size=2)
    engine = build_engines(factory, [pc], [TinyTPModel(1, 2)])[0]
    info = ds_vllm.DeltasyncInitInfo(rendezvous=rendezvous, size=3, checkpoint=[
        [n, "BF16", list(t.shape)] for n, t in make_checkpoint(0).items()])
    with pytest.raises(ds.InvalidArgumentError, match="data-parallel"):
        engine.init_transfer_engine(info)  # rank 1 + 1*2 + 1 = 4 in a group of 3
    engine.shutdown()


# --- 3. an nccl group's GPU: the worker's current device --------------------


@pytest.mark.parametrize("cuda", [True, False])
def test_the_group_takes_the_workers_current_cuda_device(rendezvous, monkeypatch, cuda):
    factory = sv.install()
    ds_vllm = adapter()
    ds_vllm.register()
    groups = spy_groups(monkeypatch, ds_vllm)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    engine = build_engines(factory, [sv.ParallelConfig()], [TinyTPModel(0, 1)])[0]
    info = ds_vllm.DeltasyncInitInfo(rendezvous=rendezvous, size=2, checkpoint=[
        [n, "BF16", list(t.shape)] for n, t in make_checkpoint(0).items()])
    try:
        engine.init_transfer_engine(info)
        assert [g.cuda_device for g in groups] == [3 if cuda else 0]
    finally:
        engine.shutdown()


# --- 4. LLM and AsyncLLM clients -----------------------------------------------


def round_trips(ds_vllm, factory, client_of, rendezvous, **trainer_kwargs):
    models = [TinyTPModel(r, 2) for r in range(2)]
    engines = build_engines(factory, [sv.ParallelConfig(rank=r, world_size=2) for r in range(2)],
                            models)
    client = client_of(engines)
    ckpt = make_checkpoint(6)
    trainer = None
    try:
        trainer = ds_vllm.DeltasyncTrainer(client, ckpt, rendezvous=rendezvous, workers=2,
                                           timeout_s=30, **trainer_kwargs)
        for step in range(2):
            if step:
                rl_step(ckpt, step)
            assert trainer.send_weights(ckpt)["sync_id"] == step + 1
            for m in models:
                assert_matches_reference(m, ckpt)
        assert client.calls[:4] == ["init", "start", "update", "finish"]
        return trainer.api
    finally:
        shutdown(trainer, engines)


def test_an_llm_client_gets_init_info_and_update_info_dicts(rendezvous):
    factory = sv.install()
    ds_vllm = adapter()
    ds_vllm.register()
    assert round_trips(ds_vllm, factory, sv.LLMStandIn, rendezvous) == "llm"


def test_an_async_llm_client_gets_requests_on_its_event_loop(rendezvous):
    factory = sv.install()
    ds_vllm = adapter()
    ds_vllm.register()
    loop = asyncio.new_event_loop()
    runner = threading.Thread(target=loop.run_forever, daemon=True)
    runner.start()
    try:
        assert round_trips(ds_vllm, factory, sv.AsyncLLMStandIn, rendezvous,
                           loop=loop) == "async"
        with pytest.raises(ds.InvalidArgumentError, match="loop="):
            ds_vllm.DeltasyncTrainer(sv.AsyncLLMStandIn([]), make_checkpoint(0),
                                     rendezvous=rendezvous, workers=1)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        runner.join(timeout=5)
        loop.close()


def test_client_kinds_follow_vllms_call_signatures():
    sv.install()
    ds_vllm = adapter()
    assert ds_vllm.client_api(VLLMClientStandIn([])) == "plain"
    assert ds_vllm.client_api(sv.LLMStandIn([])) == "llm"
    assert ds_vllm.client_api(sv.AsyncLLMStandIn([])) == "async"


# --- 6. a failed round returns at once ----------------------------------------


def one_worker(factory, rendezvous, client_cls=VLLMClientStandIn, timeout_s=30.0):
    ds_vllm = adapter()
    engines = build_engines(factory, [sv.ParallelConfig()], [TinyTPModel(0, 1)])
    trainer = ds_vllm.DeltasyncTrainer(client_cls(engines), make_checkpoint(7),
                                       rendezvous=rendezvous, workers=1, timeout_s=timeout_s)
    return trainer, engines


def test_a_sender_error_returns_while_the_workers_still_wait(rendezvous):
    factory = sv.install()
    adapter().register()
    trainer, engines = one_worker(factory, rendezvous, timeout_s=30)

    class FailingSender:
        def __init__(self, real):
            self.real = real

        def __getattr__(self, name):
            return getattr(self.real, name)

        def sync(self, weights):
            time.sleep(0.3)  # the workers are inside update_weights by now
            raise ds.InvalidArgumentError("the trainer's tensors do not fit")

    trainer.sender = FailingSender(trainer.sender)
    # Bounds a run that waits for the workers: their receive ends when they leave.
    watchdog = threading.Timer(6.0, engines[0].shutdown)
    watchdog.start()
    try:
        start = time.monotonic()
        with pytest.raises(ds.InvalidArgumentError, match="do not fit"):
            trainer.send_weights(make_checkpoint(7))
        assert time.monotonic() - start < 2.0
        # The workers are still receiving: the next round is refused, not queued.
        with pytest.raises(ds.FailedPreconditionError, match="still in the update_weights"):
            trainer.send_weights(make_checkpoint(7))
    finally:
        watchdog.cancel()
        shutdown(trainer, engines)


def test_a_worker_error_ends_the_sync_in_flight(rendezvous):
    factory = sv.install()
    adapter().register()

    class FailingWorkers(VLLMClientStandIn):
        def update_weights(self, update_info):
            time.sleep(0.3)  # the sender is waiting for the workers by now
            raise RuntimeError("worker 0: update_weights failed")

    trainer, engines = one_worker(factory, rendezvous, FailingWorkers, timeout_s=20)
    try:
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="worker 0"):
            trainer.send_weights(make_checkpoint(7))
        assert time.monotonic() - start < 2.0
        assert trainer.sender.closed
    finally:
        shutdown(trainer, engines)


# --- 5. speculative-decoding draft models -------------------------------------


def test_draft_model_updates_are_refused():
    factory = sv.install()
    ds_vllm = adapter()
    ds_vllm.register()
    target, draft = TinyTPModel(0, 1), TinyTPModel(0, 1)
    engine = build_engines(factory, [sv.ParallelConfig()], [target])[0]
    assert ds_vllm.DeltasyncWeightTransferEngine.supports_draft_weight_update is False
    with pytest.raises(ds.UnsupportedError, match="draft"):
        engine.set_weight_update_target(draft, model_config=None)
    assert engine.model is target
    engine.set_weight_update_target(target, model_config=None)  # the target itself: fine
    engine.reset_weight_update_target()
    assert engine.model is target


# --- what the kernel reads beyond what load_weights wrote ----------------------


def test_a_kernel_layout_and_weights_derived_after_loading_follow_every_sync(rendezvous):
    from standins_engines import DT, VLLMModel, randn_checkpoint, reference, vllm_process

    factory = sv.install()
    ds_vllm = adapter()
    ds_vllm.register()

    def make(seed=7):  # FlashInfer-CUTLASS MoE, MLA weights copied from kv_b_proj
        return VLLMModel(seed, backend="flashinfer_cutlass", derive="copy")

    ckpt = randn_checkpoint(make().shapes(), 41)
    # The engine as vLLM starts it: loaded from disk, then processed.
    model = vllm_process(reference(make, ckpt))
    config = sv.VllmConfig(sv.ParallelConfig(), sv.ModelConfig(dtype=DT))
    engines = [factory.create_engine(sv.Config(), config, torch.device("cpu"), model)]
    memory = {n: p.data_ptr() for n, p in model.named_parameters()}
    trainer = None
    try:
        trainer = ds_vllm.DeltasyncTrainer(VLLMClientStandIn(engines), ckpt,
                                           rendezvous=rendezvous, workers=1, timeout_s=30)
        assert engines[0].fallback == sorted(n for n in ckpt
                                             if n.endswith(("gate_proj.weight", "up_proj.weight")))
        for k in range(3):
            if k:
                g = torch.Generator().manual_seed(k)
                for t in ckpt.values():
                    flat = t.view(-1)
                    mask = torch.rand(flat.numel(), generator=g) < 0.05
                    flat[mask] = (flat[mask].float() + 0.5).to(t.dtype)
            trainer.send_weights(ckpt)
            fresh = dict(vllm_process(reference(make, ckpt)).named_parameters())
            for n, p in model.named_parameters():
                assert same_bits(p.data, fresh[n].data), f"{n} differs from a fresh load"
        assert {n: p.data_ptr() for n, p in model.named_parameters()} == memory
    finally:
        shutdown(trainer, engines)


# --- a worker that runs vLLM's layerwise reload itself --------------------------


@pytest.mark.parametrize("checkpoint_format", [True, False])
def test_a_layerwise_reload_round_is_refused_and_an_in_place_one_syncs(rendezvous,
                                                                       checkpoint_format):
    factory = sv.install()
    ds_vllm = adapter()
    ds_vllm.register()
    shapes = sv.ReloadModel().shapes()

    def change(ckpt, k):
        g = torch.Generator().manual_seed(k)
        for t in ckpt.values():
            flat = t.view(-1)
            mask = torch.rand(flat.numel(), generator=g) < 0.05
            flat[mask] = (flat[mask].float() + 0.5).to(t.dtype)

    g = torch.Generator().manual_seed(5)
    ckpt = {n: torch.randn(s, generator=g).to(d) for n, (d, s) in shapes.items()}
    model = sv.ReloadModel(seed=3)
    sv.record_metadata_for_reloading(model)  # as vLLM's loader does
    model.load_weights([(n, t.clone()) for n, t in ckpt.items()])
    config = sv.VllmConfig(sv.ParallelConfig(), sv.ModelConfig(dtype=torch.bfloat16))
    engine = factory.create_engine(sv.Config(), config, torch.device("cpu"), model)
    worker = sv.LayerwiseReloadWorker(engine, model, config.model_config)
    client = sv.LayerwiseReloadClient([worker], is_checkpoint_format=checkpoint_format)
    params = dict(model.named_parameters())
    memory = {n: p.data_ptr() for n, p in params.items()}
    trainer = None
    try:
        trainer = ds_vllm.DeltasyncTrainer(client, ckpt, rendezvous=rendezvous, workers=1,
                                           timeout_s=30)
        if checkpoint_format:
            before = {n: p.detach().clone() for n, p in params.items()}
            change(ckpt, 1)
            with pytest.raises(ds.FailedPreconditionError, match="layerwise reload"):
                trainer.send_weights(ckpt)
            client.finish_weight_update()  # the worker's own end of the round
            for n, p in model.named_parameters():
                assert p is params[n] and same_bits(p.data, before[n]), f"{n} was changed"
            # What that flow expects instead: whole tensors through load_weights,
            # processed per layer and copied into the same memory.
            client.start_weight_update()
            assert all(p.is_meta for _, p in model.named_parameters())
            model.load_weights([(n, t.clone()) for n, t in ckpt.items()])
            client.finish_weight_update()
        else:
            for k in range(1, 3):
                change(ckpt, k)
                trainer.send_weights(ckpt)
        reference = sv.ReloadModel(seed=7)
        reference.load_weights([(n, t.clone()) for n, t in ckpt.items()])
        fresh = dict(reference.named_parameters())
        for n, p in model.named_parameters():
            assert p is params[n] and p.data_ptr() == memory[n], f"{n} moved"
            assert same_bits(p.data, fresh[n].data), f"{n} differs from a fresh load"
    finally:
        shutdown(trainer, [engine])


# --- a worker that holds part of the model ---------------------------------------


def change(ckpt, k):
    """About 5% of every tensor's elements changed."""
    g = torch.Generator().manual_seed(k)
    for t in ckpt.values():
        flat = t.view(-1)
        mask = torch.rand(flat.numel(), generator=g) < 0.05
        flat[mask] = (flat[mask].float() + 0.5).to(t.dtype)


def assert_fresh(model, make, ckpt):
    """``model`` holds what ``make``'s model loaded whole from ``ckpt`` holds."""
    from standins_engines import reference

    fresh = dict(reference(make, ckpt).named_parameters())
    got = dict(model.named_parameters())
    assert sorted(got) == sorted(fresh)
    for n, p in got.items():
        assert same_bits(p.data, fresh[n].data), f"{n} differs from a fresh load"


@pytest.mark.parametrize("split", ["expert_parallel", "pipeline"])
def test_a_worker_holding_part_of_the_model_syncs_it_and_keeps_nothing_of_the_rest(rendezvous,
                                                                                  split):
    from standins_engines import MoEModel, randn_checkpoint, reference

    factory = sv.install()
    ds_vllm = adapter()
    ds_vllm.register()

    def maker(r):  # experts split over two ranks (lm_head tied), or two pipeline stages
        if split == "expert_parallel":
            return lambda seed=7: MoEModel(seed, ep_rank=r, ep_size=2)
        return lambda seed=7: MoEModel(seed, pp_rank=r, pp_size=2, tie=False)

    makers = [maker(r) for r in range(2)]
    ckpt = randn_checkpoint(makers[0]().shapes(), 43)
    models = [reference(make, ckpt, seed=7) for make in makers]  # as loaded from disk
    engines = build_engines(factory, [sv.ParallelConfig(rank=r, world_size=2) for r in range(2)],
                            models)
    trainer = None
    try:
        trainer = ds_vllm.DeltasyncTrainer(VLLMClientStandIn(engines), ckpt,
                                           rendezvous=rendezvous, workers=2, timeout_s=30)
        skipped = [set(e.weights.skipped) for e in engines]
        assert all(skipped) and all(s < set(ckpt) for s in skipped)
        # Every tensor is some worker's, but the tied lm_head (the embedding's parameter).
        assert skipped[0] & skipped[1] == ({"lm_head.weight"} if split == "expert_parallel"
                                           else set())
        for k in range(3):
            if k:
                change(ckpt, k)
            stats = trainer.send_weights(ckpt)
            assert stats["partial_receivers"] == 2
            for e, m, make, s in zip(engines, models, makers, skipped):
                assert e.last["partial"] and e.last["tensors"] == len(ckpt) - len(s)
                assert_fresh(m, make, ckpt)
        for e, s in zip(engines, skipped):  # no host copy of what the worker skips
            assert e.fallback == [] and not set(e.weights.shadows) & s
    finally:
        shutdown(trainer, engines)


# --- a parameter the engine replaces between syncs --------------------------------


@pytest.mark.parametrize("how", ["replaced", "reallocated"])
def test_a_parameter_the_engine_replaces_is_followed_and_its_old_memory_gets_nothing(rendezvous,
                                                                                     how):
    from standins_engines import MoEModel, randn_checkpoint, reference, replace_parameter

    factory = sv.install()
    ds_vllm = adapter()
    ds_vllm.register()

    def make(seed=7):  # the whole model: every tensor held
        return MoEModel(seed, tie=False)

    ckpt = randn_checkpoint(make().shapes(), 44)
    model = reference(make, ckpt, seed=7)
    engines = build_engines(factory, [sv.ParallelConfig()], [model])
    client = VLLMClientStandIn(engines)
    trainer = None
    try:
        trainer = ds_vllm.DeltasyncTrainer(client, ckpt, rendezvous=rendezvous, workers=1,
                                           timeout_s=30)
        trainer.send_weights(ckpt)
        change(ckpt, 1)
        trainer.send_weights(ckpt)
        assert_fresh(model, make, ckpt)
        # Between two syncs the engine gives a weight new memory whose contents
        # the stream cannot know (a wake from sleep that reloads, a reload):
        # vLLM's replace_parameter sets a new Parameter, a quant method's
        # processing sets ``.data``.
        layer = model.model.layers[0].self_attn.qkv_proj
        old = layer.weight
        kept = old.detach().clone()
        if how == "replaced":
            replace_parameter(layer, "weight", torch.zeros_like(old))
        else:
            old_data = old.data
            old.data = torch.zeros_like(old)
            old = old_data
        assert layer.weight.data_ptr() != old.data_ptr()
        change(ckpt, 2)
        # The receiver follows the new memory, which asks for a seed: this
        # round is refused with nothing written, and the next one reseeds.
        with pytest.raises(ds.FailedPreconditionError, match="asks for a seed"):
            trainer.send_weights(ckpt)
        assert same_bits(old.data, kept), "a write reached the old memory"
        trainer._update.join(30)
        for k in (None, 3):
            if k:
                change(ckpt, k)
            trainer.send_weights(ckpt)
            assert_fresh(model, make, ckpt)
            assert same_bits(old.data, kept), "a write reached the old memory"
        assert engines[0].weights.stats["relearned"] == 1
    finally:
        shutdown(trainer, engines)
