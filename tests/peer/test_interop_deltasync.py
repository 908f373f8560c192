"""Interoperability of deltasync's disk transport with the Python peer.

Both directions, on a realistic synthetic chain (`deltasync synth`):
  - versions deltasync publishes with `xor` or `overwrite` are applied by the
    Python receiver's algorithm (vime_peer.py pull);
  - versions the Python publisher's algorithm writes are applied by
    `deltasync pull`;
  - a store mixing both publishers replays in either receiver.
Needs the deltasync binary: DELTASYNC_BIN (CTest sets it); skipped otherwise.
"""
import json
import os
import struct
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
PEER = os.path.join(HERE, "vime_peer.py")
BIN = os.environ.get("DELTASYNC_BIN", "")

pytestmark = pytest.mark.skipif(not (BIN and os.access(BIN, os.X_OK)),
                                reason="DELTASYNC_BIN not set to the deltasync binary")


def run(args, expect_ok=True):
    p = subprocess.run(args, capture_output=True, text=True, timeout=300)
    if expect_ok:
        assert p.returncode == 0, (args, p.stdout, p.stderr)
    return p


def ds(*args, **kw):
    return run([BIN, *args], **kw)


def peer(*args, **kw):
    return run([sys.executable, PEER, *args], **kw)


def tensors_of(ckpt):
    """{name: (dtype, shape, bytes)} of a checkpoint dir, read independently."""
    index = os.path.join(ckpt, "model.safetensors.index.json")
    if os.path.exists(index):
        files = sorted(set(json.load(open(index))["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    out = {}
    for fname in files:
        data = open(os.path.join(ckpt, fname), "rb").read()
        (n,) = struct.unpack_from("<Q", data, 0)
        header = json.loads(data[8:8 + n])
        header.pop("__metadata__", None)
        for name, e in header.items():
            b, end = e["data_offsets"]
            out[name] = (e["dtype"], e["shape"], data[8 + n + b:8 + n + end])
    return out


def state_version(local):
    return json.load(open(os.path.join(local, ".weight_sync", "state.json")))["version"]


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    d = tmp_path_factory.mktemp("chain")
    ds("synth", "--out", str(d), "--preset", "tiny", "--steps", "4", "--seed", "3")
    steps = [str(d / ("step_%06d" % i)) for i in range(5)]
    return steps


@pytest.mark.parametrize("encoding", ["xor", "overwrite"])
def test_python_receiver_applies_deltasync_versions(tmp_path, chain, encoding):
    store, local = str(tmp_path / "store"), str(tmp_path / "local")
    for i in range(1, 4):
        ds("publish", "--store", store, "--old", chain[i - 1], "--new", chain[i],
           "--encoding", encoding)
    out = json.loads(peer("pull", "--store", store, "--local", local, "--base", chain[0]).stdout)
    assert state_version(local) == "000003", out
    assert tensors_of(local) == tensors_of(chain[3])
    peer("verify", "--local", local, "--store", store)


@pytest.mark.parametrize("encoding", ["xor", "overwrite"])
def test_deltasync_applies_python_published_versions(tmp_path, chain, encoding):
    store, local = str(tmp_path / "store"), str(tmp_path / "local")
    for i in range(1, 4):
        peer("publish", "--store", store, "--old", chain[i - 1], "--new", chain[i],
             "--encoding", encoding)
    out = json.loads(ds("pull", "--store", store, "--local", local, "--base", chain[0],
                        "--json").stdout)
    assert out["version"] == 3 and out["versions_applied"] == [1, 2, 3]
    assert state_version(local) == "000003"
    assert tensors_of(local) == tensors_of(chain[3])
    ds("verify", "--local", local, "--store", store)


def test_mixed_publishers_replay_in_both_receivers(tmp_path, chain):
    store = str(tmp_path / "store")
    ds("publish", "--store", store, "--old", chain[0], "--new", chain[1], "--encoding", "xor")
    peer("publish", "--store", store, "--old", chain[1], "--new", chain[2],
         "--encoding", "overwrite")
    ds("publish", "--store", store, "--old", chain[2], "--new", chain[3],
       "--encoding", "overwrite", "--checksum", "adler32")
    peer("publish", "--store", store, "--old", chain[3], "--new", chain[4], "--encoding", "xor")
    ours, theirs = str(tmp_path / "ours"), str(tmp_path / "theirs")
    ds("pull", "--store", store, "--local", ours, "--base", chain[0])
    peer("pull", "--store", store, "--local", theirs, "--base", chain[0])
    want = tensors_of(chain[4])
    assert tensors_of(ours) == want
    assert tensors_of(theirs) == want
    assert state_version(ours) == state_version(theirs) == "000004"


def test_python_receiver_refuses_our_sparse_encoding_cleanly(tmp_path, chain):
    store, local = str(tmp_path / "store"), str(tmp_path / "local")
    ds("publish", "--store", store, "--old", chain[0], "--new", chain[1], "--encoding", "xor")
    ds("publish", "--store", store, "--old", chain[1], "--new", chain[2])  # sparse
    peer("pull", "--store", store, "--local", local, "--base", chain[0], "--target", "1")
    before = tensors_of(local)
    p = peer("pull", "--store", store, "--local", local, "--base", chain[0], expect_ok=False)
    assert p.returncode != 0 and "sparse" in p.stderr
    assert state_version(local) == "000001"
    assert tensors_of(local) == before


def test_deltasync_and_python_share_a_local_checkpoint(tmp_path, chain):
    # A host may run our agent next to the Python receiver: same lock, same
    # state file. Each continues from where the other left off.
    store, local = str(tmp_path / "store"), str(tmp_path / "local")
    for i in range(1, 5):
        ds("publish", "--store", store, "--old", chain[i - 1], "--new", chain[i],
           "--encoding", "xor" if i % 2 else "overwrite")
    peer("pull", "--store", store, "--local", local, "--base", chain[0], "--target", "2")
    ds("pull", "--store", store, "--local", local, "--base", chain[0], "--target", "3")
    assert tensors_of(local) == tensors_of(chain[3])
    peer("pull", "--store", store, "--local", local, "--base", chain[0])
    assert tensors_of(local) == tensors_of(chain[4])
    ds("verify", "--local", local, "--store", store)
