"""The codecs and both transports on a real training delta chain
(tests/real_chain, written by examples/rl_loop.py on a GPU)."""

import json
import os
import subprocess
import threading

import pytest
import torch

import deltasync as ds
import st_io

CHAIN = os.path.join(os.path.dirname(__file__), "..", "..", "tests", "real_chain")
STEPS = [os.path.join(CHAIN, f"step_{i:06d}") for i in range(4)]


def load(i):
    return st_io.read(os.path.join(STEPS[i], "model.safetensors"))


def bits(t):
    return t.contiguous().view(torch.uint8)


def test_the_chain_changes_as_training_does(cli):
    for a, b in zip(STEPS, STEPS[1:]):
        d = json.loads(subprocess.run([cli, "diff", a, b, "--json"], check=True,
                                      capture_output=True, text=True).stdout)["total"]
        assert 0.005 < d["density"] < 0.10, d["density"]
        per = d["bytes_per_changed"]
        assert per["sparse"] < per["xor"] < per["indices"] == pytest.approx(6, abs=0.1)
        assert d["entropy_bytes_per_changed"] < per["sparse"]


@pytest.mark.parametrize("encoding", ds.encodings())
def test_every_encoding_round_trips_on_real_changes(encoding):
    for i in range(3):
        old, new = load(i), load(i + 1)
        for n in old:
            enc = ds.encode(new[n], old[n], encoding, name=n)
            target = old[n].clone()
            ds.decode_apply(enc, target, encoding, name=n)
            assert torch.equal(bits(target), bits(new[n])), (encoding, i, n)


def test_disk_and_stream_transports_on_the_real_chain(tmp_path, rendezvous, cli):
    pub = ds.Publisher(tmp_path / "store", base_path=STEPS[0])
    for i in (1, 2, 3):
        pub.publish(load(i))
    pub.close()
    subprocess.run([cli, "pull", "--store", str(tmp_path / "store"), "--local",
                    str(tmp_path / "local"), "--base", STEPS[0]], check=True,
                   capture_output=True)
    got = st_io.read(tmp_path / "local" / "model.safetensors")
    final = load(3)
    assert all(torch.equal(bits(got[n]), bits(final[n])) for n in final)

    held = {n: torch.zeros_like(t) for n, t in final.items()}
    errors = []

    def engine():
        try:
            with ds.StreamReceiver(ds.Group(rendezvous, 1, 2, timeout_s=30)) as rx:
                rx.register_all(held)
                for _ in range(4):
                    rx.receive()
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=engine)
    t.start()
    with ds.StreamSender(ds.Group(rendezvous, 0, 2, timeout_s=30), encoding="sparse") as tx:
        for i in range(4):
            stats = tx.sync(load(i))
            if i:
                assert 0 < stats["changed"] < 0.1 * sum(x.numel() for x in final.values())
    t.join()
    assert not errors, errors
    assert all(torch.equal(bits(held[n]), bits(final[n])) for n in final)
