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
    print(json.dumps({
        "bytes": args.bytes, "changed": changed, "torch_diff_device_s": t_device,
        "torch_diff_pinned_s": t_pinned, "torch_index_put_s": t_apply, "torch_copy_s": t_copy,
        "torch": torch.__version__,
    }))


if __name__ == "__main__":
    main()
