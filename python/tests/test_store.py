"""The disk transport from Python: publish from in-memory tensors, pull into a
local checkpoint, against the CLI's results on the same weights."""

import filecmp
import os
import subprocess

import pytest
import torch

import deltasync as ds
import st_io


def weights(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"a.weight": torch.randn(64, 48, generator=g).to(torch.bfloat16),
            "b.bias": torch.randn(300, generator=g),
            "c.idx": torch.arange(10, dtype=torch.int64)}


def step(w, k):
    out = {n: t.clone() for n, t in w.items()}
    out["a.weight"].view(-1)[k::97] += 1
    out["b.bias"][k] = float("nan")
    return out


def same_version(a, b):
    """Two version directories hold the same manifest and the same encoded
    tensors (how tensors are grouped into shard files follows the order the
    encoder's threads finish them, so it may differ between runs)."""
    assert (a / "deltasync.json").read_bytes() == (b / "deltasync.json").read_bytes()

    def encoded(d):
        out = {}
        for f in sorted(d.glob("model-*.safetensors")):
            for n, t in st_io.read(f).items():
                out[n] = (t.dtype, list(t.shape), t.contiguous().view(torch.uint8).numpy().tobytes())
        return out

    assert encoded(a) == encoded(b)


def test_publish_from_tensors_writes_what_the_cli_writes(tmp_path, cli):
    w0, w1 = weights(), None
    w1 = step(w0, 1)
    st_io.write(tmp_path / "v0.safetensors", w0)
    st_io.write(tmp_path / "v1.safetensors", w1)
    subprocess.run([cli, "publish", "--store", str(tmp_path / "cli"), "--old",
                    str(tmp_path / "v0.safetensors"), "--new", str(tmp_path / "v1.safetensors")],
                   check=True, capture_output=True)
    with ds.Publisher(tmp_path / "py", w0) as pub:
        r = pub.publish(w1)
        assert r["version"] == 1 and r["is_delta"] and r["tensors_changed"] == 2
        assert pub.latest_version == 1
    same_version(tmp_path / "cli" / "weight_v000001", tmp_path / "py" / "weight_v000001")


def test_a_prepared_publish_writes_what_the_tensors_write(tmp_path):
    w0 = weights()
    live = {n: t.clone() for n, t in w0.items()}
    prepared = ds.prepare(live)
    with ds.Publisher(tmp_path / "a", w0) as a, ds.Publisher(tmp_path / "b", w0) as b:
        for k in (1, 2):
            for n, t in step(live, k).items():
                live[n].copy_(t)
            ra, rb = a.publish(live), b.publish(prepared)
            assert rb["version"] == k and rb["changed_elements"] == ra["changed_elements"] > 0
            same_version(tmp_path / "a" / f"weight_v{k:06d}", tmp_path / "b" / f"weight_v{k:06d}")
        live["b.bias"].resize_(10)  # the same memory, fewer bytes
        with pytest.raises(ds.FailedPreconditionError, match="tensor 'b.bias': its memory changed"):
            b.publish(prepared)
        assert b.latest_version == 2


def test_pull_brings_a_local_checkpoint_to_every_version(tmp_path, cli):
    w = weights(1)
    (tmp_path / "base").mkdir()
    st_io.write(tmp_path / "base" / "model.safetensors", w)
    pub = ds.Publisher(tmp_path / "store", base_path=tmp_path / "base")
    history = [w]
    for k in range(3):
        history.append(step(history[-1], k))
        pub.publish(history[-1])
    pub.publish(history[-1], full=True)
    history.append(history[-1])
    vs = ds.versions(tmp_path / "store")
    assert [v["version"] for v in vs] == [1, 2, 3, 4]
    assert [v["is_delta"] for v in vs] == [True, True, True, False]
    local = tmp_path / "local"
    with ds.LocalCheckpoint(local, tmp_path / "store", tmp_path / "base") as lc:
        assert lc.current_version() is None
        r = lc.pull(2)
        assert r["version"] == 2 and r["versions_applied"] == [1, 2]
        lc.verify()
        got = st_io.read(local / "model.safetensors")
        for n, t in history[2].items():
            assert torch.equal(got[n].view(torch.uint8), t.contiguous().view(torch.uint8)), n
        r = lc.pull()
        assert r["version"] == 4 and lc.current_version() == 4
    # The CLI reads what Python published, and lands on the same bytes.
    subprocess.run([cli, "pull", "--store", str(tmp_path / "store"), "--local",
                    str(tmp_path / "cli_local"), "--base", str(tmp_path / "base"),
                    "-t", "3"], check=True, capture_output=True)
    with ds.LocalCheckpoint(tmp_path / "py3", tmp_path / "store",
                            tmp_path / "base") as lc:
        lc.pull(3)
    for f in os.listdir(tmp_path / "cli_local"):
        if f.endswith(".safetensors"):
            assert filecmp.cmp(tmp_path / "cli_local" / f, tmp_path / "py3" / f, shallow=False)
    removed = ds.prune(tmp_path / "store", 1)
    assert removed and all(v < 4 for v in removed)


def test_verify_finds_a_corrupted_local_checkpoint(tmp_path):
    w = weights(2)
    (tmp_path / "base").mkdir()
    st_io.write(tmp_path / "base" / "model.safetensors", w)
    with ds.Publisher(tmp_path / "store", base_path=tmp_path / "base") as pub:
        pub.publish(step(w, 0))
    lc = ds.LocalCheckpoint(tmp_path / "local", tmp_path / "store", tmp_path / "base")
    lc.pull()
    f = next((tmp_path / "local").glob("*.safetensors"))
    data = bytearray(f.read_bytes())
    data[-3] ^= 0x40
    f.write_bytes(bytes(data))
    with pytest.raises(ds.CorruptionError):
        lc.verify()
    lc.close()
    with pytest.raises(ds.FailedPreconditionError, match="LocalCheckpoint is closed"):
        lc.pull()


def test_bad_input_publishes_nothing(tmp_path):
    w = weights(3)
    pub = ds.Publisher(tmp_path / "store", w)
    missing = {n: t for n, t in w.items() if n != "c.idx"}
    with pytest.raises(ds.InvalidArgumentError, match="c.idx"):
        pub.publish(missing)
    wrong = dict(w, **{"b.bias": torch.zeros(301)})
    with pytest.raises(ds.InvalidArgumentError, match="b.bias"):
        pub.publish(wrong)
    wrong_dtype = dict(w, **{"b.bias": torch.zeros(300, dtype=torch.float64)})
    with pytest.raises(ds.InvalidArgumentError, match="b.bias"):
        pub.publish(wrong_dtype)
    with pytest.raises(ds.InvalidArgumentError, match="'a.weight': not contiguous"):
        pub.publish(dict(w, **{"a.weight": w["a.weight"].t()}))
    with pytest.raises(ds.InvalidArgumentError, match="named twice"):
        pub.publish([("a.weight", w["a.weight"]), ("a.weight", w["a.weight"])])
    assert ds.versions(tmp_path / "store") == [] and pub.latest_version == 0
    pub.publish(step(w, 2))
    assert pub.latest_version == 1
    pub.close()
    pub.close()
    with pytest.raises(ds.FailedPreconditionError, match="Publisher is closed"):
        pub.publish(w)
    with pytest.raises(ds.InvalidArgumentError, match="exactly one"):
        ds.Publisher(tmp_path / "s2")
    with pytest.raises(ds.NotFoundError):
        ds.LocalCheckpoint(tmp_path / "l", tmp_path / "nope", tmp_path / "nope.safetensors").pull()


def test_parameters_that_require_grad_publish_without_copies(tmp_path):
    model = torch.nn.Linear(8, 4)
    with ds.Publisher(tmp_path / "store", model.named_parameters()) as pub:
        with torch.no_grad():
            model.weight[0, 0] += 1
        r = pub.publish(model.named_parameters())
        assert r["changed_elements"] == 1
