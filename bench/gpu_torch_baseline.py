#!/usr/bin/env python3
"""The torch-op pipeline that trainers use today to find and apply a BF16
delta on the GPU, timed for `deltasync bench --gpu` (which runs this script
on the same GPU in the same run and prints the ratios):

  diff, snapshot on the device:  new.view(int16) != snap.view(int16),
                                 nonzero, index the new values, snap.copy_(new)
  diff, snapshot in pinned host memory: the snapshot copied in (H2D), the
                                 same ops, then the whole new tensor copied
                                 back out (D2H)
  apply:                         dest.view(-1).index_put_((idx,), values)
  copy:                          dest.copy_(new), device to device
  quantize then diff:            a [bytes / 8192, 4096] BF16 weight quantized
                                 to FP8 as vLLM's and SGLang's DeepGEMM
                                 `per_block_cast_to_fp8` does (128 x 128
                                 blocks, ue8m0 scales), then the diff ops
                                 above on the codes and on the scales

Prints one JSON object: median seconds of each over --repeat runs.
"""
import argparse
import json
import statistics
import time

import torch


def timed(fn, repeat):
    fn()  # warm-up
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def per_block_cast_to_fp8(x):
    """DeepGEMM's block quantization as vLLM (vllm/utils/deep_gemm.py @
    779d1fc154ee91e5decea00ab46e4ba6532c45e9) and SGLang
    (python/sglang/srt/layers/quantization/fp8_utils.py @
    6082c49139ac8f1c99a835840de73971faa15e8e) run it, ue8m0 scales: pad to
    whole 128 x 128 blocks, amax clamped at 1e-4, / 448, rounded up to a
    power of two, codes of x * (1 / scale)."""
    m, n = x.shape
    pm, pn = -(-m // 128) * 128, -(-n // 128) * 128
    padded = torch.zeros((pm, pn), dtype=x.dtype, device=x.device)
    padded[:m, :n] = x
    view = padded.view(-1, 128, pn // 128, 128)
    amax = view.abs().float().amax(dim=(1, 3), keepdim=True).clamp(1e-4)
    sf = torch.pow(2.0, torch.ceil(torch.log2(amax / 448.0)))
    codes = (view * (1.0 / sf)).to(torch.float8_e4m3fn)
    return codes.view_as(padded)[:m, :n].contiguous(), sf.view(view.size(0), view.size(2))


def time_quantize_diff(args, dev, g):
    """Quantize a BF16 weight step, then find the changed codes and scales
    against snapshots of both and refresh them."""
    cols = 4096
    rows = args.bytes // 2 // cols
    w = (torch.randn(rows, cols, device=dev, generator=g) * 0.02).to(torch.bfloat16)
    flip = torch.rand(rows, cols, device=dev, generator=g) < args.density
    w2 = torch.where(flip, (w.view(torch.int16) ^ 1).view(torch.bfloat16), w)
    del flip
    weights = [w, w2]
    codes, sf = per_block_cast_to_fp8(w)
    snap_codes, snap_sf = codes.view(torch.uint8).clone(), sf.clone()
    state = {"k": 1}

    def step():
        c, s = per_block_cast_to_fp8(weights[state["k"]])
        state["k"] ^= 1
        c = c.view(torch.uint8)
        ci = (c != snap_codes).view(-1).nonzero().squeeze(1)
        cv = c.view(-1)[ci]
        si = (s != snap_sf).view(-1).nonzero().squeeze(1)
        sv = s.view(-1)[si]
        snap_codes.copy_(c)
        snap_sf.copy_(s)
        return ci, cv, si, sv

    return timed(step, args.repeat)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bytes", type=int, required=True)
    ap.add_argument("--density", type=float, required=True)
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    dev = torch.device("cuda")
    n = args.bytes // 2
    g = torch.Generator(device=dev)
    g.manual_seed(args.seed)
    a = torch.randint(-32768, 32768, (n,), dtype=torch.int16, device=dev, generator=g)
    flip = torch.rand(n, device=dev, generator=g) < args.density
    b = torch.where(flip, a ^ 0x15, a)
    del flip
    new = [a.view(torch.bfloat16), b.view(torch.bfloat16)]
    snap = a.clone().view(torch.bfloat16)
    state = {"k": 1}

    def diff_device():
        cur = new[state["k"]]
        state["k"] ^= 1
        mask = cur.view(torch.int16) != snap.view(torch.int16)
        idx = mask.nonzero().squeeze(1)
        vals = cur[idx]
        snap.copy_(cur)
        return idx, vals

    t_device = timed(diff_device, args.repeat)
    idx, vals = diff_device()
    changed = int(idx.numel())

    snap_host = torch.empty(n, dtype=torch.bfloat16, pin_memory=True)
    snap_host.copy_(new[state["k"] ^ 1])

    def diff_pinned():
        cur = new[state["k"]]
        state["k"] ^= 1
        s = snap_host.to(dev, non_blocking=True)
        mask = cur.view(torch.int16) != s.view(torch.int16)
        i = mask.nonzero().squeeze(1)
        v = cur[i]
        snap_host.copy_(cur, non_blocking=True)
        return i, v

    t_pinned = timed(diff_pinned, args.repeat)
    del snap_host

    dest = new[0].clone()
    t_apply = timed(lambda: dest.index_put_((idx,), vals), args.repeat)
    t_copy = timed(lambda: dest.copy_(new[1]), args.repeat)
    del a, b, new, snap, idx, vals, dest
    t_quant = time_quantize_diff(args, dev, g)
    print(json.dumps({
        "bytes": args.bytes, "changed": changed, "torch_diff_device_s": t_device,
        "torch_diff_pinned_s": t_pinned, "torch_index_put_s": t_apply, "torch_copy_s": t_copy,
        "torch_quant_diff_s": t_quant,
        "torch": torch.__version__,
    }))


if __name__ == "__main__":
    main()
