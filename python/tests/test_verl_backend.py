"""The verl checkpoint-engine backend against verl's behaviour (the
stand-in in standins_verl.py): verl's registry finds it by name through
``custom_backend_module``; its manager's every-step topology round keeps
the stream, so a trainer's syncs to two rollout workers are a seed and
then deltas, bit-exact after each, from one trainer rank or a sharded
two; bad input stops every worker with the trainer's error instead of a
wait."""

import asyncio
import importlib
import os
import sys

import pytest
import torch

import deltasync as ds
import standins_verl as sv

pytestmark = pytest.mark.skipif("gloo" not in ds.built_communicators(),
                                reason="this build has no gloo communicator")

MODULE = "deltasync.adapters.verl"


def adapter():
    """The adapter module as imported over whatever verl is installed now."""
    sys.modules.pop(MODULE, None)
    return importlib.import_module(MODULE)


@pytest.fixture
def verl():
    """The verl stand-in, installed for one test, the adapter imported over it."""
    base = sv.install()
    yield base, adapter()
    sv.uninstall()
    sys.modules.pop(MODULE, None)
    import deltasync.adapters as package

    if hasattr(package, "verl"):
        delattr(package, "verl")


def model(seed=0):
    """A trainer's full tensors: fp32 master weights, an integer buffer and
    a 0-dim scalar (fewer elements than trainer ranks)."""
    g = torch.Generator().manual_seed(seed)
    return {"model.embed_tokens.weight": torch.randn(64, 16, generator=g),
            "model.layers.0.mlp.down_proj.weight": torch.randn(48, 16, generator=g),
            "model.norm.weight": torch.randn(16, generator=g),
            "model.steps": torch.arange(5, dtype=torch.int64),
            "model.scale": torch.tensor(3.0)}


def step(w, k):
    """One optimizer step: a few elements change (a NaN among them)."""
    w["model.embed_tokens.weight"].view(-1)[k::97] += 0.5
    w["model.layers.0.mlp.down_proj.weight"][k % 48, k % 16] = float("nan")
    w["model.norm.weight"][k % 16] *= 2
    w["model.steps"][k % 5] += 1


def bits(t):
    return t.contiguous().reshape(-1).view(torch.uint8)


def config(tmp_path, **options):
    kwargs = {"rendezvous": "file:" + str(tmp_path / "rv"), "timeout_s": 20,
              "connect_timeout_s": 20, "sync_wait_s": 20, "control_bytes": 64 << 10}
    kwargs.update(options)
    return sv.CheckpointEngineConfig(backend="deltasync", engine_kwargs={"deltasync": kwargs},
                                     custom_backend_module=MODULE)


def cluster(cfg, export, trainers=1, rollouts=2):
    adapters = [sv.ServerAdapter() for _ in range(rollouts)]
    manager = sv.CheckpointEngineManager(
        cfg, [sv.TrainerWorker(r, cfg, export) for r in range(trainers)],
        [sv.RolloutWorker(cfg, a) for a in adapters])
    return manager, adapters


def shutdown(manager):
    for w in manager.trainers + manager.rollouts:
        w.checkpoint_engine.shutdown()


def assert_engines_hold(adapters, want):
    for i, a in enumerate(adapters):
        assert sorted(a.updates[-1]) == sorted(want), (i, a.updates[-1])
        for name, t in want.items():
            assert a.weights[name].dtype == t.dtype, (i, name)
            assert torch.equal(bits(a.weights[name]), bits(t)), (i, name)


# --- 1. verl finds the backend by name ------------------------------------------


def test_the_registry_finds_deltasync_by_name(verl, tmp_path):
    base, ds_verl = verl
    assert ds_verl.VERL  # the stand-in's verl: the real base class and registry
    registry = base.CheckpointEngineRegistry
    cls = registry.get("deltasync")
    assert cls is ds_verl.DeltasyncCheckpointEngine
    assert issubclass(cls, base.CheckpointEngine) and cls.wire_format == "named_tensors"
    assert sorted(registry._registry) == ["deltasync", "naive"]
    # A fresh verl process: the backend is unknown until a worker imports
    # custom_backend_module, as verl's workers do before building engines.
    base = sv.install()
    sys.modules.pop(MODULE, None)
    registry = base.CheckpointEngineRegistry
    with pytest.raises(ValueError, match=r"Checkpoint engine deltasync not registered"):
        registry.get("deltasync")
    cfg = config(tmp_path)
    trainer = sv.TrainerWorker(0, cfg, None)
    cls = registry.get("deltasync")
    assert cls is sys.modules[MODULE].DeltasyncCheckpointEngine
    rollout = sv.RolloutWorker(cfg, sv.ServerAdapter())
    # Built as verl's workers build engines (every abstract method defined).
    assert isinstance(trainer.checkpoint_engine, cls) and trainer.checkpoint_engine.is_master
    assert isinstance(rollout.checkpoint_engine, cls) and not rollout.checkpoint_engine.is_master
    with pytest.raises(ValueError, match=r"Checkpoint engine nope not registered.*deltasync"):
        registry.get("nope")
    # Bad options are refused where verl builds the engine.
    with pytest.raises(ds.InvalidArgumentError, match="communicator 'mpi'"):
        registry.new("deltasync", bucket_size=1, communicator="mpi")
    with pytest.raises(ds.InvalidArgumentError, match="rollout_dtype 'bf17'"):
        registry.new("deltasync", bucket_size=1, rollout_dtype="bf17")

    # Without verl: a standalone registry and base of the same shape.
    sv.uninstall()
    alone = adapter()
    assert not alone.VERL
    assert alone.CheckpointEngineRegistry.get("deltasync") is alone.DeltasyncCheckpointEngine
    assert alone.DeltasyncCheckpointEngine.__mro__[1].__abstractmethods__ == {
        "prepare", "build_topology", "init_process_group", "finalize", "send_weights",
        "receive_weights"}
    with pytest.raises(ValueError, match="registered backends: .*'deltasync'"):
        alone.CheckpointEngineRegistry.get("nccl")


# --- 2. a seed, then deltas, bit-exact ---------------------------------------------


def test_three_syncs_to_two_rollout_workers_seed_then_deltas(verl, tmp_path):
    w = model(0)
    full_bytes = sum(t.numel() * t.element_size() for t in w.values())
    manager, adapters = cluster(config(tmp_path),
                                lambda rank: ((n, t.clone()) for n, t in w.items()))
    try:
        for k in range(3):
            if k:
                step(w, k)
            metrics = manager.update_weights(global_steps=k + 1)
            assert_engines_hold(adapters, w)
            assert all(a.updates[-1] == list(w) for a in adapters)  # the trainer's order
            for r in manager.rollouts:
                last = r.checkpoint_engine.last
                assert last["seed"] == (k == 0) and last["global_steps"] == k + 1, last
            if k == 0:
                assert metrics["checkpoint_engine/seeded"] == 2.0
            else:
                # A delta: only what step() changed (NaN included) crossed.
                assert metrics["checkpoint_engine/seeded"] == 0.0, metrics
                assert 0 < metrics["checkpoint_engine/changed_elems"] < 20, metrics
                assert metrics["checkpoint_engine/payload_mbytes"] * (1 << 20) < full_bytes / 4
        engine = manager.trainers[0].checkpoint_engine
        assert not engine.sharded and engine.last["sync_id"] == 3
    finally:
        shutdown(manager)


# --- 3. a sharded trainer ----------------------------------------------------------


class Shard:
    """torch.distributed.tensor's Shard(dim) placement, as read by name."""

    def __init__(self, dim):
        self.dim = dim


class Mesh:
    def __init__(self, rank, size):
        self.rank, self.n = rank, size

    def get_coordinate(self):
        return [self.rank]

    def size(self, dim=0):
        return self.n


class RowShardedDTensor:
    """What an FSDP2 parameter exposes: its placements over a 1-D mesh, its
    global shape and dtype, its local chunk (torch.chunk's split)."""

    def __init__(self, full, rank, size):
        self.placements = [Shard(0)]
        self.device_mesh = Mesh(rank, size)
        self.shape = full.shape
        self.dtype = full.dtype
        self._full = full
        self._local = full.chunk(size)[rank].clone()

    def is_floating_point(self):
        return self._full.is_floating_point()

    def to_local(self):
        return self._local

    def full_tensor(self):
        return self._full.clone()


def test_a_sharded_trainer_casts_and_syncs_its_parts(verl, tmp_path):
    """Two trainer ranks: each keeps its part of every full tensor (and one
    parameter comes as a row-sharded DTensor), casts fp32 to bf16 first;
    the rollout workers hold the bf16 model, bit-exact after each sync.
    They meet where trainer rank 0 says (no rendezvous configured)."""
    w = model(1)

    def export(rank):
        for n, t in w.items():
            if n == "model.layers.0.mlp.down_proj.weight":
                yield n, RowShardedDTensor(t, rank, 2)
            else:
                yield n, t.clone()

    def rollout_view():
        return {n: (t.to(torch.bfloat16) if t.is_floating_point() else t) for n, t in w.items()}

    # No rendezvous given: trainer rank 0 makes one (the workers share a host).
    manager, adapters = cluster(config(tmp_path, rollout_dtype="bfloat16", rendezvous=None),
                                export, trainers=2)
    try:
        for k in range(3):
            if k:
                step(w, k)
            metrics = manager.update_weights(global_steps=k + 1)
            assert_engines_hold(adapters, rollout_view())
            assert metrics["checkpoint_engine/seeded"] == (2.0 if k == 0 else 0.0), metrics
            if k:
                assert 0 < metrics["checkpoint_engine/changed_elems"] < 20, metrics
        engines = [t.checkpoint_engine for t in manager.trainers]
        assert all(e.sharded for e in engines)
        # Each rank holds its half of each tensor, not the whole.
        held = engines[1]._buffers
        assert held["model.embed_tokens.weight"].numel() == 64 * 16 // 2
        assert held["model.embed_tokens.weight"].dtype == torch.bfloat16
        assert "model.scale" not in held  # one element: rank 0's part
    finally:
        shutdown(manager)


# --- 4. bad input: a clear error on every worker, then the stream goes on ------------


def test_bad_input_stops_every_worker_with_the_trainers_error(verl, tmp_path):
    w = model(2)
    extra = {}
    manager, adapters = cluster(
        config(tmp_path), lambda rank: ((n, t.clone()) for n, t in {**w, **extra}.items()))
    try:
        manager.update_weights(global_steps=1)
        assert_engines_hold(adapters, w)

        def refused(global_steps, pattern, rollout_pattern=None):
            with pytest.raises(sv.WorkerErrors) as info:
                manager.update_weights(global_steps=global_steps)
            errors = info.value.errors
            assert sorted(errors) == [0, 1, 2], errors  # every worker returned
            assert isinstance(errors[0], ds.InvalidArgumentError), errors
            assert pattern in str(errors[0]), errors
            for i in (1, 2):
                assert isinstance(errors[i], ds.InvalidArgumentError), errors
                assert (rollout_pattern or pattern) in str(errors[i]), errors
                assert f"stopped update {global_steps}" in str(errors[i]), errors

        # A tensor the first sync did not have.
        extra["lm_head.weight"] = torch.zeros(4, 16)
        refused(2, "tensor 'lm_head.weight' was not in the first sync")
        extra.clear()
        # A tensor of another shape; one missing.
        saved = w["model.norm.weight"]
        w["model.norm.weight"] = torch.zeros(8)
        refused(3, "tensor 'model.norm.weight' is F32 [8] here but was F32 [16]")
        w["model.norm.weight"] = saved
        saved = w.pop("model.steps")
        refused(4, "tensor 'model.steps' of the first sync is missing")
        w["model.steps"] = saved
        # Twice the same name.
        export = manager.trainers[0].export
        manager.trainers[0].export = lambda r: iter(list(export(r)) + [("model.scale", saved)])
        refused(5, "tensor 'model.scale' yielded twice")
        manager.trainers[0].export = export

        # The stream goes on: the next sync is a delta, bit-exact.
        step(w, 6)
        metrics = manager.update_weights(global_steps=6)
        assert metrics["checkpoint_engine/seeded"] == 0.0, metrics
        assert_engines_hold(adapters, w)

        # Each side checks the other's global_steps: a stale update is refused
        # on the rollout side, after its sync (the stream stays in step).
        trainer = manager.trainers[0]
        step(w, 7)

        async def receive(r):
            weights = r.checkpoint_engine.receive_weights(global_steps=8)
            await r.server_adapter.update_weights(weights)

        with pytest.raises(sv.WorkerErrors) as info:
            sv.call_all([lambda: trainer.checkpoint_engine.send_weights(trainer.export(0),
                                                                        global_steps=7)]
                        + [lambda r=r: receive(r) for r in manager.rollouts])
        assert sorted(info.value.errors) == [1, 2]
        assert "global_steps 7, this update is for 8" in str(info.value.errors[1])
        step(w, 8)
        assert manager.update_weights(global_steps=9)["checkpoint_engine/seeded"] == 0.0
        assert_engines_hold(adapters, w)
    finally:
        shutdown(manager)


def test_a_rollout_worker_refuses_tensors_other_than_its_own(verl, tmp_path):
    """A trainer that lost its state sends another tensor list: each rollout
    worker names the difference (and the sync is refused, not waited for)."""
    w = model(3)
    manager, adapters = cluster(config(tmp_path),
                                lambda rank: ((n, t.clone()) for n, t in w.items()))
    try:
        manager.update_weights(global_steps=1)
        trainer = manager.trainers[0].checkpoint_engine
        trainer._model = None  # forgets the first sync: its list goes out again
        w["lm_head.weight"] = torch.ones(4, 16)
        with pytest.raises(sv.WorkerErrors) as info:
            manager.update_weights(global_steps=2)
        errors = info.value.errors
        assert sorted(errors) == [0, 1, 2], errors
        assert "lm_head.weight" in str(errors[0]), errors
        for i in (1, 2):
            assert isinstance(errors[i], ds.InvalidArgumentError), errors
            assert ("the trainer's tensors differ from the ones this rollout worker holds: "
                    "tensor 'lm_head.weight' was not in the first sync") in str(errors[i]), errors
    finally:
        shutdown(manager)


def test_topology_checks(verl, tmp_path):
    _, ds_verl = verl
    cls = ds_verl.DeltasyncCheckpointEngine
    master = cls(bucket_size=1, is_master=True, rendezvous="file:" + str(tmp_path / "rv"))
    worker = cls(bucket_size=1)
    m, o = master.prepare(), worker.prepare()
    actor, rollout = cls.build_topology(1, 2, [m, o, cls(bucket_size=1).prepare()])
    assert actor["rank"] == [0] and rollout["rank"] == [1, 2]
    assert rollout["world_size"] == [3, 3] and actor["group"] == rollout["group"][:1]
    # The same members find the same groups; others, new ones.
    again = cls.build_topology(1, 2, [m, o, o])
    assert again[0]["group"] != actor["group"]
    assert cls.build_topology(1, 2, [m, o, o])[0]["group"] == again[0]["group"]
    with pytest.raises(ds.InvalidArgumentError, match="trainer rank 0 must be the master"):
        cls.build_topology(1, 1, [o, m])
    with pytest.raises(ds.InvalidArgumentError, match="3 workers' metadata for 1 trainer"):
        cls.build_topology(1, 1, [m, o, o])
    # No rendezvous given: one host only.
    made = cls(bucket_size=1, is_master=True)
    auto = made.prepare()
    assert auto["rendezvous"].startswith("file:") and auto["auto_rendezvous"]
    assert made.prepare()["rendezvous"] == auto["rendezvous"]  # made once
    far = dict(o, host="another-host")
    with pytest.raises(ds.InvalidArgumentError, match="2 hosts .* no rendezvous was given"):
        cls.build_topology(1, 1, [auto, far])
    made.shutdown()  # and removed with the engine
    assert not os.path.exists(auto["rendezvous"][len("file:"):])
    with pytest.raises(ds.FailedPreconditionError, match="did not join as a trainer"):
        asyncio.run(worker.send_weights(iter([])))


# --- 5. on a GPU ------------------------------------------------------------------


@pytest.mark.skipif(not (torch.cuda.is_available() and ds.built_with_cuda()),
                    reason="needs a GPU and a CUDA build")
def test_cuda_tensors_on_both_sides(verl, tmp_path):
    """CUDA tensors from two sharded trainer ranks into copies the rollout
    workers keep on the GPU: a seed, then deltas, bit-exact."""
    w = {n: t.cuda() for n, t in model(4).items()}
    manager, adapters = cluster(config(tmp_path, device="cuda"),
                                lambda rank: ((n, t.clone()) for n, t in w.items()), trainers=2)
    try:
        for k in range(3):
            if k:
                step(w, k)
            metrics = manager.update_weights(global_steps=k + 1)
            assert_engines_hold(adapters, {n: t.cpu() for n, t in w.items()})
            assert metrics["checkpoint_engine/seeded"] == (2.0 if k == 0 else 0.0), metrics
        for r in manager.rollouts:
            assert all(t.is_cuda for t in r.checkpoint_engine._mirror.values())
        assert all(b.is_cuda for b in manager.trainers[0].checkpoint_engine._buffers.values())
    finally:
        shutdown(manager)
