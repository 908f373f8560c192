#!/usr/bin/python3
"""Independent Python peer of the vime/slime disk delta transport.

Implements the publisher and the receiver of the disk format (docs/format.md,
"Delta encodings" and "Delta store") with numpy, zstandard and xxhash only, so that deltasync can be
checked against a second implementation in both directions and timed against
a vectorized Python baseline. See README.md beside this file for the exact
behaviours.

  vime_peer.py publish --store S --old CKPT --new CKPT [--encoding xor|overwrite]
                       [--checksum xxh3-128|blake3|adler32] [--threads N] [--full]
  vime_peer.py pull    --store S --local L --base CKPT [--target N|latest]
  vime_peer.py verify  --local L --store S

Success: a JSON summary on stdout, exit 0. Failure: one line on stderr
("vime_peer: error: ..."), nothing on stdout, and a non-zero exit code:
1 I/O or invalid argument, 2 usage, 3 corrupt input or checksum mismatch,
4 refused (version chain: wrong base, missing version, local ahead of target),
5 unsupported (encoding, compression or checksum this peer cannot handle).
"""

import argparse
import concurrent.futures
import fcntl
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
import time
import zlib

import numpy as np
import xxhash
import zstandard

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
STATE_DIR = ".weight_sync"
LOCK_NAME = "lock"
STATE_NAME = "state.json"
VERSION_DIR_RE = re.compile(r"^weight_v(\d{6})$")
VERSION_STR_RE = re.compile(r"^\d{6}$")

ENCODINGS = ("xor", "overwrite")
CHECKSUMS = ("xxh3-128", "blake3", "adler32")
ZSTD_LEVEL = 1
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
MAX_HEADER_BYTES = 100 << 20
MAX_INDEX_BYTES = 256 << 20
DEFAULT_MAX_SHARD_BYTES = 5_000_000_000

DTYPE_SIZES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}


class PeerError(Exception):
    """Any failure; the exit code tells drivers which kind."""
    exit_code = 1


class Corruption(PeerError):
    exit_code = 3


class Refused(PeerError):
    exit_code = 4


class Unsupported(PeerError):
    exit_code = 5


def version_str(n):
    return "%06d" % n


def parse_version_str(text, what):
    if not isinstance(text, str) or not VERSION_STR_RE.match(text):
        raise Corruption("%s must be a zero-padded 6-digit string, found %r" % (what, text))
    return int(text)


def version_dir(store, n):
    return os.path.join(store, "weight_v%06d" % n)


# ---------------------------------------------------------------------------
# safetensors and HF checkpoints, read and written by hand

def _reject_duplicates(pairs):
    seen = {}
    for key, value in pairs:
        if key in seen:
            raise ValueError("duplicate key %r" % key)
        seen[key] = value
    return seen


def _loads_strict(data, what):
    try:
        return json.loads(data.decode("utf-8"), object_pairs_hook=_reject_duplicates)
    except (UnicodeDecodeError, ValueError) as e:
        raise Corruption("%s: invalid JSON (%s)" % (what, e))


def _plain_int(v):
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


class SafetensorsHeader:
    """Parsed header of one safetensors file: tensors as absolute file offsets."""

    def __init__(self, path):
        self.path = path
        try:
            size = os.path.getsize(path)
            with open(path, "rb") as f:
                prefix = f.read(8)
                if len(prefix) < 8:
                    raise Corruption("%s: file is %d bytes, shorter than the 8-byte header length"
                                     % (path, size))
                (n,) = struct.unpack("<Q", prefix)
                if n > MAX_HEADER_BYTES:
                    raise Corruption("%s: declared header length %d exceeds %d bytes"
                                     % (path, n, MAX_HEADER_BYTES))
                if 8 + n > size:
                    raise Corruption("%s: declared header length %d extends past the end "
                                     "of the file" % (path, n))
                raw = f.read(n)
        except OSError as e:
            raise PeerError("%s: %s" % (path, e.strerror or e))
        header = _loads_strict(raw, "%s: header" % path)
        if not isinstance(header, dict):
            raise Corruption("%s: header is not a JSON object" % path)
        self.data_start = 8 + n
        data_len = size - self.data_start
        self.metadata = header.pop("__metadata__", {})
        if not isinstance(self.metadata, dict) or not all(
                isinstance(v, str) for v in self.metadata.values()):
            raise Corruption("%s: __metadata__ must be an object of strings" % path)
        # name -> (dtype, shape, absolute offset, byte length), in data order
        self.tensors = {}
        spans = []
        for name, entry in header.items():
            if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
                raise Corruption("%s: tensor %r: entry must be an object with exactly "
                                 "dtype, shape and data_offsets" % (path, name))
            dtype, shape, offs = entry["dtype"], entry["shape"], entry["data_offsets"]
            if not isinstance(dtype, str):
                raise Corruption("%s: tensor %r: dtype must be a string" % (path, name))
            if not isinstance(shape, list) or not all(_plain_int(d) for d in shape):
                raise Corruption("%s: tensor %r: shape must be a list of non-negative integers"
                                 % (path, name))
            if (not isinstance(offs, list) or len(offs) != 2
                    or not all(_plain_int(o) for o in offs) or offs[0] > offs[1]):
                raise Corruption("%s: tensor %r: bad data_offsets %r" % (path, name, offs))
            if offs[1] > data_len:
                raise Corruption("%s: tensor %r: data_offsets %r extend past the end of the "
                                 "%d-byte data buffer (file truncated?)"
                                 % (path, name, offs, data_len))
            nbytes = offs[1] - offs[0]
            # dtype-blind transport: an unknown dtype is carried as its bytes
            if dtype in DTYPE_SIZES:
                numel = 1
                for d in shape:
                    numel *= d
                need = numel * DTYPE_SIZES[dtype]
                if need != nbytes:
                    raise Corruption("%s: tensor %r: shape %r of %s needs %d bytes, data_offsets "
                                     "span %d" % (path, name, shape, dtype, need, nbytes))
            self.tensors[name] = (dtype, shape, self.data_start + offs[0], nbytes)
            if nbytes:
                spans.append((offs[0], offs[1], name))
        spans.sort()
        for (b0, e0, n0), (b1, _, n1) in zip(spans, spans[1:]):
            if b1 < e0:
                raise Corruption("%s: tensors %r and %r overlap" % (path, n0, n1))


def _plain_file_name(name):
    return (isinstance(name, str) and name not in ("", ".", "..")
            and "/" not in name and "\\" not in name and "\0" not in name)


class Checkpoint:
    """An HF checkpoint directory: index + shards, or model.safetensors alone."""

    def __init__(self, path):
        self.path = path
        if not os.path.isdir(path):
            raise PeerError("%s: not a checkpoint directory" % path)
        index_path = os.path.join(path, INDEX_NAME)
        self.index_metadata = None
        if os.path.exists(index_path):
            if os.path.getsize(index_path) > MAX_INDEX_BYTES:
                raise Corruption("%s: index larger than %d bytes" % (index_path, MAX_INDEX_BYTES))
            with open(index_path, "rb") as f:
                index = _loads_strict(f.read(), index_path)
            if not isinstance(index, dict):
                raise Corruption("%s: not a JSON object" % index_path)
            weight_map = index.get("weight_map")
            if not isinstance(weight_map, dict):
                raise Corruption("%s: weight_map missing or not an object" % index_path)
            meta = index.get("metadata", {})
            if not isinstance(meta, dict):
                raise Corruption("%s: metadata is not an object" % index_path)
            self.index_metadata = meta
            for name, fname in weight_map.items():
                if not _plain_file_name(fname):
                    raise Corruption("%s: tensor %r maps to %r, not a plain file name in the "
                                     "directory" % (index_path, name, fname))
            files = sorted(set(weight_map.values()))
        elif os.path.exists(os.path.join(path, SINGLE_NAME)):
            weight_map = None
            files = [SINGLE_NAME]
        else:
            raise PeerError("%s: no %s or %s" % (path, INDEX_NAME, SINGLE_NAME))
        self.headers = {}
        # name -> (file name, dtype, shape, absolute offset, byte length)
        self.tensors = {}
        for fname in files:
            fpath = os.path.join(path, fname)
            if not os.path.isfile(fpath):
                raise Corruption("%s: the index names %s, which does not exist"
                                 % (path, fname))
            header = SafetensorsHeader(fpath)
            self.headers[fname] = header
            for name, (dtype, shape, off, nbytes) in header.tensors.items():
                if weight_map is not None and weight_map.get(name) != fname:
                    raise Corruption("%s: tensor %r is held by %s but the index lists it %s"
                                     % (path, name, fname,
                                        "for %s" % weight_map[name] if name in weight_map
                                        else "nowhere"))
                if name in self.tensors:
                    raise Corruption("%s: tensor %r is held by two files" % (path, name))
                self.tensors[name] = (fname, dtype, shape, off, nbytes)
        if weight_map is not None:
            for name, fname in weight_map.items():
                if name not in self.tensors:
                    raise Corruption("%s: the index lists tensor %r in %s, which does not hold it"
                                     % (path, name, fname))

    def is_delta(self):
        return self.index_metadata is not None and "delta_encoding" in self.index_metadata

    def size_bytes(self):
        return sum(os.path.getsize(os.path.join(self.path, f)) for f in self.headers)


class MappedFiles:
    """np.memmap per file, opened lazily; views are byte arrays into the maps."""

    def __init__(self, directory, writable=False):
        self.directory = directory
        self.mode = "r+" if writable else "r"
        self.maps = {}
        self.lock = threading.Lock()

    def view(self, fname, offset, nbytes):
        with self.lock:
            mm = self.maps.get(fname)
            if mm is None:
                mm = np.memmap(os.path.join(self.directory, fname), dtype=np.uint8, mode=self.mode)
                self.maps[fname] = mm
        return mm[offset:offset + nbytes]

    def flush(self):
        for mm in self.maps.values():
            if self.mode == "r+":
                mm.flush()

    def close(self):
        self.flush()
        self.maps.clear()


def _fsync_dir(path):
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_delta_shard(path, frames, checksums):
    """frames: list of (name, bytes); checksums: name -> hex. Returns bytes written."""
    header = {"__metadata__": checksums}
    offset = 0
    for name, frame in frames:
        header[name] = {"dtype": "U8", "shape": [len(frame)],
                        "data_offsets": [offset, offset + len(frame)]}
        offset += len(frame)
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    raw += b" " * ((-(8 + len(raw))) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for _, frame in frames:
            f.write(frame)
        f.flush()
        os.fsync(f.fileno())
    return 8 + len(raw) + offset


# ---------------------------------------------------------------------------
# checksums

class Checksummer:
    def __init__(self, algo, deltasync_bin):
        if algo not in CHECKSUMS:
            raise Unsupported("checksum_format %r is not supported (known: %s)"
                              % (algo, ", ".join(CHECKSUMS)))
        if algo == "blake3" and not deltasync_bin:
            raise Unsupported("checksum_format blake3 needs --deltasync-bin (or DELTASYNC_BIN): "
                              "there is no Debian BLAKE3 module for Python")
        self.algo = algo
        self.bin = deltasync_bin

    @property
    def inline(self):
        """True when digests are computed in-process, per tensor, in the pool."""
        return self.algo != "blake3"

    def digest(self, arr):
        if self.algo == "xxh3-128":
            return xxhash.xxh3_128(arr).hexdigest()
        return "%08x" % (zlib.adler32(arr) & 0xFFFFFFFF)

    def digest_many(self, arrays):
        """Digests of many byte arrays; blake3 goes through `deltasync checksum`."""
        if self.inline:
            return [self.digest(a) for a in arrays]
        out = []
        with tempfile.TemporaryDirectory(prefix="vime_peer_b3_") as tmp:
            for start in range(0, len(arrays), 512):
                batch = arrays[start:start + 512]
                paths = []
                for i, arr in enumerate(batch):
                    p = os.path.join(tmp, "t%d" % (start + i))
                    with open(p, "wb") as f:
                        f.write(memoryview(arr))
                    paths.append(p)
                try:
                    proc = subprocess.run([self.bin, "checksum", "--algo", "blake3"] + paths,
                                          capture_output=True, text=True)
                except OSError as e:
                    raise PeerError("cannot run %s: %s" % (self.bin, e))
                if proc.returncode != 0:
                    raise PeerError("%s checksum --algo blake3 failed (exit %d): %s"
                                    % (self.bin, proc.returncode, proc.stderr.strip()))
                digests = {}
                for line in proc.stdout.splitlines():
                    hexd, _, fname = line.partition("  ")
                    digests[fname] = hexd
                for p in paths:
                    if p not in digests or not re.match(r"^[0-9a-f]{64}$", digests[p]):
                        raise PeerError("%s checksum printed no blake3 digest for %s"
                                        % (self.bin, p))
                    out.append(digests[p])
                    os.unlink(p)
        return out


# ---------------------------------------------------------------------------
# zstd frames

_tls = threading.local()


def _cctx():
    c = getattr(_tls, "cctx", None)
    if c is None:
        c = _tls.cctx = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
    return c


def _dctx():
    d = getattr(_tls, "dctx", None)
    if d is None:
        d = _tls.dctx = zstandard.ZstdDecompressor()
    return d


def check_single_frame(frame, what):
    """Walks the block headers so that a frame with bytes after it, a truncated
    frame or anything that is not one zstd frame is refused before decoding.
    Returns the declared content size, or -1 when the header does not say."""
    mv = memoryview(frame)
    if len(mv) < 4 or bytes(mv[:4]) != ZSTD_MAGIC:
        raise Corruption("%s: not a zstd frame (bad magic)" % what)
    try:
        pos = zstandard.frame_header_size(mv)
        params = zstandard.get_frame_parameters(mv)
        content_size = zstandard.frame_content_size(mv)
    except zstandard.ZstdError as e:
        raise Corruption("%s: bad zstd frame header (%s)" % (what, e))
    if params.dict_id:
        raise Corruption("%s: zstd frame needs dictionary %d" % (what, params.dict_id))
    while True:
        if pos + 3 > len(mv):
            raise Corruption("%s: zstd frame is truncated" % what)
        bh = mv[pos] | (mv[pos + 1] << 8) | (mv[pos + 2] << 16)
        pos += 3
        btype, bsize = (bh >> 1) & 3, bh >> 3
        if btype == 3:
            raise Corruption("%s: zstd frame has a reserved block type" % what)
        pos += 1 if btype == 1 else bsize
        if bh & 1:
            break
    if params.has_checksum:
        pos += 4
    if pos > len(mv):
        raise Corruption("%s: zstd frame is truncated" % what)
    if pos != len(mv):
        raise Corruption("%s: %d bytes follow the zstd frame" % (what, len(mv) - pos))
    return content_size


def decompress_frame(frame, content_size, limit, what):
    try:
        if content_size >= 0:
            return _dctx().decompress(frame)
        return _dctx().decompress(frame, max_output_size=limit)
    except zstandard.ZstdError as e:
        raise Corruption("%s: zstd frame does not decode (%s)" % (what, e))


# ---------------------------------------------------------------------------
# store

def list_versions(store):
    """Sorted version numbers of the complete weight_vNNNNNN directories."""
    try:
        names = os.listdir(store)
    except FileNotFoundError:
        return []
    except OSError as e:
        raise PeerError("%s: %s" % (store, e.strerror))
    out = []
    for name in names:
        m = VERSION_DIR_RE.match(name)
        if m and os.path.isdir(os.path.join(store, name)):
            out.append(int(m.group(1)))
    return sorted(out)


def parse_delta_metadata(ckpt, n):
    meta = ckpt.index_metadata
    what = "%s: index metadata" % ckpt.path
    for key in ("version", "base_version", "delta_encoding", "compression_format",
                "checksum_format"):
        if not isinstance(meta.get(key), str):
            raise Corruption("%s: %s missing or not a string" % (what, key))
    if parse_version_str(meta["version"], what + " version") != n:
        raise Corruption("%s: version %s does not match the directory name"
                         % (what, meta["version"]))
    base = parse_version_str(meta["base_version"], what + " base_version")
    if meta["delta_encoding"] not in ENCODINGS:
        raise Unsupported("%s: delta_encoding %r is not supported by this peer (known: %s)"
                          % (what, meta["delta_encoding"], ", ".join(ENCODINGS)))
    if meta["compression_format"] != "zstd":
        raise Unsupported("%s: compression_format %r is not supported (only zstd)"
                          % (what, meta["compression_format"]))
    if meta["checksum_format"] not in CHECKSUMS:
        raise Unsupported("%s: checksum_format %r is not supported (known: %s)"
                          % (what, meta["checksum_format"], ", ".join(CHECKSUMS)))
    return base, meta["delta_encoding"], meta["checksum_format"]


# ---------------------------------------------------------------------------
# publish

def _encode_tensor(old, new, encoding, summer):
    x = np.bitwise_xor(new, old)
    if not x.any():
        return None
    if encoding == "xor":
        content = x
    else:
        if x.size > 1 << 32:
            raise Unsupported("overwrite encodes u32 byte positions: tensors above 2^32 bytes "
                              "are not supported")
        pos = np.flatnonzero(x)
        k = pos.size
        content = np.empty(4 + 5 * k, dtype=np.uint8)
        content[:4] = np.frombuffer(struct.pack("<I", k), dtype=np.uint8)
        content[4:4 + 4 * k] = pos.astype("<u4").view(np.uint8)
        content[4 + 4 * k:] = new[pos]
    del x
    frame = _cctx().compress(content)
    digest = summer.digest(new) if summer.inline else None
    return frame, digest


def cmd_publish(args):
    t0 = time.perf_counter()
    store = args.store
    summer = None if args.full else Checksummer(args.checksum, args.deltasync_bin)
    new_ckpt = Checkpoint(args.new)
    os.makedirs(store, exist_ok=True)
    versions = list_versions(store)
    base = versions[-1] if versions else 0
    n = base + 1
    final_dir = version_dir(store, n)
    tmp_dir = os.path.join(store, ".weight_v%06d.tmp.%d" % (n, os.getpid()))
    summary = {"command": "publish", "version": version_str(n), "base_version": version_str(base)}
    try:
        os.mkdir(tmp_dir)
        if args.full:
            written = 0
            for fname in sorted(os.listdir(args.new)):
                src = os.path.join(args.new, fname)
                if fname.startswith(".") or not os.path.isfile(src):
                    continue
                shutil.copyfile(src, os.path.join(tmp_dir, fname))
                written += os.path.getsize(src)
            summary.update({"full": True, "tensors_total": len(new_ckpt.tensors),
                            "bytes_read": written, "bytes_written": written})
        else:
            if not args.old:
                raise PeerError("publish needs --old (the checkpoint the receivers hold) "
                                "unless --full")
            old_ckpt = Checkpoint(args.old)
            summary.update(_publish_delta(args, old_ckpt, new_ckpt, summer, tmp_dir, n, base))
        _fsync_dir(tmp_dir)
        try:
            os.rename(tmp_dir, final_dir)
        except OSError as e:
            raise PeerError("cannot publish %s (%s): another publisher may have taken this "
                            "version" % (final_dir, e.strerror))
        _fsync_dir(store)
    finally:
        if os.path.isdir(tmp_dir):
            shutil.rmtree(tmp_dir, ignore_errors=True)
    summary["version_dir"] = final_dir
    summary["seconds"] = time.perf_counter() - t0
    return summary


def _publish_delta(args, old_ckpt, new_ckpt, summer, out_dir, n, base):
    for name in old_ckpt.tensors:
        if name not in new_ckpt.tensors:
            raise PeerError("tensor %r is in OLD but not in NEW: a delta cannot remove tensors"
                            % name)
    names = list(new_ckpt.tensors)
    for name in names:
        if name not in old_ckpt.tensors:
            raise PeerError("tensor %r is in NEW but not in OLD: a delta cannot add tensors" % name)
        _, odt, oshape, _, onb = old_ckpt.tensors[name]
        _, ndt, nshape, _, nnb = new_ckpt.tensors[name]
        if (odt, oshape, onb) != (ndt, nshape, nnb):
            raise PeerError("tensor %r: OLD is %s%r, NEW is %s%r; a delta needs equal layouts"
                            % (name, odt, oshape, ndt, nshape))
    old_maps, new_maps = MappedFiles(old_ckpt.path), MappedFiles(new_ckpt.path)

    def work(name):
        ofile, _, _, ooff, nbytes = old_ckpt.tensors[name]
        nfile, _, _, noff, _ = new_ckpt.tensors[name]
        return _encode_tensor(old_maps.view(ofile, ooff, nbytes),
                              new_maps.view(nfile, noff, nbytes), args.encoding, summer)

    t_enc = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(max_workers=args.threads) as pool:
        results = list(pool.map(work, names))
    changed = [(name, r) for name, r in zip(names, results) if r is not None]
    if not summer.inline:
        views = []
        for name, _ in changed:
            nfile, _, _, noff, nbytes = new_ckpt.tensors[name]
            views.append(new_maps.view(nfile, noff, nbytes))
        digests = summer.digest_many(views)
        changed = [(name, (r[0], d)) for (name, r), d in zip(changed, digests)]
    encode_seconds = time.perf_counter() - t_enc

    t_write = time.perf_counter()
    shards = []
    for name, (frame, digest) in changed:
        if not shards or (shards[-1][1] + len(frame) > args.max_shard_bytes and shards[-1][0]):
            shards.append([[], 0])
        shards[-1][0].append((name, frame, digest))
        shards[-1][1] += len(frame)
    weight_map = {}
    written = 0
    for i, (entries, _) in enumerate(shards):
        fname = "model-%05d-of-%05d.safetensors" % (i + 1, len(shards))
        written += write_delta_shard(os.path.join(out_dir, fname),
                                     [(name, frame) for name, frame, _ in entries],
                                     {name: digest for name, _, digest in entries})
        for name, _, _ in entries:
            weight_map[name] = fname
    index = {
        "metadata": {
            "version": version_str(n),
            "base_version": version_str(base),
            "delta_encoding": args.encoding,
            "compression_format": "zstd",
            "checksum_format": args.checksum,
            "total_size": sum(len(frame) for _, (frame, _) in changed),
        },
        "weight_map": weight_map,
    }
    raw = (json.dumps(index, indent=2, sort_keys=True) + "\n").encode("utf-8")
    with open(os.path.join(out_dir, INDEX_NAME), "wb") as f:
        f.write(raw)
        f.flush()
        os.fsync(f.fileno())
    written += len(raw)
    total_bytes = sum(t[4] for t in new_ckpt.tensors.values())
    return {
        "delta_encoding": args.encoding,
        "checksum_format": args.checksum,
        "tensors_total": len(names),
        "tensors_changed": len(changed),
        "changed_tensor_bytes": sum(new_ckpt.tensors[name][4] for name, _ in changed),
        "compressed_bytes": index["metadata"]["total_size"],
        "shards": len(shards),
        "bytes_read": 2 * total_bytes,
        "bytes_written": written,
        "encode_seconds": encode_seconds,
        "write_seconds": time.perf_counter() - t_write,
    }


# ---------------------------------------------------------------------------
# pull

class LocalState:
    """<local>/.weight_sync: flock'd for the life of the object."""

    def __init__(self, local):
        self.local = local
        self.dir = os.path.join(local, STATE_DIR)
        os.makedirs(self.dir, exist_ok=True)
        self.lock_fd = os.open(os.path.join(self.dir, LOCK_NAME), os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(self.lock_fd, fcntl.LOCK_EX)

    def close(self):
        os.close(self.lock_fd)  # releases the flock

    def read(self):
        path = os.path.join(self.dir, STATE_NAME)
        try:
            with open(path, "rb") as f:
                raw = f.read()
        except FileNotFoundError:
            return None
        state = _loads_strict(raw, path)
        if not isinstance(state, dict) or "version" not in state:
            raise Corruption("%s: expected {\"version\": \"NNNNNN\"}" % path)
        return parse_version_str(state["version"], path + ": version")

    def write(self, n):
        path = os.path.join(self.dir, STATE_NAME)
        tmp = os.path.join(self.dir, ".%s.tmp.%d" % (STATE_NAME, os.getpid()))
        with open(tmp, "w") as f:
            f.write(json.dumps({"version": version_str(n)}))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(self.dir)


def _is_model_file(fname):
    return fname == INDEX_NAME or fname.endswith(".safetensors")


def replace_local_with(src, local):
    """Copies every top-level regular file of src into local (each by temp +
    rename) and removes model files src does not have. Returns bytes copied."""
    if not os.path.isdir(src):
        raise PeerError("%s: not a checkpoint directory" % src)
    Checkpoint(src)  # refuse to install something that does not open
    copied = 0
    keep = set()
    for fname in sorted(os.listdir(src)):
        path = os.path.join(src, fname)
        if fname.startswith(".") or not os.path.isfile(path):
            continue
        tmp = os.path.join(local, ".%s.tmp.%d" % (fname, os.getpid()))
        shutil.copyfile(path, tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(local, fname))
        copied += os.path.getsize(path)
        keep.add(fname)
    for fname in os.listdir(local):
        if _is_model_file(fname) and fname not in keep:
            os.unlink(os.path.join(local, fname))
    _fsync_dir(local)
    return copied


def version_is_delta(vdir):
    """Reads only the index: a version is a delta iff its index metadata has
    delta_encoding; no index (or none of that key) means a full checkpoint."""
    index_path = os.path.join(vdir, INDEX_NAME)
    if os.path.exists(index_path):
        with open(index_path, "rb") as f:
            index = _loads_strict(f.read(MAX_INDEX_BYTES + 1), index_path)
        meta = index.get("metadata") if isinstance(index, dict) else None
        return isinstance(meta, dict) and "delta_encoding" in meta
    if os.path.exists(os.path.join(vdir, SINGLE_NAME)):
        return False
    raise Corruption("%s: neither %s nor %s: not a version" % (vdir, INDEX_NAME, SINGLE_NAME))


def plan_chain(store, applied, target, versions, deltasync_bin):
    """Returns (full version to reset to or None, [delta versions to apply]),
    refusing a chain with a gap or a wrong base before anything is touched."""
    present = set(versions)
    if target != 0 and target not in present:
        raise Refused("version %s is not in the store %s (latest is %s)"
                      % (version_str(target), store,
                         version_str(versions[-1]) if versions else "none"))
    reset = None
    for v in reversed(versions):
        if v > target or (applied is not None and v <= applied):
            continue
        if not version_is_delta(version_dir(store, v)):
            reset = v
            break
    current = reset if reset is not None else (applied if applied is not None else 0)
    if current > target:
        raise Refused("the local checkpoint is at version %s, newer than the target %s"
                      % (version_str(current), version_str(target)))
    chain = []
    for v in range(current + 1, target + 1):
        if v not in present:
            raise Refused("version %s is missing from the store %s: cannot go from %s to %s"
                          % (version_str(v), store, version_str(current), version_str(target)))
        ck = Checkpoint(version_dir(store, v))
        if not ck.is_delta():
            raise Corruption("%s changed from a delta to a full version while being read"
                             % ck.path)
        base, encoding, algo = parse_delta_metadata(ck, v)
        if base != v - 1:
            raise Refused("version %s declares base_version %s, but it would apply on %s"
                          % (version_str(v), version_str(base), version_str(v - 1)))
        Checksummer(algo, deltasync_bin)  # refuses blake3 without the binary, up front
        chain.append((v, ck, encoding, algo))
    return reset, chain


def apply_delta(local_dir, v, delta, encoding, algo, args):
    """Applies one delta version in place. On any failure the tensors already
    changed are restored (xor: applied again; overwrite: old bytes put back)
    and the error is raised, so the local files stay at the previous version."""
    summer = Checksummer(algo, args.deltasync_bin)
    local = Checkpoint(local_dir)
    vname = "version %s" % version_str(v)
    jobs = []
    for fname, header in delta.headers.items():
        for name, (dtype, shape, off, nbytes) in header.tensors.items():
            what = "%s tensor %r" % (vname, name)
            if dtype != "U8" or len(shape) != 1:
                raise Corruption("%s: a delta tensor must be 1-D U8, found %s%r"
                                 % (what, dtype, shape))
            if name not in local.tensors:
                raise Corruption("%s: no such tensor in the local checkpoint %s"
                                 % (what, local_dir))
            expected = header.metadata.get(name)
            if expected is None:
                raise Corruption("%s: %s has no checksum for it in __metadata__" % (what, fname))
            jobs.append((name, fname, off, nbytes, expected.lower()))
    delta_maps = MappedFiles(delta.path)
    local_maps = MappedFiles(local_dir, writable=True)
    # Structure first, for every tensor, so that most corruption is refused
    # before a single local byte changes.
    sizes = {}
    for name, fname, off, nbytes, _ in jobs:
        lnb = local.tensors[name][4]
        what = "%s tensor %r" % (vname, name)
        cs = check_single_frame(delta_maps.view(fname, off, nbytes), what)
        if encoding == "xor" and cs >= 0 and cs != lnb:
            raise Corruption("%s: xor frame holds %d bytes, the tensor has %d" % (what, cs, lnb))
        if encoding == "overwrite" and cs >= 0 and (cs < 4 or (cs - 4) % 5 or (cs - 4) // 5 > lnb):
            raise Corruption("%s: overwrite frame of %d bytes is not 4 + 5*K with K <= %d"
                             % (what, cs, lnb))
        sizes[name] = cs

    abort = threading.Event()
    done = []  # (name, undo) of tensors whose bytes changed
    done_lock = threading.Lock()

    def work(job):
        name, fname, off, nbytes, expected = job
        if abort.is_set():
            return None
        lfile, _, _, loff, lnb = local.tensors[name]
        what = "%s tensor %r" % (vname, name)
        frame = delta_maps.view(fname, off, nbytes)
        limit = lnb if encoding == "xor" else 4 + 5 * lnb
        content = decompress_frame(frame, sizes[name], limit, what)
        target = local_maps.view(lfile, loff, lnb)
        if encoding == "xor":
            if len(content) != lnb:
                raise Corruption("%s: xor frame holds %d bytes, the tensor has %d"
                                 % (what, len(content), lnb))
            d = np.frombuffer(content, dtype=np.uint8)
            np.bitwise_xor(target, d, out=target)
            del d, content
            undo = ("xor", (frame, sizes[name], limit, what))
            written = lnb
        else:
            if len(content) < 4:
                raise Corruption("%s: overwrite content of %d bytes has no count"
                                 % (what, len(content)))
            (k,) = struct.unpack_from("<I", content, 0)
            if len(content) != 4 + 5 * k:
                raise Corruption("%s: overwrite content is %d bytes, count %d needs %d"
                                 % (what, len(content), k, 4 + 5 * k))
            pos = np.frombuffer(content, dtype="<u4", count=k, offset=4)
            vals = np.frombuffer(content, dtype=np.uint8, count=k, offset=4 + 4 * k)
            if k and int(pos.max()) >= lnb:
                raise Corruption("%s: overwrite position %d is past the tensor's %d bytes"
                                 % (what, int(pos.max()), lnb))
            undo = ("overwrite", (pos, target[pos]))
            target[pos] = vals
            written = k
        with done_lock:
            done.append((name, target, undo))
        got = summer.digest(target) if summer.inline else None
        if got is not None and got != expected:
            raise Corruption("%s: checksum mismatch after apply (%s expected %s, got %s): "
                             "corrupt delta or wrong base" % (what, algo, expected, got))
        return nbytes, written

    results = []
    errors = []
    with concurrent.futures.ThreadPoolExecutor(max_workers=args.threads) as pool:
        futures = [pool.submit(work, job) for job in jobs]
        for fut in futures:
            try:
                r = fut.result()
                if r is not None:
                    results.append(r)
            except Exception as e:  # noqa: BLE001 - gathered, re-raised below
                abort.set()
                errors.append(e)
    if not errors and not summer.inline:
        order = {name: i for i, (name, *_rest) in enumerate(jobs)}
        done.sort(key=lambda d: order[d[0]])
        digests = summer.digest_many([t for _, t, _ in done])
        for (name, _, _), got in zip(done, digests):
            expected = jobs[order[name]][4]
            if got != expected:
                errors.append(Corruption(
                    "%s tensor %r: checksum mismatch after apply (blake3 expected %s, got %s): "
                    "corrupt delta or wrong base" % (vname, name, expected, got)))
                break
    if errors:
        for name, target, (kind, data) in done:
            if kind == "xor":
                # XOR is an involution: decoding the same frame again undoes it
                content = decompress_frame(*data)
                np.bitwise_xor(target, np.frombuffer(content, dtype=np.uint8), out=target)
            else:
                pos, old = data
                target[pos] = old
        local_maps.close()
        first = errors[0]
        if isinstance(first, PeerError):
            raise first
        if isinstance(first, OSError):
            raise PeerError("%s: %s" % (vname, first))
        raise PeerError("%s: %s: %s" % (vname, type(first).__name__, first))
    local_maps.close()
    return (len(jobs), sum(r[0] for r in results), sum(r[1] for r in results))


def cmd_pull(args):
    t0 = time.perf_counter()
    if not os.path.isdir(args.base):
        raise PeerError("%s: base checkpoint directory not found" % args.base)
    os.makedirs(args.local, exist_ok=True)
    state = LocalState(args.local)
    try:
        applied = state.read()
        versions = list_versions(args.store)
        if args.target == "latest":
            target = versions[-1] if versions else 0
        else:
            try:
                target = int(args.target)
            except ValueError:
                raise PeerError("--target must be a version number or 'latest', found %r"
                                % args.target)
            if target < 0:
                raise PeerError("--target must not be negative")
        reset, chain = plan_chain(args.store, applied, target, versions,
                                  args.deltasync_bin)
        summary = {"command": "pull",
                   "from_version": None if applied is None else version_str(applied),
                   "to_version": version_str(target), "materialized_base": False,
                   "reset_to_full": None, "versions_applied": [], "tensors_changed": 0,
                   "bytes_read": 0, "bytes_written": 0, "bytes_copied": 0}
        if reset is not None:
            copied = replace_local_with(version_dir(args.store, reset), args.local)
            state.write(reset)
            summary["reset_to_full"] = version_str(reset)
            summary["bytes_copied"] += copied
        elif applied is None:
            copied = replace_local_with(args.base, args.local)
            state.write(0)
            summary["materialized_base"] = True
            summary["bytes_copied"] += copied
        apply_seconds = 0.0
        for v, delta, encoding, algo in chain:
            t = time.perf_counter()
            changed, read, written = apply_delta(args.local, v, delta, encoding, algo, args)
            state.write(v)
            apply_seconds += time.perf_counter() - t
            summary["versions_applied"].append(version_str(v))
            summary["tensors_changed"] += changed
            summary["bytes_read"] += read
            summary["bytes_written"] += written
        summary["bytes_read"] += summary["bytes_copied"]
        summary["bytes_written"] += summary["bytes_copied"]
        summary["apply_seconds"] = apply_seconds
    finally:
        state.close()
    summary["seconds"] = time.perf_counter() - t0
    return summary


# ---------------------------------------------------------------------------
# verify

def cmd_verify(args):
    t0 = time.perf_counter()
    if not os.path.isdir(os.path.join(args.local, STATE_DIR)):
        raise PeerError("%s: no %s: nothing has been pulled here" % (args.local, STATE_DIR))
    state = LocalState(args.local)
    try:
        applied = state.read()
        if applied is None:
            raise PeerError("%s: no %s/%s: nothing has been pulled here"
                            % (args.local, STATE_DIR, STATE_NAME))
        summary = {"command": "verify", "version": version_str(applied)}
        local = Checkpoint(args.local)
        maps = MappedFiles(args.local)
        mismatched = []
        if applied == 0:
            summary.update({"tensors_verified": 0, "note": "version 0 is the base checkpoint; "
                            "the store holds no checksums for it"})
        else:
            vdir = version_dir(args.store, applied)
            if not os.path.isdir(vdir):
                raise Refused("version %s is not in the store %s" % (version_str(applied),
                                                                     args.store))
            ck = Checkpoint(vdir)
            if ck.is_delta():
                _, _, algo = parse_delta_metadata(ck, applied)
                summer = Checksummer(algo, args.deltasync_bin)
                expected = {}
                for header in ck.headers.values():
                    for name in header.tensors:
                        if name not in header.metadata:
                            raise Corruption("%s: no checksum for tensor %r" % (vdir, name))
                        expected[name] = header.metadata[name].lower()
            else:
                # A full version lists every tensor; its own bytes are the reference.
                algo = "xxh3-128"
                summer = Checksummer(algo, None)
                store_maps = MappedFiles(vdir)
                expected = {}
                for name, (fname, _, _, off, nbytes) in ck.tensors.items():
                    expected[name] = summer.digest(store_maps.view(fname, off, nbytes))
            names = sorted(expected)
            missing = [n for n in names if n not in local.tensors]
            if missing:
                raise Corruption("%s: tensors %s of version %s are missing"
                                 % (args.local, ", ".join(repr(n) for n in missing[:5]),
                                    version_str(applied)))
            views = [maps.view(local.tensors[n][0], local.tensors[n][3], local.tensors[n][4])
                     for n in names]
            if summer.inline:
                with concurrent.futures.ThreadPoolExecutor(max_workers=args.threads) as pool:
                    got = list(pool.map(summer.digest, views))
            else:
                got = summer.digest_many(views)
            mismatched = [n for n, g in zip(names, got) if g != expected[n]]
            summary.update({"checksum_format": algo, "tensors_verified": len(names),
                            "bytes_read": sum(v.size for v in views)})
        if mismatched:
            raise Corruption("%s: %d tensor(s) do not match version %s: %s"
                             % (args.local, len(mismatched), version_str(applied),
                                ", ".join(repr(n) for n in mismatched[:5])))
    finally:
        state.close()
    summary["seconds"] = time.perf_counter() - t0
    return summary


# ---------------------------------------------------------------------------
# CLI

def build_parser():
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--threads", type=int, default=min(32, os.cpu_count() or 1),
                        help="worker threads over tensors (default: CPU count, at most 32)")
    common.add_argument("--deltasync-bin", default=os.environ.get("DELTASYNC_BIN"),
                        help="deltasync binary, used for blake3 checksums "
                             "(default: $DELTASYNC_BIN)")
    parser = argparse.ArgumentParser(
        prog="vime_peer.py",
        description="Independent Python peer of the vime/slime disk delta transport.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("publish", parents=[common],
                       help="write version latest+1 of the store: NEW's delta against OLD")
    p.add_argument("--store", required=True)
    p.add_argument("--old", help="checkpoint the receivers hold (the latest version); "
                                 "required unless --full")
    p.add_argument("--new", required=True)
    p.add_argument("--encoding", choices=ENCODINGS, default="xor")
    p.add_argument("--checksum", choices=CHECKSUMS, default="xxh3-128")
    p.add_argument("--max-shard-bytes", type=int, default=DEFAULT_MAX_SHARD_BYTES)
    p.add_argument("--full", action="store_true",
                   help="publish NEW as a full version (copied as-is), resetting the chain")
    p = sub.add_parser("pull", parents=[common],
                       help="bring the local checkpoint to a version of the store")
    p.add_argument("--store", required=True)
    p.add_argument("--local", required=True)
    p.add_argument("--base", required=True, help="version 0: the engine's base checkpoint")
    p.add_argument("--target", default="latest")
    p = sub.add_parser("verify", parents=[common],
                       help="recompute the checksums of the tensors the applied version lists")
    p.add_argument("--local", required=True)
    p.add_argument("--store", required=True)
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    if getattr(args, "threads", 1) < 1:
        print("vime_peer: error: --threads must be at least 1", file=sys.stderr)
        return 2
    if getattr(args, "max_shard_bytes", 1) < 1:
        print("vime_peer: error: --max-shard-bytes must be at least 1", file=sys.stderr)
        return 2
    handlers = {"publish": cmd_publish, "pull": cmd_pull, "verify": cmd_verify}
    try:
        summary = handlers[args.command](args)
    except PeerError as e:
        print("vime_peer: error: %s" % e, file=sys.stderr)
        return e.exit_code
    except OSError as e:
        print("vime_peer: error: %s%s" % (e.strerror or e,
                                          ": %s" % e.filename if e.filename else ""),
              file=sys.stderr)
        return 1
    json.dump(summary, sys.stdout, sort_keys=True)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
