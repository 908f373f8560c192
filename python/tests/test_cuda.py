"""The package with CUDA tensors (runs where torch sees a GPU and deltasync
was built with CUDA; skips elsewhere): the stream between device tensors,
the adapters on a model in device memory, and a real DTensor's ShardSpec."""

import threading

import pytest
import torch
import torch.multiprocessing as mp

import deltasync as ds
from deltasync.adapters import sglang as ds_sglang
from stream_rounds import run_rounds
from standins import SGLangEngineStandIn, assert_matches_reference, make_checkpoint, rl_step

cuda = pytest.mark.skipif(not (torch.cuda.is_available() and ds.built_with_cuda()),
                          reason="needs a GPU and a CUDA build of deltasync")


def bits(t):
    return t.contiguous().view(torch.uint8)


@cuda
@pytest.mark.parametrize("prepared", [False, True], ids=["tensors", "prepared"])
def test_stream_between_device_tensors(rendezvous, prepared):
    g = torch.Generator(device="cuda").manual_seed(0)
    w = {"emb": torch.randn(512, 256, device="cuda", generator=g).to(torch.bfloat16),
         "norm": torch.randn(256, device="cuda", generator=g),
         "host": torch.randn(100)}
    whole = {n: torch.zeros_like(t) for n, t in w.items()}
    cols = torch.zeros(512, 128, dtype=torch.bfloat16, device="cuda")
    errors = []

    def receiver(r):
        try:
            # Receiver 2 holds a column slice of one tensor: a partial one.
            with ds.StreamReceiver(ds.Group(rendezvous, r, 3, timeout_s=60),
                                   partial=r == 2) as rx:
                if r == 1:
                    rx.register_all(whole)
                else:
                    rx.register("emb", cols, runs=[(i * 256 + 128, 128, i * 128, 1)
                                                   for i in range(512)], shape=[512, 256])
                for _ in range(4):
                    rx.receive()
                torch.cuda.synchronize()
        except BaseException as e:
            errors.append(e)

    ts = [threading.Thread(target=receiver, args=(r,)) for r in (1, 2)]
    [t.start() for t in ts]
    # Prepared tensors are read on the stream current at each sync: here a
    # side stream that also makes the updates.
    given = ds.prepare(w) if prepared else w
    side = torch.cuda.Stream() if prepared else torch.cuda.current_stream()
    with ds.StreamSender(ds.Group(rendezvous, 0, 3, timeout_s=60)) as tx, torch.cuda.stream(side):
        for k in range(4):
            if k:
                w["emb"].view(-1)[k::97] += 1
                w["norm"][k] = float("nan")
                w["host"][k] += 1
            stats = tx.sync(given)
            assert stats["receivers"] == 2
    torch.cuda.synchronize()
    [t.join() for t in ts]
    assert not errors, errors
    for n, t in w.items():
        assert torch.equal(bits(whole[n]), bits(t)), n
    assert torch.equal(bits(cols), bits(w["emb"][:, 128:]))


@cuda
def test_host_only_calls_name_a_cuda_tensor_and_the_publisher_copies_it(tmp_path):
    t = torch.zeros(8, device="cuda")
    with pytest.raises(ds.InvalidArgumentError, match="'w': on CUDA device 0"):
        ds.diff(t, t, name="w")
    w = {"w": torch.randn(64, 64, device="cuda").to(torch.bfloat16)}
    with ds.Publisher(tmp_path / "store", w) as pub:
        w["w"][0, 0] += 1
        assert pub.publish(w)["changed_elements"] == 1


@cuda
def test_sglang_adapter_on_a_model_in_device_memory():
    engine = SGLangEngineStandIn(2, custom_weight_loader=[ds_sglang.LOAD_FORMAT], device="cuda")
    pusher = ds_sglang.SGLangPusher(engine)
    ckpt = make_checkpoint(5)
    pusher.push(ckpt)
    for step in range(3):
        rl_step(ckpt, step)
        pusher.push(ckpt)
        for m in engine.workers:
            assert_matches_reference(m, ckpt)
    assert ds_sglang.engine_weights(engine.workers[0]).stats["scattered_elements"] > 0


def _dtensor_worker(rank, init):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=4)
    try:
        full = torch.arange(10 * 6, dtype=torch.float32).reshape(10, 6)
        mesh = init_device_mesh("cpu", (4,))
        for placements in ([Shard(0)], [Shard(1)], [Replicate()]):
            dt = distribute_tensor(full, mesh, placements)
            spec = ds.ShardSpec.from_dtensor("w", dt)
            box = spec.pieces[0]
            local = dt.to_local()
            region = full[tuple(slice(o, o + e) for o, e in zip(box.hf_offset, box.extent))]
            assert torch.equal(local, region), (placements, box.hf_offset, box.extent)
            assert spec.contributes == (placements != [Replicate()] or rank == 0)
        mesh2 = init_device_mesh("cpu", (2, 2))
        dt = distribute_tensor(full, mesh2, [Shard(0), Shard(1)])
        spec = ds.ShardSpec.from_dtensor("w", dt)
        box = spec.pieces[0]
        assert torch.equal(dt.to_local(), full[tuple(
            slice(o, o + e) for o, e in zip(box.hf_offset, box.extent))])
    finally:
        dist.destroy_process_group()


def test_shard_spec_of_real_dtensors(tmp_path):
    try:
        import torch.distributed.tensor  # noqa: F401 - torch >= 2.4
    except ImportError:
        pytest.skip("this torch has no DTensor")
    mp.spawn(_dtensor_worker, args=("file://" + str(tmp_path / "init"),), nprocs=4, join=True)


def _nccl_pair_worker(rank, how, init, rendezvous_dir, syncs):
    # NCCL refuses two ranks of one group on one GPU; a host id of its own
    # per process makes it take them for two hosts joined over its socket
    # transport (test-only: a real two-rank NCCL group on a one-GPU machine).
    import os

    os.environ["NCCL_HOSTID"] = f"deltasync-test-rank{rank}"
    os.environ["NCCL_SOCKET_IFNAME"] = "lo"
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    import torch.distributed as dist

    torch.cuda.set_device(0)
    if how.startswith("torch"):
        dist.init_process_group("nccl", init_method=init, rank=rank, world_size=2)
        group = ds.TorchGroup(timeout_s=60)
    else:
        group = ds.Group("file:" + rendezvous_dir, rank, 2, backend="nccl", timeout_s=60)
    try:
        # Seeded generators: both ranks draw the same values.
        g = torch.Generator(device="cuda").manual_seed(3)
        # "device": every tensor on the GPU, so the frames stay there too.
        all_device = how in ("device", "torch-device")
        host_place = "cuda" if all_device else "cpu"
        h = g if all_device else torch.Generator().manual_seed(4)
        w = {"emb": torch.randn(300, 70, device="cuda", generator=g).to(torch.bfloat16),
             "norm": torch.randn(70, device="cuda", generator=g),
             "host": torch.randn(33, device=host_place, generator=h)}

        def step(k):
            w["emb"].view(-1)[k::31] += 1
            w["norm"][k] = float("nan")
            w["host"][k] = -0.0

        run_rounds(group, rank, w, step, syncs, label=how + " ", device_frames=all_device)
    finally:
        if how.startswith("torch"):
            dist.destroy_process_group()


@cuda
@pytest.mark.parametrize("how", ["torch", "torch-device", "group", "device"],
                         ids=["torch-nccl-group", "torch-nccl-group-device-frames",
                              "deltasync-nccl", "deltasync-nccl-device-frames"])
def test_device_tensors_over_nccl_between_two_processes(tmp_path, how):
    if not how.startswith("torch") and "nccl" not in ds.built_communicators():
        pytest.skip("this build has no nccl communicator")
    init = "file://" + str(tmp_path / "pg_init")
    mp.spawn(_nccl_pair_worker, args=(how, init, str(tmp_path / "rv"), 3), nprocs=2, join=True)


# A sharded trainer whose shards live on the GPU: name -> (shape, dtype,
# how the two ranks split it: a dim, or None for a replica rank 0 sends).
CUDA_SHARDS = {
    "emb": ((256, 96), torch.bfloat16, 0),
    "proj": ((64, 80), torch.float32, 1),
    "norm": ((96,), torch.float32, None),
}
CUDA_SHARD_SYNCS = 4


def _cuda_shard_full(k):
    """The whole model after step k, the same on every rank: each step
    changes a strided few elements, one to NaN and one to -0.0."""
    g = torch.Generator().manual_seed(11)
    out = {n: torch.randn(s, generator=g).to(d) for n, (s, d, _) in CUDA_SHARDS.items()}
    out["count"] = torch.arange(5, dtype=torch.int64)
    for j in range(1, k + 1):
        for name in CUDA_SHARDS:
            flat = out[name].view(-1)
            flat[j::37] += 1
            flat[(7 * j) % flat.numel()] = float("nan")
            flat[(11 * j) % flat.numel()] = -0.0
        out["count"][j % 5] += j
    return out


def _cuda_shard_worker(rank, how, snapshot, init, rendezvous_dir, stream_rv):
    # Two trainer ranks on one GPU over NCCL: a host id of their own each,
    # as in _nccl_pair_worker.
    import os

    os.environ["NCCL_HOSTID"] = f"deltasync-test-rank{rank}"
    os.environ["NCCL_SOCKET_IFNAME"] = "lo"
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    import torch.distributed as dist

    torch.cuda.set_device(0)
    if how == "torch":
        dist.init_process_group("nccl", init_method=init, rank=rank, world_size=2)
        trainers = ds.TorchGroup(timeout_s=60)
    else:
        trainers = ds.Group("file:" + rendezvous_dir, rank, 2, backend="nccl", timeout_s=60)
    try:
        model = {n: (dtype_name_of(d), list(s)) for n, (s, d, _) in CUDA_SHARDS.items()}
        model["count"] = ("I64", [5])
        group = ds.Group(stream_rv, 0, 2, timeout_s=60) if rank == 0 else None
        with ds.StreamSender(group, trainers=trainers,
                             pinned_snapshot=snapshot == "pinned") as tx:
            for k in range(CUDA_SHARD_SYNCS):
                full = _cuda_shard_full(k)
                shards = []
                for name, (shape, _, dim) in CUDA_SHARDS.items():
                    dt = model[name][0]
                    if dim is None:
                        spec = ds.ShardSpec.replicate(name, dt, list(shape), rank == 0)
                        local = full[name]
                    else:
                        spec = ds.ShardSpec.shard(name, dt, list(shape), dim, rank, 2)
                        local = full[name].chunk(2, dim)[rank]
                    shards.append((spec, local.contiguous().cuda()))
                # A host shard beside the device ones.
                shards.append((ds.ShardSpec.replicate("count", "I64", [5], rank == 0),
                               full["count"]))
                stats = tx.sync_shards(model, shards)
                assert stats["sync_id"] >= 1, stats
    finally:
        if how == "torch":
            dist.destroy_process_group()


def dtype_name_of(dtype):
    return {torch.bfloat16: "BF16", torch.float32: "F32"}[dtype]


@cuda
@pytest.mark.parametrize("how,snapshot", [("group", "device"), ("torch", "pinned")],
                         ids=["deltasync-nccl-device-snapshot", "torch-nccl-pinned-snapshot"])
def test_cuda_shards_of_two_trainer_ranks_sync_bit_exact(tmp_path, how, snapshot):
    if how == "group" and "nccl" not in ds.built_communicators():
        pytest.skip("this build has no nccl communicator")
    stream_rv = "file:" + str(tmp_path / "stream")
    got = {n: torch.zeros(s, dtype=d) for n, (s, d, _) in CUDA_SHARDS.items()}
    got["count"] = torch.zeros(5, dtype=torch.int64)
    errors, mismatches = [], []

    def receive():
        try:
            with ds.StreamReceiver(ds.Group(stream_rv, 1, 2, timeout_s=120)) as rx:
                rx.register_all(got)
                for k in range(CUDA_SHARD_SYNCS):
                    rx.receive()
                    want = _cuda_shard_full(k)
                    for n, t in want.items():
                        if not torch.equal(bits(got[n]), bits(t)):
                            mismatches.append((k, n))
        except BaseException as e:  # reported by the test
            errors.append(e)

    rx = threading.Thread(target=receive)
    rx.start()
    mp.spawn(_cuda_shard_worker,
             args=(how, snapshot, "file://" + str(tmp_path / "pg"), str(tmp_path / "rv"),
                   stream_rv),
             nprocs=2, join=True)
    rx.join(120)
    assert not errors, errors
    assert not mismatches, mismatches
