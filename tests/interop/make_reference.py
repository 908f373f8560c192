#!/usr/bin/env python3
"""Interop between deltasync and the reference Python `safetensors` library.

  make_reference.py make OUTDIR    write manifest.json's fixtures with the
                                   Python library (safetensors + torch, and
                                   huggingface_hub for the sharded checkpoint)
  make_reference.py check DIR      load files that deltasync wrote into DIR
                                   with the Python library and verify every
                                   tensor, shape, dtype and metadata entry

Needs torch, safetensors and huggingface_hub (none are Debian packages), so it
runs where those are installed; its output is committed with the fixtures.
"""
import json
import os
import sys
import zlib

import torch
import safetensors
from safetensors import safe_open
from safetensors.torch import save_file

HERE = os.path.dirname(os.path.abspath(__file__))
MANIFEST = json.load(open(os.path.join(HERE, "manifest.json")))

TORCH_DTYPES = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "I16": torch.int16, "U16": torch.uint16, "F16": torch.float16,
    "BF16": torch.bfloat16, "I32": torch.int32, "U32": torch.uint32,
    "F32": torch.float32, "I64": torch.int64, "U64": torch.uint64,
    "F64": torch.float64,
}
SIZES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2,
         "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}


def expected_bytes(spec):
    n = SIZES[spec["dtype"]]
    for d in spec["shape"]:
        n *= d
    data = bytes((i * spec["mul"] + spec["add"]) % 256 for i in range(n))
    if spec["dtype"] == "BOOL":
        data = bytes(b % 2 for b in data)
    return data


def make_tensor(spec):
    data = bytearray(expected_bytes(spec))
    dtype = TORCH_DTYPES[spec["dtype"]]
    if len(data) == 0:
        return torch.empty(spec["shape"], dtype=dtype)
    return torch.frombuffer(data, dtype=dtype).reshape(spec["shape"]).clone()


def tensor_bytes(t):
    t = t.contiguous()
    if t.numel() == 0:
        return b""
    return t.view(-1).view(torch.uint8).numpy().tobytes()


def make(outdir):
    os.makedirs(outdir, exist_ok=True)
    for f in MANIFEST["files"]:
        tensors = {s["name"]: make_tensor(s) for s in f["tensors"]}
        save_file(tensors, os.path.join(outdir, f["file"]), metadata=f["metadata"] or None)
    from huggingface_hub import save_torch_state_dict
    for c in MANIFEST["checkpoints"]:
        tensors = {s["name"]: make_tensor(s) for s in c["tensors"]}
        os.makedirs(os.path.join(outdir, c["dir"]), exist_ok=True)
        save_torch_state_dict(tensors, os.path.join(outdir, c["dir"]),
                              max_shard_size=c["max_shard_bytes"], safe_serialization=True)
    print(f"wrote reference fixtures with safetensors {safetensors.__version__}, "
          f"torch {torch.__version__}")


def check_tensor(f, spec, where):
    t = f.get_tensor(spec["name"])
    assert str(t.dtype) == str(TORCH_DTYPES[spec["dtype"]]), (where, spec["name"], t.dtype)
    assert list(t.shape) == spec["shape"], (where, spec["name"], t.shape)
    got = tensor_bytes(t)
    want = expected_bytes(spec)
    assert got == want, (where, spec["name"], "bytes differ")
    return zlib.adler32(got)


def check(d):
    checked = 0
    for fspec in MANIFEST["files"]:
        path = os.path.join(d, fspec["file"])
        with safe_open(path, framework="pt") as f:
            assert sorted(f.keys()) == sorted(s["name"] for s in fspec["tensors"]), path
            assert (f.metadata() or {}) == fspec["metadata"], (path, f.metadata())
            for s in fspec["tensors"]:
                check_tensor(f, s, path)
                checked += 1
    for c in MANIFEST["checkpoints"]:
        cdir = os.path.join(d, c["dir"])
        index = json.load(open(os.path.join(cdir, "model.safetensors.index.json")))
        wm = index["weight_map"]
        assert sorted(wm) == sorted(s["name"] for s in c["tensors"]), cdir
        total = 0
        for s in c["tensors"]:
            with safe_open(os.path.join(cdir, wm[s["name"]]), framework="pt") as f:
                check_tensor(f, s, cdir)
                total += len(expected_bytes(s))
                checked += 1
        assert int(index["metadata"]["total_size"]) == total, (cdir, index["metadata"])
    print(f"OK: {checked} tensors written by deltasync load bit-exactly in "
          f"safetensors {safetensors.__version__} (torch {torch.__version__})")


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("make", "check"):
        sys.exit(__doc__)
    (make if sys.argv[1] == "make" else check)(sys.argv[2])
