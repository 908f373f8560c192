#!/usr/bin/env python3
"""The Python package's costs, measured side by side in one run.

1. Publishing from in-memory torch tensors against the CLI's `deltasync
   publish` of the same weights (the CLI reads OLD and NEW from the page
   cache; both write the same version), alternated, medians of --repeat.
2. The binding's overhead on an empty delta: a call's wall time minus the
   time the C++ core reports for it (Publisher.publish of unchanged weights,
   StreamSender.sync with nothing changed), given the tensors and given
   them prepared once (deltasync.prepare), alternated, and a diff of a
   one-element tensor.
3. The same sync overhead against the number of tensors (290, 1000, 3000
   small ones), given the tensors and prepared, alternated.

Usage: PYTHONPATH=build/default/python python3 python/bench/bench_python.py
           [--cli build/default/deltasync] [--bytes 256MiB] [--repeat 5] [--json]
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

import deltasync as ds  # noqa: E402
import st_io  # noqa: E402


def load_dir(d):
    out = {}
    for f in sorted(os.listdir(d)):
        if f.endswith(".safetensors"):
            out.update(st_io.read(os.path.join(d, f)))
    return out


def median_ms(xs):
    return statistics.median(xs) * 1e3


def bench_publish(cli, chain, work, repeat, w0, w1):
    cli_s, py_s = [], []
    for i in range(repeat):
        store = os.path.join(work, f"cli{i}")
        t = time.perf_counter()
        subprocess.run([cli, "publish", "--store", store, "--old", chain + "/step_000000",
                        "--new", chain + "/step_000001"], check=True, capture_output=True)
        cli_s.append(time.perf_counter() - t)
        shutil.rmtree(store)
        store = os.path.join(work, f"py{i}")
        pub = ds.Publisher(store, w0)
        t = time.perf_counter()
        r = pub.publish(w1)
        py_s.append(time.perf_counter() - t)
        pub.close()
        shutil.rmtree(store)
    nbytes = sum(t.numel() * t.element_size() for t in w0.values())
    return {"model_bytes": nbytes, "tensors": len(w0), "changed_elements": r["changed_elements"],
            "cli_ms": median_ms(cli_s), "python_ms": median_ms(py_s),
            "ratio": statistics.median(py_s) / statistics.median(cli_s)}


def bench_empty(work, repeat, w):
    pub = ds.Publisher(os.path.join(work, "empty"), w)
    prepared = ds.prepare(w)
    over, over_prepared = [], []
    for _ in range(repeat * 4):  # the two alternated
        for given, out in ((w, over), (prepared, over_prepared)):
            t = time.perf_counter()
            r = pub.publish(given)
            out.append(time.perf_counter() - t - r["seconds"])
    pub.close()
    rdv = "file:" + os.path.join(work, "rdv")
    n = repeat * 8 + 1
    rx_w = {k: torch.zeros_like(v) for k, v in w.items()}

    def engine():
        with ds.StreamReceiver(ds.Group(rdv, 1, 2)) as rx:
            rx.register_all(rx_w)
            for _ in range(n):
                rx.receive()

    th = threading.Thread(target=engine)
    th.start()
    sync_over, sync_over_prepared = [], []
    with ds.StreamSender(ds.Group(rdv, 0, 2)) as tx:
        tx.sync(w)
        for _ in range((n - 1) // 2):
            for given, out in ((w, sync_over), (prepared, sync_over_prepared)):
                t = time.perf_counter()
                s = tx.sync(given)
                out.append(time.perf_counter() - t - s["total_s"])
    th.join()
    a, b = torch.zeros(1), torch.zeros(1)
    calls = 2000
    t = time.perf_counter()
    for _ in range(calls):
        ds.diff(a, b)
    per_diff = (time.perf_counter() - t) / calls
    return {"tensors": len(w), "publish_overhead_ms": median_ms(over),
            "publish_prepared_overhead_ms": median_ms(over_prepared),
            "sync_overhead_ms": median_ms(sync_over),
            "sync_prepared_overhead_ms": median_ms(sync_over_prepared),
            "diff_call_us": per_diff * 1e6}


def bench_tensor_count(work, repeat, counts=(290, 1000, 3000)):
    """StreamSender.sync's overhead on an empty delta of `n` small tensors,
    given the tensors and prepared, alternated (the per-tensor part)."""
    out = []
    for n in counts:
        w = {f"t{i}": torch.zeros(64, dtype=torch.bfloat16) for i in range(n)}
        rdv = "file:" + os.path.join(work, f"rdv-{n}")
        reps = repeat * 6
        held = {k: torch.zeros_like(v) for k, v in w.items()}

        def engine():
            with ds.StreamReceiver(ds.Group(rdv, 1, 2)) as rx:
                rx.register_all(held)
                for _ in range(2 * reps + 1):
                    rx.receive()

        th = threading.Thread(target=engine)
        th.start()
        prepared = ds.prepare(w)
        plain, pre = [], []
        with ds.StreamSender(ds.Group(rdv, 0, 2)) as tx:
            tx.sync(w)
            for _ in range(reps):
                for given, o in ((w, plain), (prepared, pre)):
                    t = time.perf_counter()
                    s = tx.sync(given)
                    o.append(time.perf_counter() - t - s["total_s"])
        th.join()
        out.append({"tensors": n, "sync_overhead_ms": median_ms(plain),
                    "sync_prepared_overhead_ms": median_ms(pre)})
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cli", default=os.path.join(HERE, "..", "..", "build", "default", "deltasync"))
    ap.add_argument("--bytes", default="256MiB")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="ds-pybench-")
    try:
        chain = os.path.join(work, "chain")
        subprocess.run([args.cli, "synth", "--out", chain, "--preset", "qwen2.5-0.5b",
                        "--bytes", args.bytes, "--steps", "1"], check=True, capture_output=True)
        w0, w1 = load_dir(chain + "/step_000000"), load_dir(chain + "/step_000001")
        result = {"publish": bench_publish(args.cli, chain, work, args.repeat, w0, w1),
                  "empty": bench_empty(work, args.repeat, w0),
                  "tensor_count": bench_tensor_count(work, args.repeat)}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        print(json.dumps(result, indent=1))
        return
    p, e = result["publish"], result["empty"]
    print(f"publish of one step, {p['model_bytes'] / 2**20:.0f} MiB BF16, {p['tensors']} tensors, "
          f"{p['changed_elements']} changed elements (median of {args.repeat}):")
    print(f"  deltasync publish (CLI)        {p['cli_ms']:9.1f} ms")
    print(f"  Publisher.publish (Python)     {p['python_ms']:9.1f} ms   {p['ratio']:.2f}x the CLI")
    print(f"binding overhead on an empty delta of the same model ({e['tensors']} tensors): "
          "wall time minus the core's own")
    print(f"  Publisher.publish              {e['publish_overhead_ms']:9.3f} ms")
    print(f"  Publisher.publish, prepared    {e['publish_prepared_overhead_ms']:9.3f} ms")
    print(f"  StreamSender.sync              {e['sync_overhead_ms']:9.3f} ms")
    print(f"  StreamSender.sync, prepared    {e['sync_prepared_overhead_ms']:9.3f} ms")
    print(f"  diff of a 1-element tensor     {e['diff_call_us']:9.1f} us per call")
    print("StreamSender.sync's overhead on an empty delta of n 64-element tensors:")
    for c in result["tensor_count"]:
        print(f"  {c['tensors']:5d} tensors  {c['sync_overhead_ms']:7.3f} ms, "
              f"prepared {c['sync_prepared_overhead_ms']:7.3f} ms")


if __name__ == "__main__":
    main()
