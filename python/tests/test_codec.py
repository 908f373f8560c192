"""diff, encode and decode_apply on numpy arrays and torch tensors, and the
errors bad input gets."""

import numpy as np
import pytest
import torch

import deltasync as ds


def changed_pair(dtype=np.float32, n=1000, seed=0):
    rng = np.random.default_rng(seed)
    base = rng.standard_normal(n).astype(dtype)
    cur = base.copy()
    idx = rng.choice(n, n // 50, replace=False)
    cur[idx] += 1
    return base, cur, np.sort(idx)


def test_diff_finds_exactly_the_changed_elements_and_refreshes():
    base, cur, idx = changed_pair()
    ch = ds.diff(cur, base)
    assert ch.positions.dtype == np.uint64
    assert np.array_equal(ch.positions, idx)
    assert ch.values == cur[idx].tobytes()
    ds.diff(cur, base, refresh=True)
    assert np.array_equal(base, cur)
    assert len(ds.diff(cur, base).positions) == 0


def test_diff_is_bitwise_nan_and_signed_zero_count():
    base = np.array([np.nan, 0.0, 1.0], dtype=np.float32)
    cur = np.array([np.nan, -0.0, 1.0], dtype=np.float32)
    assert list(ds.diff(cur, base).positions) == [1]


@pytest.mark.parametrize("encoding", ds.encodings())
def test_every_encoding_round_trips(encoding):
    base, cur, _ = changed_pair(seed=1)
    enc = ds.encode(cur, base, encoding)
    target = base.copy()
    ds.decode_apply(enc, target, encoding)
    assert target.tobytes() == cur.tobytes()


def test_bf16_torch_tensors_and_raw_numpy_agree():
    t = torch.randn(32, 16).to(torch.bfloat16)
    u = t.clone()
    u[3, 4] = float("nan")
    enc = ds.encode(u, t, "sparse")
    raw_base = ds.Raw(t.view(torch.int16).numpy().view(np.uint16).copy(), "BF16")
    raw_cur = ds.Raw(u.view(torch.int16).numpy().view(np.uint16).copy(), "BF16")
    assert ds.encode(raw_cur, raw_base, "sparse") == enc
    back = t.clone()
    ds.decode_apply(enc, back, "sparse")
    assert torch.equal(back.view(torch.int16), u.view(torch.int16))
    pos, val = ds.diff(u, t).as_torch(torch.bfloat16)
    assert pos.tolist() == [3 * 16 + 4] and torch.isnan(val.float()).all()


def test_bad_input_names_the_tensor_and_the_problem():
    a = np.zeros(10, np.float32)
    with pytest.raises(ds.InvalidArgumentError, match="dtypes and shapes must match"):
        ds.diff(a, np.zeros(10, np.float64))
    with pytest.raises(ds.InvalidArgumentError, match="dtypes and shapes must match"):
        ds.diff(a, np.zeros(11, np.float32))
    with pytest.raises(ds.InvalidArgumentError, match="'w': not contiguous"):
        ds.diff(torch.zeros(4, 4).t(), torch.zeros(4, 4), name="w")
    with pytest.raises(ds.InvalidArgumentError, match="not C-contiguous"):
        ds.diff(np.zeros((4, 4), np.float32)[:, ::2], np.zeros((4, 2), np.float32))
    ro = np.zeros(10, np.float32)
    ro.flags.writeable = False
    with pytest.raises(ds.InvalidArgumentError, match="read-only"):
        ds.diff(a, ro, refresh=True)
    with pytest.raises(ds.InvalidArgumentError, match="read-only"):
        ds.decode_apply(b"", ro, "sparse")
    with pytest.raises(ds.UnsupportedError, match="complex"):
        ds.diff(np.zeros(2, np.complex64), np.zeros(2, np.complex64))
    with pytest.raises(ds.InvalidArgumentError):
        ds.encode(a, a, "no-such-encoding")
    with pytest.raises(ds.InvalidArgumentError, match="expected a torch tensor or numpy array"):
        ds.diff([1, 2, 3], a)
    with pytest.raises(ds.InvalidArgumentError, match="Raw"):
        ds.Raw(np.zeros(2, np.float32), "BF16")


def test_tensors_read_in_one_call_are_what_the_python_reader_reads():
    """The extension reads a call's dense host tensors itself (the size from
    the shape and dtype); every field must be what deltasync._tensors.arg
    reads, and what the extension does not take must still reach arg's
    errors."""
    from deltasync import _deltasync, _tensors

    base = torch.arange(40, dtype=torch.float32)
    tensors = {
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "empty": torch.zeros(0, 7, dtype=torch.bfloat16),
        "offset_view": base[5:25].view(4, 5),
        "param": torch.nn.Parameter(torch.ones(3, 2, dtype=torch.float16)),
        "bytes": torch.zeros(9, dtype=torch.uint8),
        "flags": torch.zeros(2, 3, dtype=torch.bool),
        "numpy": np.zeros((2, 2), np.int64),
        "raw": ds.Raw(np.zeros(6, np.uint16), "BF16"),
    }
    pairs = _tensors.named(tensors)
    fast = _deltasync.args_from_pairs(pairs, _tensors.arg)
    for (name, obj), got in zip(pairs, fast):
        want = _tensors.arg(name, obj)
        assert (got.name, got.dtype, list(got.shape), got.ptr, got.nbytes, got.device) == (
            want.name, want.dtype, list(want.shape), want.ptr, want.nbytes, want.device), name
    assert fast[2].ptr == base.data_ptr() + 5 * 4 and fast[2].nbytes == 80
    assert fast[0].nbytes == 8 and fast[1].nbytes == 0
    with pytest.raises(ds.InvalidArgumentError, match="'t': not contiguous"):
        _deltasync.args_from_pairs([("t", torch.zeros(4, 4).t())], _tensors.arg)
    with pytest.raises(ds.UnsupportedError, match="'c': dtype torch.complex64"):
        _deltasync.args_from_pairs([("c", torch.zeros(2, dtype=torch.complex64))], _tensors.arg)
    with pytest.raises(ds.InvalidArgumentError, match="'s': a torch.sparse_coo tensor"):
        _deltasync.args_from_pairs([("s", torch.zeros(3).to_sparse())], _tensors.arg)


def test_corrupt_encoding_is_refused_and_target_unchanged():
    base, cur, _ = changed_pair(seed=2)
    enc = bytearray(ds.encode(cur, base, "sparse"))
    enc[len(enc) // 2] ^= 0xFF
    target = base.copy()
    with pytest.raises(ds.DeltasyncError, match="target"):
        ds.decode_apply(bytes(enc), target, "sparse")
    assert target.tobytes() == base.tobytes()
    with pytest.raises(ds.DeltasyncError):
        ds.decode_apply(b"\x00" * 7, target, "indices")


def test_errors_are_the_builtin_kinds_callers_catch():
    assert issubclass(ds.InvalidArgumentError, ValueError)
    assert issubclass(ds.NotFoundError, LookupError)
    assert issubclass(ds.DeadlineExceededError, TimeoutError)
    assert issubclass(ds.UnavailableError, ConnectionError)
    assert ds.error_for_code(3) is ds.CorruptionError
    assert ds.error_for_code(99) is ds.DeltasyncError
    assert ds.dtype_size("BF16") == 2
    with pytest.raises(ds.UnsupportedError):
        ds.dtype_size("F7")
