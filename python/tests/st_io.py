"""A minimal safetensors reader and writer for the tests (Debian has no
safetensors package): the format's 8-byte header length, JSON header, data."""

import json
import struct

import torch

from deltasync._tensors import Raw, dtype_name
from deltasync.adapters.engine import _TORCH_MISSING, torch_dtype


def write(path, tensors: dict) -> None:
    header, blobs, offset = {}, [], 0
    for name in sorted(tensors):
        t = tensors[name]
        code = dtype_name(t)
        t = (t.array if isinstance(t, Raw) else t).contiguous()
        data = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        header[name] = {"dtype": code, "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def read(path) -> dict:
    with open(path, "rb") as f:
        raw = f.read()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    out = {}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        a, b = e["data_offsets"]
        buf = bytearray(raw[8 + n + a:8 + n + b])
        # An FP8 type this torch lacks: its bytes as uint8, named by Raw.
        raw_view = e["dtype"] in _TORCH_MISSING
        dt = torch.uint8 if raw_view else torch_dtype(e["dtype"])
        t = torch.frombuffer(buf, dtype=torch.uint8).view(dt) if buf else torch.zeros(0, dtype=dt)
        t = t.reshape(e["shape"])
        out[name] = Raw(t, e["dtype"]) if raw_view else t
    return out
