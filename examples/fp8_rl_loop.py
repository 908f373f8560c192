#!/usr/bin/env python3
"""The real-model loop in FP8: a BF16-trained model synced every step to a
rollout copy that holds block-scaled FP8 weights, the trainer's sender
quantizing (``StreamSender(quantize=...)``).

The model, corpus and optimizer are examples/rl_loop.py's (a Qwen2.5-shaped
causal LM from a config, fp32 masters, AdamW on this machine's text, BF16
weights after every step). Every linear layer's weight (q/k/v/o, gate, up,
down) is sent as FP8 E4M3 codes with one ue8m0 scale per 128 x 128 block,
DeepSeek-V3's `weight_scale_inv` layout, quantized by the sender exactly as
vLLM's and SGLang's DeepGEMM `per_block_cast_to_fp8` does; embeddings,
norms and biases go as BF16. The rollout process receives into host
memory. After every sync:

* the rollout's codes and scales are bit-identical to
  ``deltasync.quantize_fp8`` of the trainer's BF16 weights (a BLAKE2b hash
  of every tensor on each side);
* both sides dequantize the FP8 weights into a BF16 model (code * scale)
  and greedy generation from fixed prompts gives identical tokens.

Measured per step: the FP8 change density (codes and scales) next to the
BF16 one, the sync's bytes and time; and the bytes per changed element of
each encoding between steps 2 and 3 (`deltasync diff` of FP8 and of BF16
checkpoints of those steps).

Usage (from a checkout, after scripts/gpu-build):
  PYTHONPATH=build/gpu/python python3 examples/fp8_rl_loop.py --out /tmp/fp8 [--steps 8]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import rl_loop as base  # noqa: E402  (sets the deterministic cuBLAS workspace)

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import deltasync as ds  # noqa: E402

RECIPE = ("block128", "ue8m0")


def quantized_names(names) -> list:
    return [n for n in names if n.endswith("_proj.weight")]


def digests(tensors: dict) -> dict:
    return {n: hashlib.blake2b(t.contiguous().view(torch.uint8).numpy().data).hexdigest()
            for n, t in tensors.items()}


def dequantize(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Block-scaled E4M3 codes (uint8 [M, N]) times their ue8m0 scales
    (uint8 [ceil(M/128), ceil(N/128)]: 2^(byte - 127)), as BF16 on the GPU."""
    m, n = codes.shape
    x = codes.cuda().view(torch.float8_e4m3fn).float()
    s = torch.pow(2.0, scales.cuda().float() - 127.0)
    s = s.repeat_interleave(128, 0).repeat_interleave(128, 1)[:m, :n]
    return (x * s).to(torch.bfloat16)


def fp8_model_weights(held: dict, qnames: list) -> dict:
    """The BF16 weights an FP8 engine computes with: each quantized weight
    dequantized, the others as they are."""
    out = {}
    for n in qnames:
        out[n] = dequantize(held[n], held[n + "_scale_inv"])
    for n, t in held.items():
        if n not in out and not n.endswith("_scale_inv"):
            out[n] = t.cuda()
    return out


def layout(model) -> dict:
    """What the rollout holds, in host memory: uint8 codes and scales for
    the quantized weights, BF16 for the rest."""
    held = {}
    params = dict(model.named_parameters())
    for n in quantized_names(params):
        m, k = params[n].shape
        held[n] = torch.zeros(m, k, dtype=torch.uint8)
        held[n + "_scale_inv"] = torch.zeros(-(-m // 128), -(-k // 128), dtype=torch.uint8)
    for n, p in params.items():
        if n not in held:
            held[n] = torch.zeros(p.shape, dtype=torch.bfloat16)
    return held


def rollout(preset, rdv, to_rollout, to_trainer):
    torch.use_deterministic_algorithms(True, warn_only=True)
    model = base.build_model(preset, torch.bfloat16)
    held = layout(model)
    qnames = quantized_names(dict(model.named_parameters()))
    rx = ds.StreamReceiver(ds.Group(rdv, 1, 2, timeout_s=600))
    for n, t in held.items():
        if n in qnames:
            rx.register(n, t, runs=[(0, t.numel(), 0, 1)], shape=list(t.shape), dtype="F8_E4M3")
        elif n.endswith("_scale_inv"):
            rx.register(n, t, runs=[(0, t.numel(), 0, 1)], shape=list(t.shape), dtype="F8_E8M0")
        else:
            rx.register(n, t)
    to_trainer.put("ready")
    while to_rollout.get() == "sync":
        stats = rx.receive()
        base.load_into(model, fp8_model_weights(held, qnames))
        to_trainer.put((stats, digests(held), base.generate(model)))
    rx.close()


def save_fp8(tensors: dict, d: str) -> None:
    """A checkpoint of codes (F8_E4M3) and scales (F8_E8M0, or their bytes
    where this safetensors lacks the type)."""
    from safetensors.torch import save_file

    os.makedirs(d, exist_ok=True)
    codes = {n: t.view(torch.float8_e4m3fn) for n, t in tensors.items()
             if not n.endswith("_scale_inv")}
    scales = {n: t for n, t in tensors.items() if n.endswith("_scale_inv")}
    e8m0 = getattr(torch, "float8_e8m0fnu", None)
    path = os.path.join(d, "model.safetensors")
    try:
        save_file({**codes, **{n: t.view(e8m0) for n, t in scales.items()}}, path)
    except Exception:  # a safetensors without F8_E8M0: the same bytes as U8
        save_file({**codes, **scales}, path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="0.5b", choices=sorted(base.PRESETS))
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--out", required=True)
    ap.add_argument("--cli", default=os.path.join(base.ROOT, "build", "gpu", "deltasync"))
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    torch.use_deterministic_algorithms(True, warn_only=True)
    work = tempfile.mkdtemp(prefix="fp8-loop-")
    rdv = "file:" + os.path.join(work, "rdv")
    ctx = mp.get_context("spawn")
    to_rollout, to_trainer = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=rollout, args=(args.preset, rdv, to_rollout, to_trainer))
    proc.start()

    master = base.build_model(args.preset, torch.float32)
    master.train()
    shadow = base.build_model(args.preset, torch.bfloat16)
    qnames = quantized_names(dict(master.named_parameters()))
    opt = torch.optim.AdamW(master.parameters(), lr=args.lr, betas=(0.9, 0.999), weight_decay=0.0)
    corpus = base.text_corpus(64 << 20).cuda()
    g = torch.Generator(device="cuda").manual_seed(1)
    tx = ds.StreamSender(ds.Group(rdv, 0, 2, timeout_s=600), encoding="indices",
                         quantize={n: RECIPE for n in qnames})
    report = {"preset": args.preset, "lr": args.lr, "recipe": RECIPE, "steps": []}
    failures = []
    if to_trainer.get() != "ready":
        raise RuntimeError("the rollout did not start")

    def host_bf16() -> dict:
        return {n: p.detach().to(torch.bfloat16).cpu() for n, p in master.named_parameters()}

    def expected(bf: dict) -> dict:
        """What quantizing the trainer's weights directly gives."""
        out = {}
        for n, t in bf.items():
            if n in qnames:
                codes, scales = ds.quantize_fp8(t, *RECIPE)
                out[n] = torch.from_numpy(codes)
                out[n + "_scale_inv"] = torch.from_numpy(scales)
            else:
                out[n] = t
        return out

    def sync_and_check(bf: dict, label: str):
        to_rollout.put("sync")
        stats = tx.sync(bf)
        want = expected(bf)
        base.load_into(shadow, fp8_model_weights(want, qnames))
        gen = base.generate(shadow)
        r_stats, r_digests, r_gen = to_trainer.get()
        ok_bits, ok_gen = r_digests == digests(want), r_gen == gen
        if not (ok_bits and ok_gen):
            failures.append(f"{label}: bits {ok_bits}, generations {ok_gen}")
        return stats, r_stats, want, ok_bits, ok_gen

    bf = host_bf16()
    seed, _, prev_q, ok_bits, ok_gen = sync_and_check(bf, "seed")
    report["seed"] = {"total_s": seed["total_s"], "bytes_sent": seed["bytes_sent"],
                      "bits_equal": ok_bits, "generations_equal": ok_gen}
    prev_bf = bf
    codes_total = sum(prev_q[n].numel() for n in qnames)
    scales_total = sum(prev_q[n + "_scale_inv"].numel() for n in qnames)
    for step in range(1, args.steps + 1):
        loss = base.train_step(master, opt, corpus, g, args.batch, args.seq)
        bf = host_bf16()
        t0 = time.perf_counter()
        stats, r_stats, q, ok_bits, ok_gen = sync_and_check(bf, f"step {step}")
        elapsed = time.perf_counter() - t0
        bf16_changed = sum(int((bf[n].view(torch.int16) != prev_bf[n].view(torch.int16)).sum())
                           for n in qnames)
        codes_changed = sum(int((q[n] != prev_q[n]).sum()) for n in qnames)
        scales_changed = sum(int((q[n + "_scale_inv"] != prev_q[n + "_scale_inv"]).sum())
                             for n in qnames)
        entry = {"step": step, "loss": loss,
                 "bf16_density": bf16_changed / codes_total,
                 "fp8_code_density": codes_changed / codes_total,
                 "scale_density": scales_changed / scales_total,
                 "sync": {k: stats[k] for k in ("total_s", "quantize_s", "diff_s", "encode_s",
                                                 "transfer_s", "changed", "bytes_sent",
                                                 "sent_elements")},
                 "receiver_apply_s": r_stats["apply_s"], "sync_and_checks_s": elapsed,
                 "bits_equal": ok_bits, "generations_equal": ok_gen}
        report["steps"].append(entry)
        print(f"step {step}: loss {entry['loss']:.3f} bf16 {entry['bf16_density']:.3%} "
              f"fp8 codes {entry['fp8_code_density']:.3%} scales {entry['scale_density']:.3%} "
              f"sync {stats['total_s'] * 1e3:.0f} ms {stats['bytes_sent'] / 1e6:.1f} MB "
              f"bits {ok_bits} gen {ok_gen}", flush=True)
        if step in (2, 3):
            save_fp8({n: t for n, t in q.items() if n in qnames or n.endswith("_scale_inv")},
                     os.path.join(work, "fp8", f"step_{step:06d}"))
            base.save_checkpoint({n: bf[n] for n in qnames},
                                 os.path.join(work, "bf16", f"step_{step:06d}"))
        prev_bf, prev_q = bf, q
    to_rollout.put("stop")
    proc.join()
    if args.steps >= 3:
        # Only the quantized weights: both diffs cover the same elements.
        report["diff_fp8"] = base.cli_diff(args.cli, os.path.join(work, "fp8", "step_000002"),
                                           os.path.join(work, "fp8", "step_000003"))
        report["diff_bf16"] = base.cli_diff(args.cli, os.path.join(work, "bf16", "step_000002"),
                                            os.path.join(work, "bf16", "step_000003"))
    report["failures"] = failures
    with open(os.path.join(args.out, "report.json"), "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps({k: report[k] for k in ("diff_fp8", "diff_bf16") if k in report}, indent=1))
    print("failures:", failures)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
