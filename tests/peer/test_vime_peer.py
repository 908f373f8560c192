"""Tests of the Python disk-transport peer (vime_peer.py).

Checkpoints are built here by hand (safetensors written byte by byte), and the
published files are checked with this file's own reader and the zstandard and
xxhash modules directly, so the peer's format is checked against the layout
docs/format.md describes rather than against itself.
"""
import fcntl
import glob
import json
import os
import shutil
import struct
import subprocess
import sys
import time
import zlib

import numpy as np
import pytest
import xxhash
import zstandard

HERE = os.path.dirname(os.path.abspath(__file__))
PEER = os.path.join(HERE, "vime_peer.py")
sys.path.insert(0, HERE)
import vime_peer  # noqa: E402

# BLAKE3("abc"), from the BLAKE3 specification's test vectors.
BLAKE3_ABC = "6437b3ac38465133ffb63b75273a8db548c558465d79db03fd359c6cd5bd9d85"


# --- building checkpoints by hand -------------------------------------------

def write_safetensors(path, tensors, metadata=None):
    """tensors: list of (name, dtype, shape, numpy array) in data order."""
    header = {}
    if metadata:
        header["__metadata__"] = metadata
    offset = 0
    for name, dtype, shape, arr in tensors:
        n = arr.nbytes
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * ((-(8 + len(raw))) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for _, _, _, arr in tensors:
            f.write(np.ascontiguousarray(arr).tobytes())


def write_checkpoint(directory, tensors, shards=None):
    """shards=None: model.safetensors; else a list of name lists, one per shard."""
    os.makedirs(directory, exist_ok=True)
    by_name = {t[0]: t for t in tensors}
    if shards is None:
        write_safetensors(os.path.join(directory, "model.safetensors"), tensors)
        return
    weight_map = {}
    for i, names in enumerate(shards):
        fname = "model-%05d-of-%05d.safetensors" % (i + 1, len(shards))
        write_safetensors(os.path.join(directory, fname), [by_name[n] for n in names])
        weight_map.update({n: fname for n in names})
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": sum(t[3].nbytes for t in tensors)},
                   "weight_map": weight_map}, f, indent=2)
    with open(os.path.join(directory, "config.json"), "w") as f:
        f.write('{"model_type": "toy"}\n')


def read_safetensors(path):
    """-> (metadata, {name: (dtype, shape, bytes)}); independent of the peer."""
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack_from("<Q", data, 0)
    header = json.loads(data[8:8 + n])
    meta = header.pop("__metadata__", {})
    base = 8 + n
    return meta, {k: (v["dtype"], v["shape"], data[base + v["data_offsets"][0]:
                                                  base + v["data_offsets"][1]])
                  for k, v in header.items()}


def read_checkpoint(directory):
    """-> {name: bytes} over all files of a checkpoint directory."""
    index = os.path.join(directory, "model.safetensors.index.json")
    files = (sorted(set(json.load(open(index))["weight_map"].values()))
             if os.path.exists(index) else ["model.safetensors"])
    out = {}
    for fname in files:
        _, tensors = read_safetensors(os.path.join(directory, fname))
        out.update({k: v[2] for k, v in tensors.items()})
    return out


def bf16_bits(values):
    """float32 -> BF16 bit patterns (uint16) by round-to-nearest-even."""
    u = np.asarray(values, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def make_chain(root, steps=3, shards=None, seed=0):
    """Base checkpoint plus `steps` later states; each step changes some BF16
    elements of two tensors; 'norm' (F32) changes at step 2 only (-0.0 and NaN)."""
    rng = np.random.default_rng(seed)
    w = bf16_bits(rng.standard_normal((32, 48)) * 0.02).reshape(32, 48)
    e = bf16_bits(rng.standard_normal((16, 40)) * 0.02).reshape(16, 40)
    norm = np.ones(40, dtype=np.float32)
    states = []
    for step in range(steps + 1):
        if step:
            w = w.copy()
            e = e.copy()
            mask = rng.random(w.shape) < 0.05
            w[mask] ^= rng.integers(1, 4, size=int(mask.sum()), dtype=np.uint16)
            e[rng.integers(0, 16), :] += 1
            if step == 2:
                norm = norm.copy()
                norm[3] = -0.0
                norm[7] = np.float32("nan")
        tensors = [("model.layers.0.w", "BF16", w.shape, w),
                   ("model.embed.weight", "BF16", e.shape, e),
                   ("model.norm.weight", "F32", norm.shape, norm)]
        d = os.path.join(root, "step%d" % step)
        write_checkpoint(d, tensors, shards)
        states.append(d)
    return states


def run_peer(capsys, *argv):
    """In-process run: (exit code, parsed JSON summary or None, stderr)."""
    rc = vime_peer.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, (json.loads(out) if out.strip() else None), err


def state_of(local):
    path = os.path.join(local, ".weight_sync", "state.json")
    return json.load(open(path)) if os.path.exists(path) else None


def snapshot(local):
    return {f: open(os.path.join(local, f), "rb").read()
            for f in sorted(os.listdir(local)) if os.path.isfile(os.path.join(local, f))}


def publish_chain(capsys, store, states, encodings=("xor",), checksum="xxh3-128", extra=()):
    for i in range(1, len(states)):
        rc, summary, err = run_peer(capsys, "publish", "--store", store, "--old", states[i - 1],
                                    "--new", states[i], "--encoding",
                                    encodings[(i - 1) % len(encodings)], "--checksum", checksum,
                                    *extra)
        assert rc == 0, err
        assert summary["version"] == "%06d" % i


# --- format of what the publisher writes --------------------------------------

@pytest.mark.parametrize("encoding", ["xor", "overwrite"])
def test_published_version_matches_the_disk_format(tmp_path, capsys, encoding):
    old, new = make_chain(str(tmp_path), steps=1)
    store = str(tmp_path / "store")
    rc, summary, err = run_peer(capsys, "publish", "--store", store, "--old", old, "--new", new,
                                "--encoding", encoding, "--threads", 3)
    assert rc == 0, err
    assert summary["tensors_changed"] == 2 and summary["tensors_total"] == 3
    vdir = os.path.join(store, "weight_v000001")
    assert sorted(os.listdir(vdir)) == ["model-00001-of-00001.safetensors",
                                        "model.safetensors.index.json"]
    index = json.load(open(os.path.join(vdir, "model.safetensors.index.json")))
    meta = index["metadata"]
    assert {k: meta[k] for k in ("version", "base_version", "delta_encoding",
                                 "compression_format", "checksum_format")} == {
        "version": "000001", "base_version": "000000", "delta_encoding": encoding,
        "compression_format": "zstd", "checksum_format": "xxh3-128"}
    # unchanged tensors are absent
    assert sorted(index["weight_map"]) == ["model.embed.weight", "model.layers.0.w"]
    shard_meta, shard = read_safetensors(os.path.join(vdir, "model-00001-of-00001.safetensors"))
    assert sorted(shard) == sorted(index["weight_map"])
    old_t, new_t = read_checkpoint(old), read_checkpoint(new)
    for name, (dtype, shape, frame) in shard.items():
        assert dtype == "U8" and shape == [len(frame)]
        assert frame[:4] == b"\x28\xb5\x2f\xfd"
        content = zstandard.ZstdDecompressor().decompress(frame)
        o = np.frombuffer(old_t[name], np.uint8)
        n = np.frombuffer(new_t[name], np.uint8)
        if encoding == "xor":
            assert content == (o ^ n).tobytes()
        else:
            (k,) = struct.unpack_from("<I", content)
            assert len(content) == 4 + 5 * k
            pos = np.frombuffer(content, "<u4", k, 4)
            vals = np.frombuffer(content, np.uint8, k, 4 + 4 * k)
            assert np.array_equal(pos, np.flatnonzero(o != n))
            assert np.array_equal(vals, n[pos])
        assert shard_meta[name] == xxhash.xxh3_128(new_t[name]).hexdigest()
        assert len(shard_meta[name]) == 32


def test_publisher_shards_by_size_and_numbers_versions(tmp_path, capsys):
    states = make_chain(str(tmp_path), steps=2)
    store = str(tmp_path / "store")
    publish_chain(capsys, store, states, extra=("--max-shard-bytes", 1))
    vdir = os.path.join(store, "weight_v000002")
    index = json.load(open(os.path.join(vdir, "model.safetensors.index.json")))
    assert index["metadata"]["base_version"] == "000001"
    files = sorted(set(index["weight_map"].values()))
    assert files == ["model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors",
                     "model-00003-of-00003.safetensors"]
    for fname in files:
        meta, tensors = read_safetensors(os.path.join(vdir, fname))
        assert len(tensors) == 1 and set(meta) == set(tensors)


def test_unchanged_checkpoint_publishes_an_empty_delta(tmp_path, capsys):
    (base,) = make_chain(str(tmp_path), steps=0)
    store, local = str(tmp_path / "store"), str(tmp_path / "local")
    rc, summary, err = run_peer(capsys, "publish", "--store", store, "--old", base, "--new", base)
    assert rc == 0, err
    assert summary["tensors_changed"] == 0
    index = json.load(open(os.path.join(store, "weight_v000001", "model.safetensors.index.json")))
    assert index["weight_map"] == {}
    rc, summary, err = run_peer(capsys, "pull", "--store", store, "--local", local, "--base", base)
    assert rc == 0, err
    assert state_of(local) == {"version": "000001"}
    assert read_checkpoint(local) == read_checkpoint(base)


# --- pull --------------------------------------------------------------------

@pytest.mark.parametrize("encodings,shards", [
    (("xor",), None),
    (("overwrite",), None),
    (("xor", "overwrite"), [["model.layers.0.w"], ["model.embed.weight", "model.norm.weight"]]),
])
def test_pull_reproduces_new_bit_exactly(tmp_path, capsys, encodings, shards):
    states = make_chain(str(tmp_path), steps=3, shards=shards)
    store, local = str(tmp_path / "store"), str(tmp_path / "local")
    publish_chain(capsys, store, states, encodings)
    rc, summary, err = run_peer(capsys, "pull", "--store", store, "--local", local,
                                "--base", states[0], "--threads", 4)
    assert rc == 0, err
    assert summary["materialized_base"] is True
    assert summary["versions_applied"] == ["000001", "000002", "000003"]
    assert state_of(local) == {"version": "000003"}
    assert read_checkpoint(local) == read_checkpoint(states[3])
    # same layout on both sides, so whole files match too
    for fname in os.listdir(states[3]):
        assert open(os.path.join(local, fname), "rb").read() == \
            open(os.path.join(states[3], fname), "rb").read()


def test_pull_step_by_step_and_noop(tmp_path, capsys):
    states = make_chain(str(tmp_path), steps=3)
    store, local = str(tmp_path / "store"), str(tmp_path / "local")
    rc, summary, err = run_peer(capsys, "pull", "--store", store, "--local", local,
                                "--base", states[0])
    assert rc == 0, err  # empty store: the base becomes version 0
    assert summary["materialized_base"] and summary["versions_applied"] == []
    assert state_of(local) == {"version": "000000"}
    assert read_checkpoint(local) == read_checkpoint(states[0])
    publish_chain(capsys, store, states)
    for target in (1, 2, 3):
        rc, summary, err = run_peer(capsys, "pull", "--store", store, "--local", local,
                                    "--base", states[0], "--target", target)
        assert rc == 0, err
        assert summary["versions_applied"] == ["%06d" % target]
        assert read_checkpoint(local) == read_checkpoint(states[target])
    rc, summary, err = run_peer(capsys, "pull", "--store", store, "--local", local,
                                "--base", states[0], "--target", "latest")
    assert rc == 0, err
    assert summary["versions_applied"] == [] and summary["materialized_base"] is False
    assert read_checkpoint(local) == read_checkpoint(states[3])


def test_full_version_resets_the_chain(tmp_path, capsys):
    states = make_chain(str(tmp_path), steps=4,
                        shards=[["model.layers.0.w", "model.norm.weight"], ["model.embed.weight"]])
    store = str(tmp_path / "store")
    publish_chain(capsys, store, states[:3])  # v1, v2 deltas
    rc, _, err = run_peer(capsys, "publish", "--store", store, "--new", states[3], "--full")
    assert rc == 0, err
    assert os.path.exists(os.path.join(store, "weight_v000003", "config.json"))
    rc, _, err = run_peer(capsys, "publish", "--store", store, "--old", states[3],
                          "--new", states[4])
    assert rc == 0, err
    # a fresh host seeds from the full version, never touching v1, v2
    shutil.rmtree(os.path.join(store, "weight_v000001"))
    fresh = str(tmp_path / "fresh")
    rc, summary, err = run_peer(capsys, "pull", "--store", store, "--local", fresh,
                                "--base", states[0])
    assert rc == 0, err
    assert summary["reset_to_full"] == "000003" and summary["versions_applied"] == ["000004"]
    assert read_checkpoint(fresh) == read_checkpoint(states[4])
    assert state_of(fresh) == {"version": "000004"}


def test_full_version_replaces_a_differently_laid_out_local(tmp_path, capsys):
    single = make_chain(str(tmp_path / "a"), steps=1)
    sharded = make_chain(str(tmp_path / "b"), steps=1, seed=5,
                         shards=[["model.layers.0.w"], ["model.embed.weight", "model.norm.weight"]])
    store, local = str(tmp_path / "store"), str(tmp_path / "local")
    publish_chain(capsys, store, single)
    rc, _, err = run_peer(capsys, "pull", "--store", store, "--local", local, "--base", single[0])
    assert rc == 0, err
    rc, _, err = run_peer(capsys, "publish", "--store", store, "--new", sharded[1], "--full")
    assert rc == 0, err
    rc, summary, err = run_peer(capsys, "pull", "--store", store, "--local", local,
                                "--base", single[0])
    assert rc == 0, err
    assert summary["reset_to_full"] == "000002"
    assert not os.path.exists(os.path.join(local, "model.safetensors"))  # stale file gone
    assert read_checkpoint(local) == read_checkpoint(sharded[1])


def test_adler32_checksums(tmp_path, capsys):
    states = make_chain(str(tmp_path), steps=1)
    store, local = str(tmp_path / "store"), str(tmp_path / "local")
    publish_chain(capsys, store, states, checksum="adler32")
    meta, _ = read_safetensors(os.path.join(store, "weight_v000001",
                                            "model-00001-of-00001.safetensors"))
    new_t = read_checkpoint(states[1])
    for name, digest in meta.items():
        assert digest == "%08x" % zlib.adler32(new_t[name])
    rc, _, err = run_peer(capsys, "pull", "--store", store, "--local", local, "--base", states[0])
    assert rc == 0, err
    assert read_checkpoint(local) == read_checkpoint(states[1])


def find_deltasync_bin():
    if os.environ.get("DELTASYNC_BIN"):
        return os.environ["DELTASYNC_BIN"]
    for path in sorted(glob.glob(os.path.join(HERE, "..", "..", "build", "*", "deltasync"))):
        if os.access(path, os.X_OK) and os.path.isfile(path):
            return path
    return None


def test_blake3_without_the_binary_is_unsupported(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("DELTASYNC_BIN", raising=False)
    states = make_chain(str(tmp_path), steps=1)
    store = str(tmp_path / "store")
    rc = vime_peer.main(["publish", "--store", store, "--old", states[0], "--new", states[1],
                         "--checksum", "blake3"])
    err = capsys.readouterr().err
    assert rc == 5
    assert "blake3" in err and "--deltasync-bin" in err
    assert not os.path.exists(os.path.join(store, "weight_v000001"))


def test_blake3_through_the_cli(tmp_path, capsys):
    binary = find_deltasync_bin()
    if binary is None:
        pytest.skip("no deltasync binary (set DELTASYNC_BIN)")
    old, new = str(tmp_path / "old"), str(tmp_path / "new")
    abc = np.frombuffer(b"abc", np.uint8)
    write_checkpoint(old, [("t", "U8", [3], np.zeros(3, np.uint8))])
    write_checkpoint(new, [("t", "U8", [3], abc)])
    store, local = str(tmp_path / "store"), str(tmp_path / "local")
    rc, _, err = run_peer(capsys, "publish", "--store", store, "--old", old, "--new", new,
                          "--checksum", "blake3", "--deltasync-bin", binary)
    assert rc == 0, err
    meta, _ = read_safetensors(os.path.join(store, "weight_v000001",
                                            "model-00001-of-00001.safetensors"))
    assert meta == {"t": BLAKE3_ABC}
    rc, _, err = run_peer(capsys, "pull", "--store", store, "--local", local, "--base", old,
                          "--deltasync-bin", binary)
    assert rc == 0, err
    assert read_checkpoint(local) == {"t": b"abc"}


# --- refusals: clear error, state and local bytes unchanged -------------------

def setup_at_v1(tmp_path, capsys, v2_encoding="overwrite"):
    """Store with v1..v3 (xor, v2_encoding, xor) and a local checkpoint at v1."""
    states = make_chain(str(tmp_path), steps=3)
    store, local = str(tmp_path / "store"), str(tmp_path / "local")
    publish_chain(capsys, store, states, ("xor", v2_encoding))
    rc, _, err = run_peer(capsys, "pull", "--store", store, "--local", local,
                          "--base", states[0], "--target", 1)
    assert rc == 0, err
    return states, store, local


@pytest.fixture
def pulled_to_v1(tmp_path, capsys):
    return setup_at_v1(tmp_path, capsys)


def shard_path(store, v):
    return os.path.join(store, "weight_v%06d" % v, "model-00001-of-00001.safetensors")


def assert_refused(capsys, states, store, local, code, *needles, target="latest"):
    before = snapshot(local)
    rc, summary, err = run_peer(capsys, "pull", "--store", store, "--local", local,
                                "--base", states[0], "--target", target)
    assert rc == code, err
    assert summary is None
    assert err.startswith("vime_peer: error: ") and err.count("\n") == 1
    for needle in needles:
        assert needle in err
    assert state_of(local) == {"version": "000001"}
    assert snapshot(local) == before


def corrupt_frame_byte(path, name, offset_in_frame):
    meta, tensors = read_safetensors(path)
    data = bytearray(open(path, "rb").read())
    (n,) = struct.unpack_from("<Q", data)
    header = json.loads(data[8:8 + n])
    begin = 8 + n + header[name]["data_offsets"][0]
    data[begin + offset_in_frame] ^= 0xFF
    open(path, "wb").write(bytes(data))


@pytest.mark.parametrize("encoding", ["xor", "overwrite"])
def test_corrupt_frame_is_refused(tmp_path, capsys, encoding):
    states, store, local = setup_at_v1(tmp_path, capsys, encoding)
    path = shard_path(store, 2)
    _, tensors = read_safetensors(path)
    name = sorted(tensors)[0]
    corrupt_frame_byte(path, name, len(tensors[name][2]) // 2)
    assert_refused(capsys, states, store, local, 3, "version 000002")


def test_trailing_bytes_after_frame_are_refused(pulled_to_v1, capsys):
    states, store, local = pulled_to_v1
    path = shard_path(store, 2)
    meta, tensors = read_safetensors(path)
    rewritten = [(n, "U8", [len(b) + 3], np.frombuffer(b + b"xyz", np.uint8))
                 for n, (_, _, b) in sorted(tensors.items())]
    write_safetensors(path, rewritten, meta)
    assert_refused(capsys, states, store, local, 3, "3 bytes follow the zstd frame")


def test_wrong_base_is_refused(pulled_to_v1, capsys):
    states, store, local = pulled_to_v1
    index_path = os.path.join(store, "weight_v000002", "model.safetensors.index.json")
    index = json.load(open(index_path))
    index["metadata"]["base_version"] = "000000"
    json.dump(index, open(index_path, "w"))
    assert_refused(capsys, states, store, local, 4, "base_version 000000")


def test_missing_version_is_refused(pulled_to_v1, capsys):
    states, store, local = pulled_to_v1
    shutil.rmtree(os.path.join(store, "weight_v000002"))
    assert_refused(capsys, states, store, local, 4, "version 000002 is missing")


def test_unknown_target_is_refused(pulled_to_v1, capsys):
    states, store, local = pulled_to_v1
    assert_refused(capsys, states, store, local, 4, "000009", target=9)


def test_local_ahead_of_target_is_refused(pulled_to_v1, capsys):
    states, store, local = pulled_to_v1
    shutil.rmtree(os.path.join(store, "weight_v000001"))  # no full version to reset to
    assert_refused(capsys, states, store, local, 4, "newer than the target", target=0)


def test_unknown_encoding_is_unsupported(pulled_to_v1, capsys):
    states, store, local = pulled_to_v1
    index_path = os.path.join(store, "weight_v000002", "model.safetensors.index.json")
    index = json.load(open(index_path))
    index["metadata"]["delta_encoding"] = "sparse"
    json.dump(index, open(index_path, "w"))
    assert_refused(capsys, states, store, local, 5, "'sparse'")


@pytest.mark.parametrize("version", [2, 3])
def test_checksum_mismatch_is_refused_and_rolled_back(tmp_path, capsys, version):
    # v2 (overwrite) or v3 (xor) carries a wrong digest for one tensor, found
    # only after that tensor's bytes changed: they must be put back.
    states = make_chain(str(tmp_path), steps=3)
    store, local = str(tmp_path / "store"), str(tmp_path / "local")
    publish_chain(capsys, store, states, ("xor", "overwrite", "xor"))
    rc, _, err = run_peer(capsys, "pull", "--store", store, "--local", local,
                          "--base", states[0], "--target", version - 1)
    assert rc == 0, err
    path = shard_path(store, version)
    meta, tensors = read_safetensors(path)
    name = sorted(tensors)[-1]
    meta[name] = "0" * len(meta[name])
    write_safetensors(path, [(n, "U8", [len(b)], np.frombuffer(b, np.uint8))
                             for n, (_, _, b) in sorted(tensors.items())], meta)
    before = snapshot(local)
    rc, summary, err = run_peer(capsys, "pull", "--store", store, "--local", local,
                                "--base", states[0])
    assert rc == 3 and summary is None
    assert "checksum mismatch" in err and repr(name) in err
    assert state_of(local) == {"version": "%06d" % (version - 1)}
    assert snapshot(local) == before


def test_wrong_local_bytes_fail_the_checksum(tmp_path, capsys):
    # state says v1 but a tensor's bytes are not v1's: v2 (xor) applies, digests differ
    states, store, local = setup_at_v1(tmp_path, capsys, "xor")
    path = os.path.join(local, "model.safetensors")
    data = bytearray(open(path, "rb").read())
    (n,) = struct.unpack_from("<Q", data)
    header = json.loads(data[8:8 + n])
    data[8 + n + header["model.layers.0.w"]["data_offsets"][0] + 10] ^= 0x01
    open(path, "wb").write(bytes(data))
    assert_refused(capsys, states, store, local, 3, "checksum mismatch", "model.layers.0.w")


def test_corrupt_state_file_is_an_error(pulled_to_v1, capsys):
    states, store, local = pulled_to_v1
    with open(os.path.join(local, ".weight_sync", "state.json"), "w") as f:
        f.write('{"version": 7}')
    rc, _, err = run_peer(capsys, "pull", "--store", store, "--local", local, "--base", states[0])
    assert rc == 3 and "6-digit" in err


def test_overwrite_delta_is_idempotent_at_the_byte_level(pulled_to_v1, capsys):
    # the property the overwrite encoding exists for: applying its content twice
    # leaves the same bytes (checked with this file's own decoder)
    states, store, local = pulled_to_v1
    _, tensors = read_safetensors(shard_path(store, 2))
    v1 = read_checkpoint(states[1])
    for name, (_, _, frame) in tensors.items():
        content = zstandard.ZstdDecompressor().decompress(frame)
        (k,) = struct.unpack_from("<I", content)
        pos = np.frombuffer(content, "<u4", k, 4)
        vals = np.frombuffer(content, np.uint8, k, 4 + 4 * k)
        t = np.frombuffer(v1[name], np.uint8).copy()
        t[pos] = vals
        once = t.copy()
        t[pos] = vals
        assert np.array_equal(t, once)
        assert once.tobytes() == read_checkpoint(states[2])[name]


# --- verify ------------------------------------------------------------------

def test_verify(pulled_to_v1, capsys):
    states, store, local = pulled_to_v1
    rc, summary, err = run_peer(capsys, "verify", "--local", local, "--store", store)
    assert rc == 0, err
    assert summary["version"] == "000001" and summary["tensors_verified"] == 2
    path = os.path.join(local, "model.safetensors")
    data = bytearray(open(path, "rb").read())
    (n,) = struct.unpack_from("<Q", data)
    header = json.loads(data[8:8 + n])
    data[8 + n + header["model.embed.weight"]["data_offsets"][0]] ^= 0x80
    open(path, "wb").write(bytes(data))
    rc, summary, err = run_peer(capsys, "verify", "--local", local, "--store", store)
    assert rc == 3 and "model.embed.weight" in err


# --- the CLI as a driver sees it -------------------------------------------------

def test_cli_exit_codes_json_and_lock(tmp_path, capsys):
    states = make_chain(str(tmp_path), steps=1)
    store, local = str(tmp_path / "store"), str(tmp_path / "local")
    proc = subprocess.run([sys.executable, PEER, "publish", "--store", store, "--old", states[0],
                           "--new", states[1]], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["tensors_changed"] == 2
    # a pull waits for another process's flock on <local>/.weight_sync/lock
    os.makedirs(os.path.join(local, ".weight_sync"))
    fd = os.open(os.path.join(local, ".weight_sync", "lock"), os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        pull = subprocess.Popen([sys.executable, PEER, "pull", "--store", store, "--local", local,
                                 "--base", states[0]], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        time.sleep(0.5)
        assert pull.poll() is None
        assert state_of(local) is None
    finally:
        os.close(fd)
    out, err = pull.communicate(timeout=30)
    assert pull.returncode == 0, err
    assert json.loads(out)["versions_applied"] == ["000001"]
    assert read_checkpoint(local) == read_checkpoint(states[1])
    proc = subprocess.run([sys.executable, PEER, "pull", "--store", store, "--local", local,
                           "--base", states[0], "--target", "5"], capture_output=True, text=True)
    assert proc.returncode == 4 and proc.stdout == ""
    assert proc.stderr.startswith("vime_peer: error: version 000005 is not in the store")
    proc = subprocess.run([sys.executable, PEER, "pull", "--store", store],
                          capture_output=True, text=True)
    assert proc.returncode == 2
