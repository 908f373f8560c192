"""Sync rounds of one stream group, shared by the tests whose ranks are
processes (test_stream.py over a torch Gloo group, test_cuda.py over NCCL)."""

import torch

import deltasync as ds


def _bits(t):
    return t.contiguous().view(torch.uint8)


def run_rounds(group, rank, w, step, syncs, label="", device_frames=False):
    """Rank 0 syncs ``w`` ``syncs`` times, calling ``step(k)`` before sync k
    > 0 (and checks that only the first sync seeds); every other rank
    registers zeroed tensors like ``w``, makes the same steps on its own copy
    of ``w`` and checks after each sync that it holds exactly that. With
    ``device_frames``, every frame must be built and taken in device memory
    (but the records frame each receiver gets last, built on the host)."""
    if rank == 0:
        with ds.StreamSender(group) as tx:
            for k in range(syncs):
                if k:
                    step(k)
                stats = tx.sync(w)
                assert stats["seeded"] == (stats["receivers"] if k == 0 else 0), stats
                if device_frames:
                    assert stats["device_frames"] == stats["frames"] - stats["receivers"], stats
        return
    got = {n: torch.zeros_like(t) for n, t in w.items()}
    with ds.StreamReceiver(group) as rx:
        rx.register_all(got)
        for k in range(syncs):
            r = rx.receive()
            if device_frames:
                assert r["device_frames"] == r["frames"], r
            if k:
                step(k)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            for n, t in w.items():
                if not torch.equal(_bits(got[n]), _bits(t)):
                    raise AssertionError(f"{label}rank {rank} sync {k + 1}: {n} differs")
