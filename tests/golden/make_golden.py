#!/usr/bin/python3
"""Writes the golden safetensors files, checkpoint directories and fuzz seeds.

Standard library only, deterministic: running it twice gives identical bytes.
Good files are laid out as the reference writer lays them out (compact JSON,
"__metadata__" first, tensors sorted by element size descending then name,
header padded with spaces to a multiple of 8 bytes including the length
prefix). Corrupt files each break exactly one rule; README.md lists the error
each must produce.

Usage:
  make_golden.py            rewrite tests/golden/ and fuzz/corpus/safetensors_header/
  make_golden.py --check    exit 1 if the committed files differ from what it writes
"""

import filecmp
import json
import os
import struct
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
GOLDEN_DIR = HERE
SEED_DIR = os.path.join(ROOT, "fuzz", "corpus", "safetensors_header")

ELEMENT_SIZE = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}


def pad_header(header):
    """Spaces so that 8 + len(header) is a multiple of 8."""
    return header + b" " * ((-(8 + len(header))) % 8)


def nul_pad(header):
    """NULs (not the spaces the format allows) so that 8 + len(header) is a
    multiple of 8."""
    return header + b"\0" * ((-(8 + len(header))) % 8)


def image(header, data=b"", declared_length=None, pad=True):
    """A file image: little-endian u64 length, header, data."""
    if pad:
        header = pad_header(header)
    length = len(header) if declared_length is None else declared_length
    return struct.pack("<Q", length) + header + data


def compact(obj):
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def safetensors(tensors, metadata=None):
    """tensors: list of (name, dtype, shape, raw bytes). Reference layout."""
    ordered = sorted(tensors, key=lambda t: (-ELEMENT_SIZE[t[1]], t[0]))
    header = {}
    if metadata:
        header["__metadata__"] = metadata
    data = b""
    for name, dtype, shape, raw in ordered:
        count = 1
        for dim in shape:
            count *= dim
        assert len(raw) == count * ELEMENT_SIZE[dtype], name
        header[name] = {"dtype": dtype, "shape": shape,
                        "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    return image(compact(header), data)


def raw_header(text, data=b""):
    """A file around a hand-written header (bytes or str), padded."""
    if isinstance(text, str):
        text = text.encode("utf-8")
    return image(text, data)


def entry(dtype, shape, begin, end):
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


# Values chosen so that each dtype's bytes are recognisable; the C++ test
# states the same values independently.
ALL_DTYPES = [
    ("t_bool", "BOOL", [3], bytes([1, 0, 1])),
    ("t_u8", "U8", [2, 2], bytes([0, 1, 254, 255])),
    ("t_i8", "I8", [3], struct.pack("<3b", -128, -1, 127)),
    ("t_f8_e4m3", "F8_E4M3", [2], bytes([0x38, 0xB8])),  # 1.0, -1.0
    ("t_f8_e5m2", "F8_E5M2", [2], bytes([0x3C, 0x7C])),  # 1.0, +inf
    # ue8m0 scales 2^(e - 127): 1.0, 2^-127 (the smallest), 2^127, NaN.
    ("t_f8_e8m0", "F8_E8M0", [4], bytes([0x7F, 0x00, 0xFE, 0xFF])),
    ("t_i16", "I16", [2], struct.pack("<2h", -2, 32767)),
    ("t_u16", "U16", [2], struct.pack("<2H", 1, 65535)),
    ("t_f16", "F16", [2], struct.pack("<2e", 1.0, -2.0)),
    ("t_bf16", "BF16", [2], struct.pack("<2H", 0x3F80, 0xC020)),  # 1.0, -2.5
    ("t_i32", "I32", [2], struct.pack("<2i", -7, 2147483647)),
    ("t_u32", "U32", [1], struct.pack("<I", 4294967295)),
    ("t_f32", "F32", [2, 2], struct.pack("<4f", 1.0, -2.5, 0.0, -0.0)),
    ("t_i64", "I64", [1], struct.pack("<q", -9223372036854775808)),
    ("t_u64", "U64", [1], struct.pack("<Q", 18446744073709551615)),
    # pi, then a NaN with a payload: readers must keep bits, not values.
    ("t_f64", "F64", [2], struct.pack("<dQ", 3.141592653589793, 0x7FF8000000000001)),
]

U8_4 = bytes([10, 20, 30, 40])


def good_files():
    return {
        "good_all_dtypes.safetensors": safetensors(ALL_DTYPES, {"format": "pt"}),
        "good_empty.safetensors": safetensors([]),
        "good_scalar_and_empty.safetensors": safetensors([
            ("scalar", "F32", [], struct.pack("<f", 0.5)),
            ("empty", "F32", [0, 4], b""),
            ("bytes", "U8", [3], bytes([7, 8, 9])),
        ]),
        # Valid but not what the reference writer makes: pretty-printed,
        # keys out of data order, trailing newline and tab before the spaces.
        "good_pretty_unsorted.safetensors": raw_header(
            json.dumps({"z_first": entry("U8", [2], 0, 2),
                        "a_second": entry("U8", [2], 2, 4)}, indent=2) + "\n\t",
            U8_4),
    }


def corrupt_files():
    one_u8 = compact({"a": entry("U8", [4], 0, 4)})
    two_f32 = compact({"a": entry("F32", [2], 0, 8), "b": entry("F32", [1], 8, 12)})
    return {
        "bad_short_file.safetensors": b"\x10\x00\x00\x00\x00",
        "bad_header_length_past_end.safetensors": image(one_u8, U8_4, declared_length=1000),
        "bad_header_too_large.safetensors": image(one_u8, U8_4, declared_length=1 << 40),
        "bad_empty_header.safetensors": image(b"", U8_4, pad=False),
        "bad_truncated_data.safetensors": image(two_f32, bytes(12))[:-3],
        "bad_not_json.safetensors": raw_header("{not json}"),
        "bad_trailing_garbage.safetensors": raw_header("{} x"),
        # Padded with NULs instead of spaces (and a second object after the
        # first NUL, which a parser stopping at NUL would never see).
        "bad_nul_padding.safetensors": image(
            nul_pad(one_u8 + b"\0" + compact({"b": entry("U8", [4], 0, 4)})), U8_4, pad=False),
        "bad_not_utf8.safetensors": raw_header(b'{"__metadata__":{"k":"\xff"}}'),
        "bad_overlong_utf8.safetensors": raw_header(b'{"__metadata__":{"k":"\xc0\xaf"}}'),
        "bad_surrogate_utf8.safetensors": raw_header(b'{"__metadata__":{"k":"\xed\xa0\x80"}}'),
        "bad_top_level_array.safetensors": raw_header("[1, 2]"),
        "bad_leading_whitespace.safetensors": raw_header(" {}"),
        "bad_entry_not_object.safetensors": raw_header('{"a": 5}'),
        "bad_unknown_dtype.safetensors": raw_header(
            compact({"a": entry("Q4", [4], 0, 4)}), U8_4),
        "bad_unknown_field.safetensors": raw_header(
            compact({"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4],
                           "stride": [1]}}), U8_4),
        "bad_missing_field.safetensors": raw_header(
            compact({"a": {"dtype": "U8", "shape": [4]}}), U8_4),
        "bad_duplicate_name.safetensors": raw_header(
            '{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},'
            '"a":{"dtype":"U8","shape":[2],"data_offsets":[2,4]}}', U8_4),
        "bad_duplicate_field.safetensors": raw_header(
            '{"a":{"dtype":"U8","dtype":"I8","shape":[4],"data_offsets":[0,4]}}', U8_4),
        "bad_shape_mismatch.safetensors": raw_header(
            compact({"a": entry("F32", [2, 3], 0, 20)}), bytes(20)),
        "bad_negative_dim.safetensors": raw_header(
            compact({"a": entry("U8", [-1], 0, 4)}), U8_4),
        "bad_float_dim.safetensors": raw_header(
            '{"a":{"dtype":"U8","shape":[4.0],"data_offsets":[0,4]}}', U8_4),
        "bad_dim_over_int64.safetensors": raw_header(
            compact({"a": entry("U8", [9223372036854775808, 0], 0, 0)}), b""),
        "bad_numel_overflow.safetensors": raw_header(
            compact({"a": entry("U8", [4294967296, 4294967296], 0, 0)}), b""),
        "bad_negative_offset.safetensors": raw_header(
            compact({"a": entry("U8", [4], -4, 0)}), U8_4),
        "bad_offset_over_64_bits.safetensors": raw_header(
            '{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,18446744073709551616]}}', U8_4),
        "bad_begin_after_end.safetensors": raw_header(
            compact({"a": entry("U8", [4], 4, 0)}), U8_4),
        "bad_offsets_out_of_bounds.safetensors": raw_header(
            compact({"a": entry("U8", [100], 0, 100)}), U8_4),
        "bad_overlap.safetensors": raw_header(
            compact({"a": entry("U8", [8], 0, 8), "b": entry("U8", [8], 4, 12)}), bytes(12)),
        "bad_hole.safetensors": raw_header(
            compact({"a": entry("U8", [4], 0, 4), "b": entry("U8", [4], 8, 12)}), bytes(12)),
        "bad_first_not_at_zero.safetensors": raw_header(
            compact({"a": entry("U8", [4], 4, 8)}), bytes(8)),
        "bad_uncovered_tail.safetensors": raw_header(
            compact({"a": entry("U8", [4], 0, 4)}), bytes(8)),
        "bad_metadata_not_string.safetensors": raw_header(
            compact({"__metadata__": {"step": 7}, "a": entry("U8", [4], 0, 4)}), U8_4),
        "bad_metadata_not_object.safetensors": raw_header(
            compact({"__metadata__": ["format", "pt"]})),
        "bad_deep_nesting.safetensors": raw_header(
            '{"a":{"dtype":"U8","shape":[[4]],"data_offsets":[0,4]}}', U8_4),
    }


def index_text(index):
    """As HF writes it: json.dumps(indent=2, sort_keys=True) plus a newline."""
    return (json.dumps(index, indent=2, sort_keys=True) + "\n").encode("utf-8")


def checkpoint_dirs():
    """{dir name: {file name: bytes}} under golden/checkpoints/."""
    embed = ("model.embed.weight", "F32", [2, 2], struct.pack("<4f", 1.0, 2.0, 3.0, 4.0))
    norm = ("model.norm.weight", "BF16", [2], struct.pack("<2H", 0x3F80, 0x4000))
    head = ("lm_head.weight", "F16", [2, 2], struct.pack("<4e", 0.5, -0.5, 1.5, -1.5))
    shard1 = safetensors([embed, norm])
    shard2 = safetensors([head])
    s1, s2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    weight_map = {embed[0]: s1, norm[0]: s1, head[0]: s2}

    def indexed(weight_map, extra_files=None, metadata=None):
        files = {s1: shard1, s2: shard2}
        files.update(extra_files or {})
        meta = {"total_size": 28}
        meta.update(metadata or {})
        files["model.safetensors.index.json"] = index_text(
            {"metadata": meta, "weight_map": weight_map})
        return files

    return {
        "good_sharded": indexed(weight_map, metadata={"version": "000007"}),
        "good_single": {"model.safetensors": safetensors([embed, norm, head])},
        "bad_index_slash": indexed(dict(weight_map, **{head[0]: "sub/" + s2})),
        "bad_index_dotdot": indexed(dict(weight_map, **{head[0]: ".."})),
        "bad_index_not_string": indexed(dict(weight_map, **{head[0]: 2})),
        "bad_index_missing_shard": indexed(
            dict(weight_map, **{head[0]: "model-00003-of-00003.safetensors"})),
        "bad_index_unlisted_tensor": indexed(
            {k: v for k, v in weight_map.items() if k != norm[0]}),
        "bad_index_tensor_not_in_shard": indexed(
            dict(weight_map, **{"model.extra.weight": s2})),
        "bad_index_wrong_shard": indexed(dict(weight_map, **{norm[0]: s2})),
        "bad_index_duplicate_across_shards": indexed(
            weight_map, extra_files={s2: safetensors([head, norm])}),
        # No index: the directory's *.safetensors files are the checkpoint.
        # Hidden files (an interrupted writer's temporary) are not part of it.
        "good_unindexed": {s1: shard1, s2: shard2,
                           "." + s1 + ".tmp.4242.0": b"partial", "config.json": b"{}\n"},
        "bad_unindexed_duplicate": {s1: shard1, s2: shard2,
                                    "extra.safetensors": safetensors([norm])},
        "bad_unindexed_missing_shard": {s2: shard2},
        "bad_no_checkpoint": {"config.json": b"{}\n", "." + s1 + ".tmp.4242.0": shard1},
        # The index as HF writes it, then NULs (a file zero-filled past its end).
        "bad_index_trailing_nul": dict(
            indexed(weight_map),
            **{"model.safetensors.index.json":
               indexed(weight_map)["model.safetensors.index.json"] + b"\0" * 8}),
    }


def fuzz_seeds():
    """Whole-file images, header-mode inputs (u64 data size + JSON) and an
    index (the harness tries every input all three ways)."""
    goods = good_files()
    one_f32 = compact({"a": entry("F32", [3], 0, 12)})
    return {
        "file_all_dtypes": goods["good_all_dtypes.safetensors"],
        "file_empty": goods["good_empty.safetensors"],
        "file_scalar_and_empty": goods["good_scalar_and_empty.safetensors"],
        "file_hole": corrupt_files()["bad_hole.safetensors"],
        "header_one_f32": struct.pack("<Q", 12) + one_f32,
        "header_metadata": struct.pack("<Q", 0) + compact({"__metadata__": {"k": "v"}}),
        "index_sharded": checkpoint_dirs()["good_sharded"]["model.safetensors.index.json"],
    }


def write_tree(golden_dir, seed_dir):
    os.makedirs(golden_dir, exist_ok=True)
    for name, data in {**good_files(), **corrupt_files()}.items():
        with open(os.path.join(golden_dir, name), "wb") as f:
            f.write(data)
    for dir_name, files in checkpoint_dirs().items():
        path = os.path.join(golden_dir, "checkpoints", dir_name)
        os.makedirs(path, exist_ok=True)
        for name, data in files.items():
            with open(os.path.join(path, name), "wb") as f:
                f.write(data)
    os.makedirs(seed_dir, exist_ok=True)
    for name, data in fuzz_seeds().items():
        with open(os.path.join(seed_dir, name), "wb") as f:
            f.write(data)


def same_tree(expected, actual, ignore, allow_extra=False):
    """True when every file under `expected` exists in `actual` with the same
    bytes and, unless `allow_extra`, `actual` has no other file (names in
    `ignore` aside)."""
    comparison = filecmp.dircmp(expected, actual, ignore=ignore)
    ok = True
    for name in comparison.left_only + ([] if allow_extra else comparison.right_only):
        print("differs (present on one side only): " + os.path.join(actual, name))
        ok = False
    _, mismatch, errors = filecmp.cmpfiles(expected, actual, comparison.common_files,
                                           shallow=False)
    for name in mismatch + errors:
        print("differs: " + os.path.join(actual, name))
        ok = False
    for sub in comparison.common_dirs:
        ok &= same_tree(os.path.join(expected, sub), os.path.join(actual, sub), ignore,
                        allow_extra)
    return ok


def main(argv):
    if argv[1:] == ["--check"]:
        with tempfile.TemporaryDirectory() as tmp:
            golden, seeds = os.path.join(tmp, "golden"), os.path.join(tmp, "seeds")
            write_tree(golden, seeds)
            ok = same_tree(golden, GOLDEN_DIR, ["README.md", "make_golden.py", "__pycache__"])
            # A fuzzing run adds its finds to the corpus (git ignores them).
            ok &= same_tree(seeds, SEED_DIR, [], allow_extra=True)
        print("golden files are up to date" if ok else "golden files are stale: rerun make_golden.py")
        return 0 if ok else 1
    if argv[1:]:
        print(__doc__)
        return 2
    write_tree(GOLDEN_DIR, SEED_DIR)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
