"""diff, encode and decode_apply on numpy arrays and torch tensors, and the
errors bad input gets."""

import numpy as np
import pytest
import torch

import deltasync as ds
from deltasync._tensors import dtype_name


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


# FP8: E4M3 weights with E8M0 ("ue8m0") block scales, as block-scaled FP8
# checkpoints store them. torch has float8_e4m3fn and float8_e5m2 from 2.1
# and float8_e8m0fnu from 2.7; without them the bytes travel as uint8 views
# named by Raw.
FP8_TORCH = [("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2"),
             ("F8_E8M0", "float8_e8m0fnu")]


def fp8_layer(seed):
    """(weight codes [256, 256], scale codes [2, 2]) as uint8, and the next
    step's: ~3% of the weight codes move by one, one block's scale doubles."""
    rng = np.random.default_rng(seed)
    w = rng.integers(0, 256, (256, 256), dtype=np.uint8)
    s = rng.integers(110, 120, (2, 2), dtype=np.uint8)
    w2 = w.copy()
    flip = rng.random(w.shape) < 0.03
    w2[flip] ^= 1
    s2 = s.copy()
    s2[1, 1] += 1
    return w, s, w2, s2


@pytest.mark.parametrize("encoding", ds.encodings())
def test_fp8_as_raw_uint8_views_round_trips_bit_exactly(encoding):
    assert [ds.dtype_size(code) for code, _ in FP8_TORCH] == [1, 1, 1]
    w, s, w2, s2 = fp8_layer(3)
    for code, base, cur in (("F8_E4M3", w, w2), ("F8_E8M0", s, s2)):
        enc = ds.encode(ds.Raw(cur, code), ds.Raw(base, code), encoding)
        target = base.copy()
        ds.decode_apply(enc, ds.Raw(target, code), encoding)
        assert target.tobytes() == cur.tobytes(), code
        # The same bytes as uint8 torch tensors: a torch without float8 types.
        target_t = torch.from_numpy(base.copy())
        enc_t = ds.encode(ds.Raw(torch.from_numpy(cur), code),
                          ds.Raw(torch.from_numpy(base), code), encoding)
        assert enc_t == enc
        ds.decode_apply(enc_t, ds.Raw(target_t, code), encoding)
        assert target_t.numpy().tobytes() == cur.tobytes(), code


def test_raw_refuses_a_tensor_of_another_item_size():
    with pytest.raises(ds.InvalidArgumentError, match="2-byte items, F8_E8M0 has 1"):
        ds.Raw(torch.zeros(4, dtype=torch.int16), "F8_E8M0")


@pytest.mark.parametrize("code,name", FP8_TORCH)
def test_fp8_torch_dtypes_map_both_ways(code, name):
    from deltasync.adapters.engine import torch_dtype

    dt = getattr(torch, name, None)
    if dt is None:
        pytest.skip(f"torch {torch.__version__} has no torch.{name}")
    assert dtype_name(torch.empty(2, dtype=dt)) == code
    assert torch_dtype(code) is dt
    w, s, w2, s2 = fp8_layer(5)
    base, cur = (s, s2) if code == "F8_E8M0" else (w, w2)
    tb = torch.from_numpy(base.copy()).view(dt)
    tc = torch.from_numpy(cur.copy()).view(dt)
    for encoding in ds.encodings():
        enc = ds.encode(tc, tb, encoding)
        assert enc == ds.encode(ds.Raw(cur, code), ds.Raw(base, code), encoding), encoding
        target = tb.clone()
        ds.decode_apply(enc, target, encoding)
        assert target.view(torch.uint8).numpy().tobytes() == cur.tobytes(), encoding
    pos, val = ds.diff(tc, tb).as_torch(dt)
    assert val.dtype == dt
    assert torch.equal(val.view(torch.uint8), tc.view(torch.uint8).reshape(-1)[pos])


@pytest.mark.parametrize("code,name", FP8_TORCH)
def test_fp8_without_the_torch_dtype_points_to_raw(code, name):
    from deltasync.adapters.engine import torch_dtype

    if hasattr(torch, name):
        pytest.skip(f"torch {torch.__version__} has torch.{name}")
    with pytest.raises(ds.InvalidArgumentError, match=f"torch.{name}.*Raw"):
        torch_dtype(code)


def test_fp8_safetensors_files_keep_every_bit(tmp_path):
    import st_io

    w, s, _, _ = fp8_layer(7)
    scale = torch.tensor(0.0123, dtype=torch.float32)
    tensors = {"l.weight": ds.Raw(torch.from_numpy(w), "F8_E4M3"),
               "l.weight_scale_inv": ds.Raw(torch.from_numpy(s), "F8_E8M0"),
               "l.input_scale": scale}
    st_io.write(tmp_path / "fp8.safetensors", tensors)
    back = st_io.read(tmp_path / "fp8.safetensors")
    for name, want in (("l.weight", w), ("l.weight_scale_inv", s)):
        got = back[name]
        got = got.array if isinstance(got, ds.Raw) else got.view(torch.uint8)
        assert got.numpy().tobytes() == want.tobytes(), name
        assert dtype_name(back[name]) == dtype_name(tensors[name])
    assert back["l.input_scale"].view(torch.int32).item() == scale.view(torch.int32).item()


# ---------------------------------------------------------------------------
# quantize_fp8: against an independent numpy reference of the engines'
# recipes everywhere, and against the engines' own torch statements
# (vllm/utils/deep_gemm.py per_block_cast_to_fp8 @ 779d1fc1; vLLM's
# per-tensor and SGLang's per-channel kernels as torch ops) on a GPU, where
# the engines run them: torch divides a CUDA tensor by a Python number as a
# multiply by the float32 reciprocal (aten/src/ATen/native/cuda/
# BinaryDivTrueKernel.cu), so `amax / 448.0` there is `amax * (1/448)`.

def _e4m3_values():
    """The 127 positive finite E4M3 values, by code (0x00..0x7E)."""
    out = []
    for c in range(0x7F):
        e, m = (c >> 3) & 0xF, c & 7
        out.append((m / 8) * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
    return np.array(out)


def _e4m3_encode(y):
    """Nearest E4M3 code of float32 y (|y| <= 448), ties to the even code."""
    table = _e4m3_values()
    a = np.abs(y.astype(np.float64))
    lo = np.searchsorted(table, a, side="right") - 1
    hi = np.minimum(lo + 1, 0x7E)
    below, above = a - table[lo], table[hi] - a
    pick = np.where(below < above, lo, np.where(above < below, hi, np.where(lo % 2 == 1, hi, lo)))
    pick = np.where(lo == 0x7E, 0x7E, pick)
    return (pick | np.where(np.signbit(y), 0x80, 0)).astype(np.uint8)


def _bf16_weight(rows, cols, seed):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((rows, cols)) * 0.02).astype(np.float32)
    x[0, 0] = 0.3  # one block with a larger range
    bits = x.view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def _reference(u16, scheme, scale_format):
    x = (u16.astype(np.uint32) << 16).view(np.float32)
    m, n = x.shape
    f448 = np.float32(448)
    if scheme == "block128":
        mb, nb = -(-m // 128), -(-n // 128)
        padded = np.zeros((mb * 128, nb * 128), np.float32)
        padded[:m, :n] = x
        amax = np.abs(padded).reshape(mb, 128, nb, 128).max(axis=(1, 3))
        sf = np.maximum(amax, np.float32(1e-4)) * (np.float32(1) / f448)
        if scale_format != "f32":
            frac, exp = np.frexp(sf)  # sf = frac * 2^exp, frac in [0.5, 1)
            sf = np.ldexp(np.float32(1), np.where(frac == 0.5, exp - 1, exp)).astype(np.float32)
        inv = np.float32(1) / sf
        y = x * np.repeat(np.repeat(inv, 128, 0), 128, 1)[:m, :n]
    elif scheme == "per_tensor":
        sf = np.array([np.abs(x).max() / f448], np.float32)
        y = x * (np.float32(1) / sf[0])
    else:
        sf = (np.maximum(np.abs(x).max(axis=1), np.float32(1e-10)) * (np.float32(1) / f448))[:, None]
        y = x * (np.float32(1) / sf)
    codes = _e4m3_encode(np.clip(y, -f448, f448).astype(np.float32))
    if scale_format == "ue8m0":
        sf = (sf.view(np.uint32) >> 23).astype(np.uint8)
    return codes, sf


QUANT_CASES = [("block128", "f32"), ("block128", "ue8m0_f32"), ("block128", "ue8m0"),
               ("per_tensor", "f32"), ("per_channel", "f32")]


@pytest.mark.parametrize("scheme,scale_format", QUANT_CASES)
def test_quantize_fp8_matches_the_recipes_reference(scheme, scale_format):
    w = _bf16_weight(300, 200, 5)
    codes, scales = ds.quantize_fp8(ds.Raw(w, "BF16"), scheme, scale_format)
    want_codes, want_scales = _reference(w, scheme, scale_format)
    assert codes.shape == w.shape and codes.dtype == np.uint8
    assert scales.shape == want_scales.shape
    assert np.array_equal(scales, want_scales)
    assert np.array_equal(codes, want_codes)


def test_quantize_fp8_refuses_bad_input():
    w = _bf16_weight(4, 4, 1)
    with pytest.raises(ds.InvalidArgumentError, match="scheme"):
        ds.quantize_fp8(ds.Raw(w, "BF16"), "per_block")
    with pytest.raises(ds.InvalidArgumentError):
        ds.quantize_fp8(ds.Raw(w, "BF16"), "per_tensor", "ue8m0")
    with pytest.raises(ds.InvalidArgumentError, match="2-D"):
        ds.quantize_fp8(ds.Raw(w.reshape(-1), "BF16"))
    bad = np.ones((4, 4), np.float32)
    bad[2, 1] = np.nan
    with pytest.raises(ds.InvalidArgumentError, match="weight"):
        ds.quantize_fp8(bad)
    with pytest.raises(ds.InvalidArgumentError):
        ds.quantize_fp8(np.ones((4, 4), np.int32))


@pytest.mark.skipif(not hasattr(torch, "float8_e4m3fn") or not torch.cuda.is_available(),
                    reason="needs torch's float8 types and a GPU")
@pytest.mark.parametrize("scheme,scale_format", QUANT_CASES)
@pytest.mark.parametrize("shape", [(300, 200), (1024, 896), (129, 1)])
def test_quantize_fp8_equals_the_engines_torch_code(scheme, scale_format, shape):
    w = _bf16_weight(*shape, 7)
    x = torch.from_numpy(w.view(np.int16)).view(torch.bfloat16).cuda()
    m, n = shape
    if scheme == "block128":
        # per_block_cast_to_fp8's statements, eagerly.
        # On the GPU, as the engines run it: there torch divides by the
        # scalar 448.0 as a product with its float32 reciprocal (a CPU
        # tensor would divide, an ULP away for about a third of amaxes).
        padded = torch.zeros((-(-m // 128) * 128, -(-n // 128) * 128), dtype=x.dtype,
                             device=x.device)
        padded[:m, :n] = x
        view = padded.view(-1, 128, padded.size(1) // 128, 128)
        amax = view.abs().float().amax(dim=(1, 3), keepdim=True).clamp(1e-4)
        sf = amax / 448.0
        if scale_format != "f32":
            sf = torch.pow(2.0, torch.ceil(torch.log2(sf.abs())))
        q = (view * (1.0 / sf)).to(torch.float8_e4m3fn)
        want_codes = q.view_as(padded)[:m, :n].contiguous()
        want_scales = sf.view(view.size(0), view.size(2))
    elif scheme == "per_tensor":
        # vLLM's kernel divides (rowmax / 448 in CUDA C++: IEEE division);
        # a CUDA tensor divided by a CUDA tensor divides too.
        amax = x.abs().max().float()
        sf = (amax / torch.full_like(amax, 448.0)).reshape(1)
        want_codes = (x.float() * (1.0 / sf)).clamp(-448, 448).to(torch.float8_e4m3fn)
        want_scales = sf
    else:
        sf = (x.abs().float().amax(dim=1, keepdim=True).clamp(min=1e-10)) / 448.0
        want_codes = (x.float() * (1.0 / sf)).clamp(-448, 448).to(torch.float8_e4m3fn)
        want_scales = sf
    codes, scales = ds.quantize_fp8(x.cpu(), scheme, scale_format)
    assert np.array_equal(codes, want_codes.view(torch.uint8).cpu().numpy())
    want_scales = want_scales.cpu()
    if scale_format == "ue8m0":
        assert np.array_equal(scales, want_scales.to(torch.float8_e8m0fnu).view(torch.uint8).numpy())
    else:
        assert np.array_equal(scales, want_scales.numpy())
