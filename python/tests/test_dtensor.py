"""Sharded syncs of real DTensors: four trainer ranks as processes on a 2x2
CPU mesh over a gloo process group, every placement ShardSpec.from_dtensor
reads (nested Shard on one dim, Shard on two dims, uneven Shard, and
Replicate over one mesh dim as HSDP's replicas), synced to a receiver that
holds the whole tensors, bit-exact against full_tensor(); and the
placements it must refuse (_StridedShard, as FSDP2 over tensor parallelism
makes, and Partial). Needs torch >= 2.4 (torch.distributed.tensor); skips
on older torch."""

import threading

import pytest
import torch
import torch.multiprocessing as mp

import deltasync as ds
from deltasync._tensors import dtype_name

try:
    import torch.distributed.tensor  # noqa: F401  (torch >= 2.4)
    HAVE_DTENSOR = True
except ImportError:
    HAVE_DTENSOR = False

pytestmark = [
    pytest.mark.skipif(not HAVE_DTENSOR, reason="needs torch >= 2.4 (DTensor)"),
    pytest.mark.skipif("gloo" not in ds.built_communicators(),
                       reason="this build has no gloo communicator"),
]

# name -> (shape, dtype, placements over the 2x2 mesh)
PLACEMENTS = {
    "nested_rows": ((16, 6), torch.bfloat16, ("Shard(0)", "Shard(0)")),
    "grid": ((8, 12), torch.float32, ("Shard(0)", "Shard(1)")),
    "uneven": ((7, 5), torch.bfloat16, ("Shard(0)", "Replicate()")),
    "hsdp": ((10, 4), torch.float32, ("Replicate()", "Shard(0)")),
    "tp_cols": ((6, 9), torch.bfloat16, ("Replicate()", "Shard(1)")),
    "replicated": ((5,), torch.int64, ("Replicate()", "Replicate()")),
}
SYNCS = 3


def full_tensors(k):
    """The whole model after step k, the same on every rank."""
    g = torch.Generator().manual_seed(100 + k)
    out = {}
    for name, (shape, dtype, _) in PLACEMENTS.items():
        if dtype == torch.int64:
            out[name] = torch.randint(0, 1000, shape, generator=g)
        else:
            out[name] = torch.randn(shape, generator=g).to(dtype)
    return out


def _placements(texts):
    from torch.distributed.tensor import Replicate, Shard  # noqa: F401
    return [eval(t) for t in texts]


def _trainer(rank, pg_file, stream, trainers, out):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    try:
        dist.init_process_group("gloo", init_method="file://" + pg_file, rank=rank, world_size=4)
        mesh = init_device_mesh("cpu", (2, 2))
        model = {n: (dtype_name(torch.empty(0, dtype=d)), list(s))
                 for n, (s, d, _) in PLACEMENTS.items()}
        group = ds.Group(stream, 0, 2, timeout_s=60) if rank == 0 else None
        with ds.StreamSender(group, trainers=ds.Group(trainers, rank, 4, timeout_s=60)) as tx:
            for k in range(SYNCS):
                full = full_tensors(k)
                shards = []
                for name, (_, _, texts) in PLACEMENTS.items():
                    dt = distribute_tensor(full[name], mesh, _placements(texts))
                    assert torch.equal(dt.full_tensor(), full[name]), name
                    spec = ds.ShardSpec.from_dtensor(name, dt)
                    shards.append((spec, dt.to_local().contiguous()))
                tx.sync_shards(model, shards)
        refused = []
        local = torch.zeros(4, 6)
        strided = DTensor.from_local(local, mesh, [_StridedShard(0, split_factor=2), Shard(0)],
                                     run_check=False, shape=torch.Size([16, 6]),
                                     stride=(6, 1))
        partial = DTensor.from_local(local, mesh, [Partial(), Shard(0)], run_check=False,
                                     shape=torch.Size([8, 6]), stride=(6, 1))
        for what, dt in (("strided", strided), ("partial", partial)):
            try:
                ds.ShardSpec.from_dtensor("w", dt)
                refused.append((what, None))
            except ds.UnsupportedError as e:
                refused.append((what, str(e)))
        out.put((rank, "ok", refused))
    except BaseException as e:  # reported by the test
        out.put((rank, "error", repr(e)))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_every_placement_of_a_real_dtensor_syncs_bit_exact(tmp_path):
    stream = "file:" + str(tmp_path / "stream")
    trainers = "file:" + str(tmp_path / "trainers")
    final = full_tensors(SYNCS - 1)
    got = {n: torch.zeros_like(t) for n, t in final.items()}
    errors = []

    def receive():
        try:
            with ds.StreamReceiver(ds.Group(stream, 1, 2, timeout_s=60)) as rx:
                rx.register_all(got)
                for _ in range(SYNCS):
                    rx.receive()
        except BaseException as e:  # reported by the test
            errors.append(e)

    rx = threading.Thread(target=receive)
    rx.start()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_trainer, args=(r, str(tmp_path / "pg"), stream, trainers, out))
             for r in range(4)]
    for p in procs:
        p.start()
    results = sorted(out.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(60)
    rx.join(60)
    assert not errors, errors
    for rank, state, detail in results:
        assert state == "ok", (rank, detail)
        refused = dict(detail)
        assert refused["strided"] is not None and "_StridedShard" in refused["strided"], refused
        assert refused["partial"] is not None and "Partial" in refused["partial"], refused
    for name, t in final.items():
        # Bit for bit (NaN payloads included).
        assert torch.equal(got[name].contiguous().view(torch.uint8),
                           t.contiguous().view(torch.uint8)), name
