#!/usr/bin/env python3
"""A real model, really trained, kept in sync on one GPU through deltasync.

A transformers Qwen2 causal LM (random init from a config: no weights can be
downloaded) is trained with AdamW on real text (files found on this machine,
tokenized at the byte level), fp32 master weights cast to BF16 for the
rollout, as RL trainers do. After every optimizer step the BF16 weights are
synced to a second copy of the model (the "rollout") in another process on
the same GPU, through deltasync's stream (gloo, staged through pinned
memory; the CUDA kernels diff and apply). After every sync:

* every rollout parameter is bit-identical to the trainer's BF16 weights
  (two independent 64-bit hashes per tensor, computed on each side);
* greedy generation from fixed prompts gives identical tokens on both.

Then verl's round trip (perturb, sync, revert, sync: generations reproduce
byte for byte), the same training through the disk transport (publish from
the trainer's tensors, pull on the rollout side) and through the SGLang and
vLLM adapters' stand-ins (tests/standins.py shapes, engines in this process).

Measured per step: change density (whole model, per tensor kind), bytes per
changed element for each encoding and the entropy bound (`deltasync diff`),
next to what `deltasync synth` predicts for the same shapes and learning
rate; the sync's time split against a full transfer over the same path; the
GPU memory the sync adds on each side.

Usage (from a checkout, after scripts/gpu-build):
  PYTHONPATH=build/gpu/python python3 examples/rl_loop.py --out /tmp/rl [--steps 30]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
import time

# Deterministic cuBLAS, so that two processes running the same model on the
# same GPU generate the same tokens.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import deltasync as ds  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRESETS = {  # Qwen2.5 shapes
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                 num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                 tie_word_embeddings=True),
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                 num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
                 tie_word_embeddings=True),
    "tiny": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=1024,
                 tie_word_embeddings=True),
}
PROMPTS = [b"def main():\n", b"The quick brown ", b"import numpy as np\n", b"# Licensed under"]


def build_model(preset: str, dtype: torch.dtype):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(**PRESETS[preset], max_position_embeddings=4096, rope_theta=1e6,
                      attn_implementation="eager")
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg).to(dtype=dtype, device="cuda")
    model.eval()
    return model


def text_corpus(limit: int) -> torch.Tensor:
    """Bytes of the text files on this machine (docs, Python sources)."""
    files = []
    for pattern in ("/usr/share/doc/**/*", "/usr/lib/python3*/**/*.py",
                    os.path.join(os.path.dirname(torch.__file__), "..", "**", "*.py")):
        files += glob.glob(pattern, recursive=True)
    chunks, total = [], 0
    for f in sorted(set(files)):
        if total >= limit or not os.path.isfile(f) or f.endswith(".gz"):
            continue
        try:
            data = open(f, "rb").read()
        except OSError:
            continue
        if b"\0" in data[:4096]:
            continue
        chunks.append(data)
        total += len(data)
    return torch.frombuffer(bytearray(b"".join(chunks)[:limit]), dtype=torch.uint8).long()


def train_step(master, opt, corpus, g, batch_size: int, seq: int) -> float:
    """One AdamW step on `batch_size` random windows of the corpus; the loss."""
    idx = torch.randint(0, corpus.numel() - seq - 1, (batch_size,), device="cuda", generator=g)
    batch = torch.stack([corpus[i:i + seq + 1] for i in idx.tolist()])
    out = master(input_ids=batch[:, :-1], labels=batch[:, 1:].contiguous())
    opt.zero_grad(set_to_none=True)
    out.loss.backward()
    opt.step()
    return float(out.loss.detach())


def bf16_named(master) -> dict:
    return {n: p.detach().to(torch.bfloat16) for n, p in master.named_parameters()}


_HASH_WEIGHTS: dict = {}


def tensor_hashes(tensors: dict) -> dict:
    """Two 64-bit linear hashes of each tensor's bits (odd random weights per
    element position, drawn once per tensor size and kept), on the GPU."""
    out = {}
    for n, t in tensors.items():
        x = t.detach().contiguous().view(torch.int16).reshape(-1).to(torch.int64)
        key = (x.numel(), str(x.device))
        if key not in _HASH_WEIGHTS:
            g = torch.Generator(device=x.device).manual_seed(12345)
            _HASH_WEIGHTS[key] = torch.randint(-2**62, 2**62, (2, x.numel()), device=x.device,
                                               generator=g) | 1
        out[n] = (_HASH_WEIGHTS[key] * x).sum(dim=1)
    return {n: h.tolist() for n, h in out.items()}


@torch.no_grad()
def generate(model) -> list:
    out = []
    for p in PROMPTS:
        ids = torch.tensor([list(p)], device="cuda")
        g = model.generate(ids, max_new_tokens=24, do_sample=False, pad_token_id=0)
        out.append(g[0, len(p):].tolist())
    return out


def kind(name: str) -> str:
    for k in ("embed_tokens", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
              "down_proj", "norm"):
        if k in name:
            return k
    return "other"


def load_into(model, tensors: dict) -> None:
    params = dict(model.named_parameters())
    with torch.no_grad():
        for n, t in tensors.items():
            params[n].copy_(t)


# --- the rollout process ------------------------------------------------------


def rollout(preset, rdv, to_rollout, to_trainer, disk):
    torch.use_deterministic_algorithms(True, warn_only=True)
    model = build_model(preset, torch.bfloat16)
    params = dict(model.named_parameters())
    torch.cuda.synchronize()
    before = untracked_bytes()
    rx = ds.StreamReceiver(ds.Group(rdv, 1, 2, timeout_s=600))
    for n, p in params.items():
        rx.register(n, p.data)
    to_trainer.put("ready")
    lc = None
    while True:
        msg = to_rollout.get()
        if msg == "stop":
            break
        if msg == "sync":
            stats = rx.receive()
            torch.cuda.synchronize()
            now = untracked_bytes()
            stats["sync_bytes"] = now - before if now >= 0 and before >= 0 else None
        elif msg[0] == "pull":  # the disk transport
            if lc is None:
                lc = ds.LocalCheckpoint(disk["local"], disk["store"], disk["base"])
            t = time.perf_counter()
            r = lc.pull(msg[1])
            from safetensors.torch import load_file

            local = load_file(os.path.join(disk["local"], "model.safetensors"), device="cuda")
            load_into(model, local)
            stats = {"pull_s": time.perf_counter() - t, "version": r["version"]}
        to_trainer.put((stats, tensor_hashes(params), generate(model)))
    rx.close()


# --- the trainer --------------------------------------------------------------


def untracked_bytes() -> int:
    """GPU memory this process holds beyond torch's caching allocator (its
    CUDA context, and what deltasync allocates itself), by NVML; -1 where
    NVML cannot see this process (a container's pid namespace)."""
    used = nvml_process_bytes().get(os.getpid())
    return -1 if used is None else used - torch.cuda.memory_reserved()


def nvml_process_bytes() -> dict:
    """GPU memory per process id (NVML through ctypes; {} where absent)."""
    import ctypes

    try:
        nv = ctypes.CDLL("libnvidia-ml.so.1")
        nv.nvmlInit_v2()
        h = ctypes.c_void_p()
        nv.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(h))

        class Info(ctypes.Structure):
            _fields_ = [("pid", ctypes.c_uint), ("used", ctypes.c_ulonglong),
                        ("gi", ctypes.c_uint), ("ci", ctypes.c_uint)]

        n = ctypes.c_uint(64)
        arr = (Info * 64)()
        if nv.nvmlDeviceGetComputeRunningProcesses_v3(h, ctypes.byref(n), arr) != 0:
            return {}
        return {arr[i].pid: arr[i].used for i in range(n.value)}
    except OSError:
        return {}


def cli_diff(cli: str, a: str, b: str) -> dict:
    out = subprocess.run([cli, "diff", a, b, "--json"], check=True, capture_output=True,
                         text=True).stdout
    return json.loads(out)


def save_checkpoint(tensors: dict, d: str) -> None:
    from safetensors.torch import save_file

    os.makedirs(d, exist_ok=True)
    save_file({n: t.contiguous().cpu() for n, t in tensors.items()},
              os.path.join(d, "model.safetensors"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="0.5b", choices=sorted(PRESETS))
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--disk-steps", type=int, default=3)
    ap.add_argument("--adapter-steps", type=int, default=3)
    ap.add_argument("--out", required=True)
    ap.add_argument("--cli", default=os.path.join(ROOT, "build", "gpu", "deltasync"))
    ap.add_argument("--fixture", help="also write a small real delta chain here")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    torch.use_deterministic_algorithms(True, warn_only=True)
    work = tempfile.mkdtemp(prefix="rl-loop-")
    rdv = "file:" + os.path.join(work, "rdv")
    ctx = mp.get_context("spawn")
    to_rollout, to_trainer = ctx.Queue(), ctx.Queue()
    disk = {"store": os.path.join(work, "store"), "local": os.path.join(work, "local"),
            "base": os.path.join(work, "base")}
    proc = ctx.Process(target=rollout, args=(args.preset, rdv, to_rollout, to_trainer, disk))
    proc.start()

    master = build_model(args.preset, torch.float32)
    master.train()
    shadow = build_model(args.preset, torch.bfloat16)  # the trainer's BF16 weights, as a model
    opt = torch.optim.AdamW(master.parameters(), lr=args.lr, betas=(0.9, 0.999),
                            weight_decay=0.0)
    corpus = text_corpus(64 << 20).cuda()
    g = torch.Generator(device="cuda").manual_seed(1)
    report = {"preset": args.preset, "lr": args.lr, "steps": [], "checks": {}}
    tx = ds.StreamSender(ds.Group(rdv, 0, 2, timeout_s=600), encoding="indices")
    failures = []

    def sync_and_check(weights: dict, label: str) -> dict:
        to_rollout.put("sync")
        stats = tx.sync(weights)
        torch.cuda.synchronize()
        now = untracked_bytes()
        stats["sender_sync_bytes"] = now - base_untracked if now >= 0 and base_untracked >= 0 \
            else None
        # The trainer's side of the checks runs while the rollout does its own.
        load_into(shadow, weights)
        want_hash = tensor_hashes(weights)
        gen = generate(shadow)
        r_stats, r_hash, r_gen = to_trainer.get()
        ok_bits = r_hash == want_hash
        ok_gen = gen == r_gen
        if not (ok_bits and ok_gen):
            failures.append(f"{label}: bits {ok_bits}, generations {ok_gen}")
        stats["receiver"] = r_stats
        stats["bits_equal"], stats["generations_equal"] = ok_bits, ok_gen
        return stats, gen

    if to_trainer.get() != "ready":
        raise RuntimeError("the rollout did not start")
    bf = bf16_named(master)
    total = sum(t.numel() for t in bf.values())
    torch.cuda.synchronize()
    base_untracked = untracked_bytes()
    seed, _ = sync_and_check(bf, "seed")
    report["full_transfer"] = {"seconds": seed["total_s"], "transfer_s": seed["transfer_s"],
                               "diff_s": seed["diff_s"], "bytes": seed["bytes_sent"],
                               "sender_sync_bytes": seed["sender_sync_bytes"],
                               "receiver_sync_bytes": seed["receiver"]["sync_bytes"]}
    os.makedirs(disk["base"])
    save_checkpoint(bf, disk["base"])
    prev = {n: t.clone() for n, t in bf.items()}
    ckdir = os.path.join(work, "steps")
    save_checkpoint(prev, os.path.join(ckdir, "step_000000"))
    for step in range(1, args.steps + 1):
        loss = train_step(master, opt, corpus, g, args.batch, args.seq)
        bf = bf16_named(master)
        changed = {n: int((bf[n].view(torch.int16) != prev[n].view(torch.int16)).sum())
                   for n in bf}
        kinds = {}
        for n, c in changed.items():
            k = kinds.setdefault(kind(n), [0, 0])
            k[0] += c
            k[1] += bf[n].numel()
        t_sync = time.perf_counter()
        stats, _ = sync_and_check(bf, f"step {step}")
        t_sync = time.perf_counter() - t_sync
        entry = {"step": step, "loss": loss, "changed": sum(changed.values()),
                 "density": sum(changed.values()) / total,
                 "density_by_kind": {k: v[0] / v[1] for k, v in kinds.items()},
                 "sync": {k: stats[k] for k in ("total_s", "diff_s", "encode_s", "transfer_s",
                                                 "report_s", "commit_s", "bytes_sent",
                                                 "sent_elements")},
                 "receiver": {k: stats["receiver"][k] for k in
                              ("apply_s", "verify_s", "receive_s", "wait_s", "bytes")},
                 "sync_and_checks_s": t_sync,
                 "sender_sync_bytes": stats["sender_sync_bytes"],
                 "receiver_sync_bytes": stats["receiver"]["sync_bytes"],
                 "bits_equal": stats["bits_equal"],
                 "generations_equal": stats["generations_equal"]}
        if step <= 3 or step % 10 == 0:
            save_checkpoint(bf, os.path.join(ckdir, f"step_{step:06d}"))
        report["steps"].append(entry)
        print(f"step {step}: loss {entry['loss']:.3f} density {entry['density']:.4%} "
              f"sync {entry['sync']['total_s'] * 1e3:.0f} ms bits {entry['bits_equal']} "
              f"gen {entry['generations_equal']}", flush=True)
        prev = {n: t.clone() for n, t in bf.items()}
    dump(args.out, report)

    # verl's round trip: perturb, sync, revert, sync.
    _, gen_before = sync_and_check(bf, "resync")
    noisy = {n: (t.float() + 1e-3 * torch.randn_like(t.float())).to(torch.bfloat16)
             for n, t in bf.items()}
    sync_and_check(noisy, "perturbed")
    _, gen_after = sync_and_check(bf, "reverted")
    report["checks"]["round_trip_generations_equal"] = gen_before == gen_after
    if gen_before != gen_after:
        failures.append("round trip: generations differ")

    # The disk transport: publish from the trainer's tensors, pull in the rollout.
    pub = ds.Publisher(disk["store"], base_path=disk["base"])
    disk_steps = []
    for k in range(args.disk_steps):
        for p in master.parameters():
            p.data.add_(1e-4 * torch.randn_like(p))
        bf = bf16_named(master)
        r = pub.publish(bf)
        to_rollout.put(("pull", r["version"]))
        r_stats, r_hash, r_gen = to_trainer.get()
        load_into(shadow, bf)
        ok = r_hash == tensor_hashes(bf) and r_gen == generate(shadow)
        if not ok:
            failures.append(f"disk version {r['version']}: not exact")
        disk_steps.append({"version": r["version"], "publish_s": r["seconds"],
                           "bytes_written": r["bytes_written"], "pull_s": r_stats["pull_s"],
                           "exact": ok})
    pub.close()
    report["disk"] = disk_steps

    # The adapters' stand-ins, engines in this process.
    sys.path.insert(0, os.path.join(ROOT, "python", "tests"))
    from deltasync.adapters import sglang as ds_sglang

    class HFEngine:
        """SGLang's update_weights_from_tensor over an HF model whose
        load_weights copies each tensor whole (default_weight_loader)."""

        def __init__(self):
            self.model = build_model(args.preset, torch.bfloat16)
            params = dict(self.model.named_parameters())

            def load_weights(weights):
                for n, w in weights:
                    params[n].data.copy_(w)

            self.model.load_weights = load_weights

        def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
            ds_sglang.load_weights(self.model, [(n, t.cuda()) for n, t in named_tensors])

    engine = HFEngine()
    pusher = ds_sglang.SGLangPusher(engine)

    def adapter_rounds(engine_name, what, send, engine_model, keys):
        """Round 0 sends the weights as they are; each later round first
        perturbs the master. After each: the engine's weights are the
        trainer's, bit for bit, and generate the same tokens."""
        rounds = []
        for k in range(args.adapter_steps + 1):
            if k:
                for p in master.parameters():
                    p.data.add_(1e-4 * torch.randn_like(p))
            bf = bf16_named(master)
            t = time.perf_counter()
            r = send(bf)
            el = time.perf_counter() - t
            ok = tensor_hashes(dict(engine_model.named_parameters())) == tensor_hashes(bf)
            load_into(shadow, bf)
            ok = ok and generate(engine_model) == generate(shadow)
            if not ok:
                failures.append(f"{engine_name} {what} {k}: not exact")
            rounds.append({what: k, "seconds": el, "exact": ok, **{key: r[key] for key in keys}})
        return rounds

    adapter_steps = adapter_rounds("sglang", "push", pusher.push, engine.model,
                                   ("full", "changed_elements"))
    state = ds_sglang.engine_weights(engine.model)
    report["sglang"] = {"pushes": adapter_steps, "fallback": state.fallback}
    del engine, pusher

    # vLLM's WeightTransferEngine (the stand-in's base class and factory),
    # one worker over the same HF model, the trainer's side beside it.
    from standins import VLLMClientStandIn, install_vllm_standin

    factory = install_vllm_standin()
    from deltasync.adapters import vllm as ds_vllm

    ds_vllm.register()

    class TransferConfig:
        backend = "deltasync"

    class ParallelConfig:
        rank = 0

    class VllmConfig:
        parallel_config = ParallelConfig()

    worker = HFEngine().model
    vengine = factory.create_engine(TransferConfig(), VllmConfig(), torch.device("cuda"), worker)
    client = VLLMClientStandIn([vengine])
    bf = bf16_named(master)
    vtrainer = ds_vllm.DeltasyncTrainer(client, bf, rendezvous="file:" + os.path.join(
        work, "rdv-vllm"), workers=1, timeout_s=600)
    try:
        vllm_steps = adapter_rounds("vllm", "update", vtrainer.send_weights, worker,
                                    ("seeded", "bytes_sent"))
    finally:
        vtrainer.close()
        vengine.shutdown()
    report["vllm"] = {"updates": vllm_steps, "fallback": vengine.fallback}

    to_rollout.put("stop")
    proc.join()
    tx.close()

    # Encodings and the entropy bound, and what synth predicts.
    report["diff"] = {}
    for a, b in (("000000", "000001"), ("000002", "000003")):
        d = cli_diff(args.cli, f"{ckdir}/step_{a}", f"{ckdir}/step_{b}")
        report["diff"][f"{a}->{b}"] = d.get("total", d)
    synth = os.path.join(work, "synth")
    subprocess.run([args.cli, "synth", "--out", synth, "--preset",
                    "qwen2.5-0.5b" if args.preset == "0.5b" else "qwen2.5-1.5b" if
                    args.preset == "1.5b" else "tiny", "--steps", "3", "--lr", str(args.lr),
                    # this model's master starts from fp32 draws, off the BF16 grid
                    "--master-init", "fp32"],
                   check=True, capture_output=True)
    d = cli_diff(args.cli, f"{synth}/step_000002", f"{synth}/step_000003")
    report["synth_diff"] = d.get("total", d)
    if args.fixture:
        write_fixture(ckdir, args.fixture)
    report["failures"] = failures
    dump(args.out, report)
    print(json.dumps({"failures": failures, "full_transfer": report["full_transfer"],
                      "diff": report["diff"], "synth_diff": report["synth_diff"]}, indent=1))
    return 1 if failures else 0


def dump(out: str, report: dict) -> None:
    with open(os.path.join(out, "report.json"), "w") as f:
        json.dump(report, f, indent=1)


def write_fixture(ckdir: str, out: str) -> None:
    """A few tensors of the first steps, whole, as checkpoint directories
    (a small real delta chain for the tests)."""
    from safetensors.torch import load_file, save_file

    keep = None
    for step in ("000000", "000001", "000002", "000003"):
        t = load_file(f"{ckdir}/step_{step}/model.safetensors")
        if keep is None:  # about 0.5 MiB a step for the 0.5b preset
            keep = [n for n in sorted(t) if n.startswith("model.layers.0.") and
                    any(k in n for k in ("k_proj", "v_proj", "q_proj.bias", "norm"))]
        d = os.path.join(out, f"step_{step}")
        os.makedirs(d, exist_ok=True)
        save_file({n: t[n].contiguous() for n in keep}, os.path.join(d, "model.safetensors"))


if __name__ == "__main__":
    sys.exit(main())
