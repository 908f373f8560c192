"""The stream from Python: a sender and receivers in threads over gloo, in
processes over a torch.distributed Gloo group, a sharded trainer, and the
errors bad input gets."""

import threading

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

import deltasync as ds
from deltasync import _deltasync
from stream_rounds import run_rounds

pytestmark = pytest.mark.skipif("gloo" not in ds.built_communicators(),
                                reason="this build has no gloo communicator")


def model(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"emb": torch.randn(96, 32, generator=g).to(torch.bfloat16),
            "norm": torch.randn(32, generator=g),
            "count": torch.arange(5, dtype=torch.int64)}


def step(w, k):
    w["emb"].view(-1)[k::53] += 1
    w["norm"][k % 32] = float("nan") if k % 2 else 0.5 * k
    w["count"][k % 5] += 1


def bits(t):
    return t.contiguous().view(torch.uint8)


def run_receivers(n, target, errors):
    ts = [threading.Thread(target=lambda r=r: _guard(target, r, errors)) for r in range(1, n + 1)]
    for t in ts:
        t.start()
    return ts


def _guard(fn, r, errors):
    try:
        fn(r)
    except BaseException as e:  # reported by the test
        errors.append(e)


def test_threads_whole_tensors_and_a_column_slice(rendezvous):
    w = model()
    whole = {n: torch.zeros_like(t) for n, t in w.items()}
    cols = torch.zeros(96, 16, dtype=torch.bfloat16)
    syncs = 4
    errors = []

    def receiver(r):
        with ds.StreamReceiver(ds.Group(rendezvous, r, 3, timeout_s=30)) as rx:
            if r == 1:
                rx.register_all(whole)
            else:
                rx.register("emb", cols, runs=[(i * 32 + 16, 16, i * 16, 1) for i in range(96)],
                            shape=[96, 32])
                rx.register("norm", torch.zeros(32))
                rx.register("count", torch.zeros(5, dtype=torch.int64))
            for k in range(syncs):
                stats = rx.receive()
                assert stats["sync_id"] == k + 1 and stats["seed"] == (k == 0)

    ts = run_receivers(2, receiver, errors)
    with ds.StreamSender(ds.Group(rendezvous, 0, 3, timeout_s=30)) as tx:
        for k in range(syncs):
            if k:
                step(w, k)
            stats = tx.sync(w)
            assert stats["receivers"] == 2 and stats["sync_id"] == k + 1
            if k:
                assert 0 < stats["changed"] < 200
        assert tx.committed_sync_id == syncs
        assert tx.snapshot("norm") == bits(w["norm"]).numpy().tobytes()
    for t in ts:
        t.join()
    assert not errors, errors
    for n, t in w.items():
        assert torch.equal(bits(whole[n]), bits(t)), n
    assert torch.equal(bits(cols), bits(w["emb"][:, 16:]))


def test_prepared_tensors_sync_as_the_tensors_do_and_a_moved_one_is_refused(rendezvous):
    w = model()
    w["emb"] = torch.nn.Parameter(w["emb"])  # as a trainer holds it
    held = {n: torch.zeros_like(t).detach() for n, t in w.items()}
    errors = []
    received = []

    def receiver(r):
        with ds.StreamReceiver(ds.Group(rendezvous, r, 2, timeout_s=30)) as rx:
            rx.register_all(held)
            for _ in range(4):
                received.append(rx.receive()["sync_id"])
                received.append({n: bits(t).clone() for n, t in held.items()})

    ts = run_receivers(1, receiver, errors)
    with ds.StreamSender(ds.Group(rendezvous, 0, 2, timeout_s=30)) as tx:
        prepared = ds.prepare(w)
        assert len(prepared) == 3 and prepared.names() == list(w)
        tx.sync(prepared)
        with torch.no_grad():
            for k in (1, 2):
                step(w, k)  # in place, as an optimizer steps: prepared sees it
                assert tx.sync(prepared)["changed"] > 0
            # A parameter given other memory is refused by name, and nothing
            # of that sync is committed.
            w["emb"].data = w["emb"].data.clone()
            with pytest.raises(ds.FailedPreconditionError,
                               match="tensor 'emb': its memory moved"):
                tx.sync(prepared)
            assert tx.committed_sync_id == 3
            step(w, 3)
            assert tx.sync(ds.prepare(w))["changed"] > 0
    for t in ts:
        t.join()
    assert not errors, errors
    assert received[0::2] == [1, 2, 3, 4]
    want = {n: bits(t.detach()) for n, t in w.items()}
    assert [n for n in want if not torch.equal(received[-1][n], want[n])] == []


def test_the_sender_quantizes_to_fp8_and_receivers_hold_what_quantize_fp8_gives(rendezvous):
    g = torch.Generator().manual_seed(4)
    w = {"up": (torch.randn(200, 300, generator=g) * 0.02).to(torch.bfloat16),
         "down": (torch.randn(130, 64, generator=g) * 0.02).to(torch.float32),
         "norm": torch.ones(64)}
    recipes = {"up": ("block128", "ue8m0"), "down": ("per_channel", "f32", "down.scale")}
    held = {"up": torch.zeros(200, 300, dtype=torch.uint8),
            "up_scale_inv": torch.zeros(2, 3, dtype=torch.uint8),
            "down": torch.zeros(130, 64, dtype=torch.uint8),
            "down.scale": torch.zeros(130, 1),
            "norm": torch.zeros(64)}
    dtypes = {"up": "F8_E4M3", "up_scale_inv": "F8_E8M0", "down": "F8_E4M3"}
    syncs, errors, received = 3, [], []

    def receiver(r):
        with ds.StreamReceiver(ds.Group(rendezvous, r, 2, timeout_s=30)) as rx:
            for n, t in held.items():
                if n in dtypes:
                    rx.register(n, t, runs=[(0, t.numel(), 0, 1)], shape=list(t.shape),
                                dtype=dtypes[n])
                else:
                    rx.register(n, t)
            for _ in range(syncs):
                rx.receive()
                received.append({n: bits(t).clone() for n, t in held.items()})

    def quantized():
        codes, scales = ds.quantize_fp8(w["up"], "block128", "ue8m0")
        dcodes, dscales = ds.quantize_fp8(w["down"], "per_channel", "f32")
        return {"up": codes, "up_scale_inv": scales, "down": dcodes, "down.scale": dscales,
                "norm": w["norm"].numpy()}

    ts = run_receivers(1, receiver, errors)
    wanted = []
    with ds.StreamSender(ds.Group(rendezvous, 0, 2, timeout_s=30), quantize=recipes) as tx:
        for k in range(syncs):
            if k:
                w["up"] += (torch.randn(200, 300, generator=g) * 1e-3).to(torch.bfloat16)
                w["down"][k] *= 3.0  # row k's scale moves
            wanted.append(quantized())
            stats = tx.sync(w)
            assert 0 < stats["quantize_s"] <= stats["total_s"]
            if k:
                assert 0 < stats["changed"] < 200 * 300 + 130 * 64
        assert tx.snapshot("up") == wanted[-1]["up"].tobytes()
        # A weight the recipe cannot take: refused by name, nothing sent.
        w["up"][7, 7] = float("inf")
        with pytest.raises(ds.InvalidArgumentError, match="'up'.*NaN or an infinity"):
            tx.sync(w)
        assert tx.committed_sync_id == syncs
    for t in ts:
        t.join()
    assert not errors, errors
    for k in range(syncs):
        for n, want in wanted[k].items():
            assert received[k][n].numpy().tobytes() == np.ascontiguousarray(want).tobytes(), (k, n)


def test_quantize_specs_that_cannot_work_are_refused(rendezvous):
    group = ds.Group(rendezvous, 0, 2, timeout_s=5)
    with pytest.raises(ds.InvalidArgumentError, match="quantize\\['w'\\]"):
        ds.StreamSender(group, quantize={"w": ("block128", "f32", "s", "x")})
    with pytest.raises(ds.InvalidArgumentError, match="unknown scheme"):
        ds.StreamSender(group, quantize={"w": ("block64",)})
    with pytest.raises(ds.InvalidArgumentError, match="ue8m0"):
        ds.StreamSender(group, quantize={"w": ("per_tensor", "ue8m0")})


def test_a_receiver_subset_says_so_a_tensor_the_sender_lacks_is_named(rendezvous):
    w = model(1)
    errors = []
    got = torch.zeros(96, 32, dtype=torch.bfloat16)
    stats = []

    def receiver(r):
        # A pipeline stage holds a subset of the model, and says so.
        with ds.StreamReceiver(ds.Group(rendezvous, r, 2, timeout_s=10), partial=True) as rx:
            rx.register("emb", got)
            stats.append(rx.receive())

    ts = run_receivers(1, receiver, errors)
    with ds.StreamSender(ds.Group(rendezvous, 0, 2, timeout_s=10)) as tx:
        assert tx.sync(w)["partial_receivers"] == 1
    for t in ts:
        t.join()
    assert not errors and torch.equal(bits(got), bits(w["emb"]))
    assert stats[0]["partial"] and stats[0]["tensors"] == 1

    # One that does not say so is refused, naming the first tensor it lacks.
    lacking = rendezvous + "-lacking"
    refusals = []

    def silent(r):
        with ds.StreamReceiver(ds.Group(lacking, r, 2, timeout_s=10)) as rx:
            rx.register("emb", torch.zeros(96, 32, dtype=torch.bfloat16))
            try:
                rx.receive()
            except ds.DeltasyncError as e:
                refusals.append(e)

    ts = run_receivers(1, silent, errors)
    with ds.StreamSender(ds.Group(lacking, 0, 2, timeout_s=10)) as tx:
        with pytest.raises(ds.InvalidArgumentError, match="did not register tensor 'count'"):
            tx.sync(w)
    for t in ts:
        t.join()
    assert refusals and "did not register tensor 'count'" in str(refusals[0])

    ghost_errors = []
    other = rendezvous + "-ghost"

    def ghost(r):
        with ds.StreamReceiver(ds.Group(other, r, 2, timeout_s=10), partial=True) as rx:
            rx.register("emb", torch.zeros(96, 32, dtype=torch.bfloat16))
            rx.register("ghost", torch.zeros(3))
            try:
                rx.receive()
            except ds.DeltasyncError as e:
                ghost_errors.append(e)

    ts = run_receivers(1, ghost, [])
    with ds.StreamSender(ds.Group(other, 0, 2, timeout_s=10)) as tx:
        with pytest.raises(ds.DeltasyncError, match="ghost"):
            tx.sync(w)
        assert tx.committed_sync_id == 0
    for t in ts:
        t.join()


def test_bad_arguments_are_refused_by_name(rendezvous):
    rx = ds.StreamReceiver(ds.Group(rendezvous, 1, 2))
    rx.register("a", torch.zeros(4))
    with pytest.raises(ds.InvalidArgumentError, match="'a'"):
        rx.register("a", torch.zeros(4))
    with pytest.raises(ds.InvalidArgumentError, match="'b': not contiguous"):
        rx.register("b", torch.zeros(4, 4).t())
    with pytest.raises(ds.InvalidArgumentError, match="sender's shape"):
        rx.register("c", torch.zeros(4), runs=[(0, 4, 0, 1)])
    ro = torch.zeros(4).numpy()
    ro.flags.writeable = False
    with pytest.raises(ds.InvalidArgumentError, match="read-only"):
        rx.register("d", ro)
    rx.close()
    with pytest.raises(ds.FailedPreconditionError, match="StreamReceiver is closed"):
        rx.receive()
    tx = ds.StreamSender(ds.Group(rendezvous, 0, 2))
    with pytest.raises(ds.InvalidArgumentError):
        ds.StreamSender(ds.Group(rendezvous, 0, 2), encoding="no-such")
    with pytest.raises(ds.InvalidArgumentError, match="bucket_bytes"):
        ds.StreamSender(ds.Group(rendezvous, 0, 2), bucket_bytes=10)
    with pytest.raises(ds.InvalidArgumentError, match="threads 5000: at most 1024"):
        ds.StreamSender(ds.Group(rendezvous, 0, 2), threads=5000)
    # A CUDA tensor where this process has no GPU (or this build no CUDA):
    # refused by name before anything is sent.
    arg = _deltasync.TensorArg()
    arg.name, arg.dtype, arg.shape, arg.nbytes, arg.ptr, arg.device = "gpu.w", "F32", [4], 16, 4096, 0
    with pytest.raises(ds.DeltasyncError, match="gpu.w"):
        tx._impl.sync([arg])
    tx.close()
    with pytest.raises(ds.FailedPreconditionError, match="StreamSender is closed"):
        tx.sync(model())
    with pytest.raises(ds.InvalidArgumentError, match="backend"):
        ds.Group(rendezvous, 0, 2, backend="")


def sync_two_trainer_ranks(tmp_path, w, spec, syncs, shards_of, change):
    """Two trainer ranks (threads, each with its own copy of ``w``) sync
    ``syncs`` times to one receiver holding the whole model: before sync k > 0
    each rank applies ``change(w, k)``, then passes ``shards_of(rank, w)``.
    Checks the receiver ends bit-exact."""
    got = {n: torch.zeros_like(t) for n, t in w.items()}
    errors = []
    stream = "file:" + str(tmp_path / "stream")
    trainers = "file:" + str(tmp_path / "trainers")

    def receiver(r):
        with ds.StreamReceiver(ds.Group(stream, 1, 2, timeout_s=30)) as rx:
            rx.register_all(got)
            for _ in range(syncs):
                rx.receive()

    def trainer(rank, w):
        group = ds.Group(stream, 0, 2, timeout_s=30) if rank == 0 else None
        with ds.StreamSender(group, trainers=ds.Group(trainers, rank, 2, timeout_s=30)) as tx:
            for k in range(syncs):
                if k:
                    change(w, k)
                tx.sync_shards(spec, shards_of(rank, w))

    ts = run_receivers(1, receiver, errors)
    other = {n: t.clone() for n, t in w.items()}
    t1 = threading.Thread(target=lambda: _guard(lambda _: trainer(1, other), 1, errors))
    t1.start()
    trainer(0, w)
    t1.join()
    for t in ts:
        t.join()
    assert not errors, errors
    for n, t in w.items():
        assert torch.equal(bits(got[n]), bits(t)), n


def test_sharded_trainer_two_ranks(tmp_path):
    w = model(2)
    spec = {n: ("BF16" if n == "emb" else ("F32" if n == "norm" else "I64"), list(t.shape))
            for n, t in w.items()}

    def shards_of(rank, w):
        return [(ds.ShardSpec.shard("emb", "BF16", [96, 32], 1, rank, 2),
                 w["emb"][:, rank * 16:(rank + 1) * 16].contiguous()),
                (ds.ShardSpec.shard("norm", "F32", [32], 0, rank, 2),
                 w["norm"][rank * 16:(rank + 1) * 16].contiguous()),
                (ds.ShardSpec.replicate("count", "I64", [5], rank == 0), w["count"])]

    sync_two_trainer_ranks(tmp_path, w, spec, 3, shards_of, step)

def test_sharded_fp8_two_ranks_send_every_code_and_scale_once(tmp_path):
    """Two trainer ranks hold halves of a BF16 weight split through a 128-row
    block; each quantizes its half with Fp8ShardQuantizer and sends codes
    and scales with fp8_shard_specs: the receiver holds quantize_fp8 of the
    whole weight at every step."""
    g = torch.Generator().manual_seed(9)
    shape = (300, 200)
    w = (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)
    windows = [(0, 150, 0, 200), (150, 300, 0, 200)]
    syncs, errors = 3, []
    steps = [w.clone()]
    for k in range(1, syncs):
        nxt = steps[-1].clone()
        nxt += (torch.randn(*shape, generator=g) * 1e-3).to(torch.bfloat16)
        nxt[140 + k] *= 4  # the shared block's scale moves
        steps.append(nxt)
    held = {"w": torch.zeros(*shape, dtype=torch.uint8),
            "w_scale_inv": torch.zeros(3, 2, dtype=torch.uint8)}
    dtypes = {"w": "F8_E4M3", "w_scale_inv": "F8_E8M0"}
    model = {n: (dtypes[n], list(t.shape)) for n, t in held.items()}
    received = []
    stream = "file:" + str(tmp_path / "stream")
    trainers = "file:" + str(tmp_path / "trainers")
    quant = "file:" + str(tmp_path / "quant")

    def receiver(r):
        with ds.StreamReceiver(ds.Group(stream, 1, 2, timeout_s=30)) as rx:
            for n, t in held.items():
                rx.register(n, t, runs=[(0, t.numel(), 0, 1)], shape=list(t.shape),
                            dtype=dtypes[n])
            for _ in range(syncs):
                rx.receive()
                received.append({n: t.clone() for n, t in held.items()})

    def trainer(rank):
        r0, r1, c0, c1 = windows[rank]
        codes_spec, scales_spec = ds.fp8_shard_specs("w", windows, shape, rank,
                                                     "block128", "ue8m0")
        group = ds.Group(stream, 0, 2, timeout_s=30) if rank == 0 else None
        with ds.Fp8ShardQuantizer(ds.Group(quant, rank, 2, timeout_s=30)) as q, \
                ds.StreamSender(group, trainers=ds.Group(trainers, rank, 2, timeout_s=30)) as tx:
            for k in range(syncs):
                part = steps[k][r0:r1, c0:c1].float().numpy()
                codes, scales, _ = q.quantize(part, windows, shape, "block128", "ue8m0")
                tx.sync_shards(model, [(codes_spec, codes), (scales_spec, scales)])

    ts = run_receivers(1, receiver, errors)
    t1 = threading.Thread(target=lambda: _guard(lambda _: trainer(1), 1, errors))
    t1.start()
    trainer(0)
    t1.join()
    for t in ts:
        t.join()
    assert not errors, errors
    assert len(received) == syncs
    for k in range(syncs):
        codes, scales = ds.quantize_fp8(steps[k].float().numpy(), "block128", "ue8m0")
        assert received[k]["w"].numpy().tobytes() == codes.tobytes(), k
        assert received[k]["w_scale_inv"].numpy().tobytes() == scales.tobytes(), k
    # Rank 1's row of the shared block row is not its to send.
    _, scales_spec = ds.fp8_shard_specs("w", windows, shape, 1)
    assert [p.contributes for p in scales_spec.pieces] == [False, True]
    with pytest.raises(ds.InvalidArgumentError, match="rank 2 of 2"):
        ds.fp8_shard_specs("w", windows, shape, 2)


def _megatron_rank_weights(hf, heads, groups, head_dim, rank, tp):
    """A stand-in of how Megatron lays out one tensor-parallel rank's fused
    weights (NVIDIA/Megatron-LM d98e8a64): linear_qkv's rows interleave
    each query group's query heads, key head and value head
    (megatron/core/transformer/attention.py, get_query_key_value_tensors:
    mixed_qkv.view(..., num_query_groups_per_partition, (heads_per_group + 2)
    * head_dim) split as [heads_per_group * head_dim, head_dim, head_dim]),
    and ColumnParallelLinear gives each rank an equal run of them; SwiGLU's
    linear_fc1 holds the rank's chunk of gate then of up
    (megatron/core/transformer/mlp.py: glu's torch.chunk(x, 2, dim=-1),
    apply_swiglu_sharded_factory)."""
    per_group = heads // groups
    rows = []
    for g in range(groups):
        rows.append(hf["q"][g * per_group * head_dim:(g + 1) * per_group * head_dim])
        rows.append(hf["k"][g * head_dim:(g + 1) * head_dim])
        rows.append(hf["v"][g * head_dim:(g + 1) * head_dim])
    qkv = torch.cat(rows).chunk(tp)[rank].contiguous()
    fc1 = torch.cat([hf["gate"].chunk(tp)[rank], hf["up"].chunk(tp)[rank]]).contiguous()
    return qkv, fc1


def test_megatron_fused_qkv_and_gate_up_sync_bit_exact(tmp_path):
    heads, groups, head_dim, hidden, ffn, tp = 8, 4, 4, 6, 10, 2
    g = torch.Generator().manual_seed(7)
    hf = {"q": torch.randn(heads * head_dim, hidden, generator=g).to(torch.bfloat16),
          "k": torch.randn(groups * head_dim, hidden, generator=g).to(torch.bfloat16),
          "v": torch.randn(groups * head_dim, hidden, generator=g).to(torch.bfloat16),
          "gate": torch.randn(ffn, hidden, generator=g).to(torch.bfloat16),
          "up": torch.randn(ffn, hidden, generator=g).to(torch.bfloat16)}
    # The stand-in splits as Megatron's forward does: each rank's query
    # groups get their own heads back.
    per_rank = groups // tp
    for r in range(tp):
        qkv, fc1 = _megatron_rank_weights(hf, heads, groups, head_dim, r, tp)
        view = qkv.view(per_rank, (heads // groups + 2) * head_dim, hidden)
        q, k, v = torch.split(view, [heads // groups * head_dim, head_dim, head_dim], dim=1)
        first = r * per_rank
        assert torch.equal(q.reshape(-1, hidden),
                           hf["q"][first * heads // groups * head_dim:
                                   (first + per_rank) * heads // groups * head_dim])
        kv_rows = slice(first * head_dim, (first + per_rank) * head_dim)
        assert torch.equal(k.reshape(-1, hidden), hf["k"][kv_rows])
        assert torch.equal(v.reshape(-1, hidden), hf["v"][kv_rows])
        gate, up = torch.chunk(fc1, 2, dim=0)
        assert torch.equal(gate, hf["gate"].chunk(tp)[r])
        assert torch.equal(up, hf["up"].chunk(tp)[r])
    # vLLM's layout (q, k and v each split, then concatenated) is another
    # one where a rank holds several query groups: the spec of the one must
    # not describe the other.
    vllm = torch.cat([hf[n].chunk(tp)[0] for n in ("q", "k", "v")])
    assert not torch.equal(vllm, _megatron_rank_weights(hf, heads, groups, head_dim, 0, tp)[0])

    spec = {n: ("BF16", list(t.shape)) for n, t in hf.items()}

    def shards_of(rank, w):
        qkv, fc1 = _megatron_rank_weights(w, heads, groups, head_dim, rank, tp)
        return [(ds.ShardSpec.megatron_qkv("q", "k", "v", "BF16", heads, groups, head_dim,
                                           hidden, rank, tp), qkv),
                (ds.ShardSpec.fused("BF16", 0, [
                    ds.ShardSpec.shard("gate", "BF16", [ffn, hidden], 0, rank, tp),
                    ds.ShardSpec.shard("up", "BF16", [ffn, hidden], 0, rank, tp)]), fc1)]

    def change(w, k):
        for t in w.values():
            t.view(-1)[k::7] += 1

    sync_two_trainer_ranks(tmp_path, hf, spec, 2, shards_of, change)
    with pytest.raises(ds.InvalidArgumentError, match="not a multiple of 3 query groups"):
        ds.ShardSpec.megatron_qkv("q", "k", "v", "BF16", 8, 3, 4, 6, 0, 2)


def test_stacked_experts_of_expert_parallel_ranks_sync_bit_exact(tmp_path):
    # 4 experts on 2 expert-parallel ranks, each rank holding its 2 experts
    # stacked as vLLM's and SGLang's EP layers do: w13 [2, 2 * ffn, hidden]
    # (gate rows, then up rows) and w2 [2, hidden, ffn].
    experts, ffn, hidden, ep = 4, 5, 6, 2
    g = torch.Generator().manual_seed(11)
    hf = {}
    for e in range(experts):
        for part, shape in (("gate_proj", (ffn, hidden)), ("up_proj", (ffn, hidden)),
                            ("down_proj", (hidden, ffn))):
            hf[f"mlp.experts.{e}.{part}.weight"] = torch.randn(*shape, generator=g).to(
                torch.bfloat16)
    spec = {n: ("BF16", list(t.shape)) for n, t in hf.items()}

    def shards_of(rank, w):
        mine = range(rank * experts // ep, (rank + 1) * experts // ep)
        name = "mlp.experts.{}.{}.weight".format
        w13 = torch.stack([torch.cat([w[name(e, "gate_proj")], w[name(e, "up_proj")]])
                           for e in mine])
        w2 = torch.stack([w[name(e, "down_proj")] for e in mine])
        return [(ds.ShardSpec.stacked_experts(
                    "BF16", [[name(e, "gate_proj"), name(e, "up_proj")] for e in mine],
                    [ffn, hidden]), w13),
                (ds.ShardSpec.stacked_experts("BF16", [[name(e, "down_proj")] for e in mine],
                                              [hidden, ffn]), w2)]

    def change(w, k):
        for t in w.values():
            t.view(-1)[k::5] += 1

    sync_two_trainer_ranks(tmp_path, hf, spec, 2, shards_of, change)
    with pytest.raises(ds.InvalidArgumentError, match="expert 1 has 1 tensors"):
        ds.ShardSpec.stacked_experts("BF16", [["a", "b"], ["c"]], [2, 2])


class _Shard:
    def __init__(self, dim):
        self.dim = dim


class _Replicate:
    pass


_Shard.__name__, _Replicate.__name__ = "Shard", "Replicate"


class _Mesh:
    def __init__(self, sizes, coord):
        self.sizes, self.coord = sizes, coord

    def get_coordinate(self):
        return self.coord

    def size(self, d):
        return self.sizes[d]


class _FakeDTensor:
    """The DTensor attributes from_dtensor reads (torch 1.13 has no DTensor;
    the device's torch runs the real one)."""

    def __init__(self, full, placements, mesh):
        self.placements, self.device_mesh, self.shape, self.dtype = placements, mesh, full.shape, full.dtype
        off = [0] * full.dim()
        ext = list(full.shape)
        for md, p in enumerate(placements):
            if isinstance(p, _Shard):
                chunks = torch.arange(ext[p.dim]).chunk(mesh.sizes[md])
                c = mesh.coord[md]
                piece = chunks[c] if c < len(chunks) else torch.arange(0)
                off[p.dim] += int(piece[0]) if len(piece) else ext[p.dim]
                ext[p.dim] = len(piece)
        self._local = full[tuple(slice(o, o + e) for o, e in zip(off, ext))].contiguous()

    def to_local(self):
        return self._local


def test_shard_spec_from_dtensor_placements():
    full = torch.randn(10, 6).to(torch.bfloat16)
    spec = ds.ShardSpec.from_dtensor("w", _FakeDTensor(full, [_Shard(0)], _Mesh([4], [3])))
    assert spec.local_shape == [1, 6]  # torch.chunk: 3, 3, 3, 1
    assert spec.pieces[0].hf_offset == [9, 0] and spec.contributes
    spec = ds.ShardSpec.from_dtensor(
        "w", _FakeDTensor(full, [_Replicate(), _Shard(1)], _Mesh([2, 2], [1, 1])))
    assert spec.local_shape == [10, 3] and spec.pieces[0].hf_offset == [0, 3]
    assert not spec.contributes  # replica 1 of the replicated mesh dimension
    spec = ds.ShardSpec.from_dtensor(
        "w", _FakeDTensor(full, [_Shard(0), _Shard(0)], _Mesh([2, 2], [1, 0])))
    assert spec.pieces[0].hf_offset == [5, 0] and spec.local_shape == [3, 6]

    class Partial:
        pass

    with pytest.raises(ds.UnsupportedError, match="Partial"):
        ds.ShardSpec.from_dtensor("w", _FakeDTensor(full, [Partial()], _Mesh([2], [0])))

    class _StridedShard(_Shard):  # FSDP2 over TP: not a nested torch.chunk
        def __init__(self, dim, split_factor):
            super().__init__(dim)
            self.split_factor = split_factor

        def __repr__(self):
            return f"_StridedShard(dim={self.dim}, split_factor={self.split_factor})"

    strided = _FakeDTensor(full, [_Shard(0), _Shard(0)], _Mesh([2, 2], [1, 0]))
    strided.placements = [_StridedShard(0, 2), _Shard(0)]
    with pytest.raises(ds.UnsupportedError, match=r"_StridedShard\(dim=0, split_factor=2\)"):
        ds.ShardSpec.from_dtensor("w", strided)
    with pytest.raises(ds.InvalidArgumentError, match="not a DTensor"):
        ds.ShardSpec.from_dtensor("w", full)


def _torch_group_worker(rank, size, init, rendezvous_dir, syncs):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=size)
    try:
        w = model(7)
        group = ds.TorchGroup(timeout_s=60)
        run_rounds(group, rank, w, lambda k: step(w, k), syncs)
    finally:
        dist.destroy_process_group()


def test_processes_over_a_torch_distributed_gloo_group(tmp_path):
    init = "file://" + str(tmp_path / "pg_init")
    mp.spawn(_torch_group_worker, args=(3, init, str(tmp_path), 3), nprocs=3, join=True)


def _quantize_shard_worker(rank, size, init):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=size)
    try:
        group = ds.TorchGroup(timeout_s=60)
        rng = np.random.default_rng(3)
        w = (rng.standard_normal((300, 200)) * 0.02).astype(np.float32)
        w[::37, ::11] *= 40  # blocks of different ranges
        # A row border through a 128-row block and a column split below
        # it: blocks, rows and the tensor's one group shared between ranks.
        windows = [(0, 150, 0, 200), (150, 300, 0, 70), (150, 300, 70, 200)]
        r0, r1, c0, c1 = windows[rank]
        for scheme, fmt in [("block128", "f32"), ("block128", "ue8m0"), ("per_tensor", "f32"),
                            ("per_channel", "f32")]:
            whole_codes, whole_scales = ds.quantize_fp8(w, scheme, fmt)
            codes, scales, (g0, g1, h0, h1) = ds.quantize_fp8_shard(
                group, np.ascontiguousarray(w[r0:r1, c0:c1]), windows, w.shape, scheme, fmt)
            assert np.array_equal(codes, whole_codes[r0:r1, c0:c1]), (scheme, fmt, rank)
            grid = whole_scales.reshape(whole_scales.shape[0], -1)
            assert np.array_equal(scales, grid[g0:g1, h0:h1]), (scheme, fmt, rank)
        # A NaN on one rank fails the call on every rank.
        bad = np.ascontiguousarray(w[r0:r1, c0:c1])
        if rank == 2:
            bad[5, 5] = np.nan
        with pytest.raises(ds.InvalidArgumentError):
            ds.quantize_fp8_shard(group, bad, windows, w.shape)
        # One communicator for many weights and steps: the same bytes, a
        # refusal on every rank that leaves it usable, then closed.
        with ds.Fp8ShardQuantizer(group) as q:
            assert (q.rank, q.size) == (rank, size)
            for step in range(3):
                v = w * (1 + step / 7)
                for scheme, fmt in [("block128", "ue8m0"), ("per_channel", "f32")]:
                    whole_codes, whole_scales = ds.quantize_fp8(v, scheme, fmt)
                    codes, scales, (g0, g1, h0, h1) = q.quantize(
                        np.ascontiguousarray(v[r0:r1, c0:c1]), windows, v.shape, scheme, fmt)
                    assert np.array_equal(codes, whole_codes[r0:r1, c0:c1]), (step, scheme, rank)
                    grid = whole_scales.reshape(whole_scales.shape[0], -1)
                    assert np.array_equal(scales, grid[g0:g1, h0:h1]), (step, scheme, rank)
                if step == 1:
                    with pytest.raises(ds.InvalidArgumentError, match="NaN|rank 2"):
                        q.quantize(bad, windows, w.shape)
        with pytest.raises(ds.FailedPreconditionError, match="closed"):
            q.quantize(bad, windows, w.shape)
    finally:
        dist.destroy_process_group()


def test_quantize_fp8_shard_over_a_torch_group_equals_the_whole_weight(tmp_path):
    init = "file://" + str(tmp_path / "pg_init")
    mp.spawn(_quantize_shard_worker, args=(3, init), nprocs=3, join=True)
