"""The SGLang adapter against a stand-in of SGLang's weight-update path
(standins_sglang.py): a refused payload leaves the server alive and every
weight unchanged, the trainer learns why and its next push repairs; a push
larger than the bucket bound takes several calls, each under it; the HTTP
route's per-rank body; the tensor path as the only one; draft models that
receive the same payload; the pair DeepSeek's loader fuses only when one
call holds both, split across calls; a worker of one pipeline stage keeps no
copy of the other stages' tensors."""

import pytest
import torch

import deltasync as ds
from deltasync.adapters import sglang as ds_sglang
from standins import assert_matches_reference, make_checkpoint, rl_step, same_bits
from standins_sglang import (
    EagleDraft,
    MTPDraft,
    SGLangServerStandIn,
    draft_matches_reference,
    http_serialize,
)

LOADER = [ds_sglang.LOAD_FORMAT]


def params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def unchanged(model, before):
    return all(same_bits(p.data, before[n]) for n, p in model.named_parameters())


def drop_values(rank, named_tensors):
    """A payload damaged on its way: one delta's values are missing."""
    victim = next(n for n, _ in named_tensors if n.endswith("#values"))
    return [(n, t) for n, t in named_tensors if n != victim]


# --- 7: a refused payload never kills the server ---------------------------


def test_a_damaged_payload_is_refused_the_server_lives_and_the_next_push_repairs():
    server = SGLangServerStandIn(2, LOADER)
    pusher = ds_sglang.SGLangPusher(server)
    ckpt = make_checkpoint(10)
    pusher.push(ckpt)
    rl_step(ckpt, 0)
    assert not pusher.push(ckpt)["full"]
    before = [params(m) for m in server.workers]

    rl_step(ckpt, 1)
    server.tamper = drop_values
    with pytest.raises(ds.InvalidArgumentError, match="its delta not sent.*next push sends every"):
        pusher.push(ckpt)
    assert server.alive, server.death
    for m, b in zip(server.workers, before):
        assert unchanged(m, b), "a refused payload changed a weight"
        status = ds_sglang.sync_status(m)
        assert status["step"] == 2 and "its delta not sent" in status["error"]

    server.tamper = None
    r = pusher.push(ckpt)
    assert r["full"], "after a refusal the pusher must send every tensor"
    for m in server.workers:
        assert_matches_reference(m, ckpt)
        assert ds_sglang.sync_status(m) == dict(ds_sglang.sync_status(m), step=3, error=None)
    rl_step(ckpt, 2)
    assert not pusher.push(ckpt)["full"]
    for m in server.workers:
        assert_matches_reference(m, ckpt)


def test_a_delta_to_a_restarted_engine_is_refused_and_the_next_push_repairs():
    server = SGLangServerStandIn(2, LOADER)
    pusher = ds_sglang.SGLangPusher(server)
    ckpt = make_checkpoint(11)
    pusher.push(ckpt)
    server.restart()  # the engine came back with fresh weights, the trainer did not notice
    before = [params(m) for m in server.workers]
    rl_step(ckpt, 0)
    with pytest.raises(ds.FailedPreconditionError, match="before any full push"):
        pusher.push(ckpt)
    assert server.alive
    assert all(unchanged(m, b) for m, b in zip(server.workers, before))
    assert pusher.push(ckpt)["full"]
    for m in server.workers:
        assert_matches_reference(m, ckpt)


def test_an_old_call_replayed_is_refused_without_harm():
    server = SGLangServerStandIn(1, LOADER)
    pusher = ds_sglang.SGLangPusher(server)
    ckpt = make_checkpoint(12)
    pusher.push(ckpt)
    rl_step(ckpt, 0)
    pusher.push(ckpt)
    old = server.loader_calls[-1][2]  # step 2's payload
    rl_step(ckpt, 1)
    pusher.push(ckpt)
    model = server.workers[0]
    before = params(model)
    # SGLang answers (True, "Success") whatever the loader did: the verdict is the worker's.
    assert server.update_weights_from_tensor(old, load_format=ds_sglang.LOAD_FORMAT) == \
        (True, "Success")
    assert server.alive and unchanged(model, before)
    assert "holds step 3" in ds_sglang.sync_status(model)["error"]
    with pytest.raises(ds.FailedPreconditionError, match="holds step 3"):
        ds_sglang.load_weights(model, old)  # the raising variant, for in-process engines
    rl_step(ckpt, 2)
    assert not pusher.push(ckpt)["full"]  # the worker's step was never touched
    assert_matches_reference(model, ckpt)


def test_the_loader_never_raises_whatever_it_is_given():
    model = SGLangServerStandIn(1, LOADER).workers[0]
    junk = [
        [],
        [("x", torch.zeros(3))],
        [(ds_sglang.MANIFEST, torch.frombuffer(bytearray(b"{not json"), dtype=torch.uint8))],
        [(ds_sglang.MANIFEST, ds_sglang._manifest_tensor({"format": 1, "step": "2"}))],
        [(ds_sglang.MANIFEST, ds_sglang._manifest_tensor(
            {"format": 1, "step": 1, "full": True, "tensors": [{"name": 3}]}))],
        [(ds_sglang.MANIFEST, ds_sglang._manifest_tensor(
            {"format": 1, "step": 1, "full": False, "part": 1, "parts": 2, "tensors": []}))],
    ]
    before = params(model)
    for payload in junk:
        ds_sglang.custom_loader(model, payload)
        assert ds_sglang.sync_status(model)["error"]
    assert unchanged(model, before)
    assert ds_sglang.sync_status(model)["refused"] == len(junk)


# --- 8: bucketed calls -------------------------------------------------------


def total_bytes(ckpt):
    return sum(t.numel() * t.element_size() for t in ckpt.values())


def test_a_push_larger_than_the_bound_takes_several_calls_each_under_it():
    bound = 12 << 10  # under the largest tensor (16 KiB): it travels as ranges
    server = SGLangServerStandIn(2, LOADER)
    pusher = ds_sglang.SGLangPusher(server, bucket_bytes=bound)
    ckpt = make_checkpoint(13)
    assert total_bytes(ckpt) > 10 * bound
    r = pusher.push(ckpt)
    assert r["full"] and r["calls"] == len(server.requests) > 10
    moved = [b for _, _, b in server.device_bytes]
    assert len(moved) == 2 * r["calls"] and max(moved) <= bound
    # Only the push's last call flushes the cache.
    assert [q["flush_cache"] for q in server.requests] == [False] * (r["calls"] - 1) + [True]
    for m in server.workers:
        assert_matches_reference(m, ckpt)

    for step, density in ((0, 0.02), (1, 0.6)):
        del server.device_bytes[:]
        n = len(server.requests)
        rl_step(ckpt, step, density)
        r = pusher.push(ckpt)
        assert not r["full"] and r["calls"] == len(server.requests) - n
        assert max(b for _, _, b in server.device_bytes) <= bound
        if density > 0.5:
            assert r["calls"] > 10 and r["bytes"] > 10 * bound
        for m in server.workers:
            assert_matches_reference(m, ckpt)


class Scaled(torch.nn.Module):
    """One mapped tensor and one the loader computes on (stock path), the
    latter larger than the bound."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(64, 64), requires_grad=False)
        self.s = torch.nn.Parameter(torch.zeros(4096), requires_grad=False)

    def load_weights(self, weights):
        for name, t in weights:
            if name == "w":
                self.w.data.copy_(t)
            else:
                self.s.data.copy_(t * 2)


class ScaledEngine:
    def __init__(self):
        self.model = Scaled()
        self.sizes = []

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        self.sizes.append(sum(t.numel() * t.element_size() for _, t in named_tensors))
        ds_sglang.custom_loader(self.model, list(named_tensors))
        return True, "Success"


def test_a_stock_path_tensor_larger_than_the_bound_is_assembled_from_ranges():
    engine = ScaledEngine()
    pusher = ds_sglang.SGLangPusher(engine, bucket_bytes=4096)
    g = torch.Generator().manual_seed(0)
    w = {"w": torch.randn(64, 64, generator=g), "s": torch.randn(4096, generator=g)}
    r = pusher.push(w)
    assert r["calls"] >= 8 and max(engine.sizes) <= 4096
    state = ds_sglang.engine_weights(engine.model)
    assert state.fallback == ["s"]
    assert torch.equal(engine.model.s, w["s"] * 2) and torch.equal(engine.model.w, w["w"])
    w["s"][::3] += 1
    w["w"][5] -= 1
    pusher.push(w)
    assert torch.equal(engine.model.s, w["s"] * 2) and torch.equal(engine.model.w, w["w"])


def test_a_call_out_of_order_within_a_push_is_refused():
    engine = ScaledEngine()
    pusher = ds_sglang.SGLangPusher(engine, bucket_bytes=4096)
    g = torch.Generator().manual_seed(1)
    w = {"w": torch.randn(64, 64, generator=g), "s": torch.randn(4096, generator=g)}
    sent = []
    real = engine.update_weights_from_tensor

    def recording(named_tensors, load_format=None, flush_cache=True):
        sent.append(named_tensors)
        return real(named_tensors, load_format, flush_cache)

    engine.update_weights_from_tensor = recording
    assert pusher.push(w)["calls"] >= 3
    fresh = Scaled()
    ds_sglang.custom_loader(fresh, sent[0])
    ds_sglang.custom_loader(fresh, sent[2])  # call 2 lost on its way
    status = ds_sglang.sync_status(fresh)
    assert "out of order" in status["error"] and status["step"] is None and status["pending"]
    for call in sent[1:]:
        ds_sglang.custom_loader(fresh, call)
    assert ds_sglang.sync_status(fresh)["step"] == 1
    assert torch.equal(fresh.s, w["s"] * 2) and torch.equal(fresh.w, w["w"])

    # A call that reaches no worker is an error at the trainer, and the next push is whole.
    engine.update_weights_from_tensor = lambda named_tensors, load_format=None, flush_cache=True: \
        (True, "Success")
    w["w"] += 1
    with pytest.raises(ds.FailedPreconditionError, match="0 of 1 workers reported"):
        pusher.push(w)
    engine.update_weights_from_tensor = real
    assert pusher.push(w)["full"]
    assert torch.equal(engine.model.w, w["w"])


# --- 9: routes and limits ----------------------------------------------------


def test_the_http_route_gets_one_serialized_payload_per_tp_rank():
    server = SGLangServerStandIn(2, LOADER)
    bodies = []

    def post(url, body, timeout_s):
        bodies.append(body)
        assert url == "http://engine:30000/update_weights_from_tensor"
        return server.http_post("/update_weights_from_tensor", body)

    client = ds_sglang.SGLangHTTPClient("http://engine:30000/", 2, serialize=http_serialize, post=post)
    pusher = ds_sglang.SGLangPusher(client)
    ckpt = make_checkpoint(14)
    pusher.push(ckpt)
    rl_step(ckpt, 0)
    pusher.push(ckpt)
    for m in server.workers:
        assert_matches_reference(m, ckpt)
    assert all(sorted(b) == ["flush_cache", "load_format", "serialized_named_tensors"]
               and len(b["serialized_named_tensors"]) == 2
               and b["load_format"] == ds_sglang.LOAD_FORMAT for b in bodies)
    # The engine call's own arguments are not what the route takes.
    status, _ = server.http_post("/update_weights_from_tensor",
                                 {"named_tensors": [], "load_format": ds_sglang.LOAD_FORMAT})
    assert status == 400
    # A route that answers success=False is an error at the trainer.
    refusing = ds_sglang.SGLangHTTPClient("http://engine:30000", 2, serialize=http_serialize,
                                          post=lambda u, b, t: (400, {"success": False,
                                                                      "message": "no"}))
    with pytest.raises(ds.FailedPreconditionError, match="SGLang refused"):
        ds_sglang.SGLangPusher(refusing).push(ckpt)


def test_the_http_client_needs_sglangs_serializer_or_one_given():
    try:
        import sglang  # noqa: F401
        pytest.skip("sglang is installed here")
    except ImportError:
        pass
    client = ds_sglang.SGLangHTTPClient("http://engine:30000", 1)
    with pytest.raises(ds.UnsupportedError, match="serialize="):
        client.update_weights_from_tensor([("x", torch.zeros(1))])


def test_the_pusher_takes_the_tensor_path_only():
    class DistributedOnly:
        def update_weights_from_distributed(self, names, dtypes, shapes, group_name="g",
                                            flush_cache=True, load_format=None):
            return True, "ok"

    with pytest.raises(ds.InvalidArgumentError, match="never calls a custom loader.*one host"):
        ds_sglang.SGLangPusher(DistributedOnly())
    # In SGLang the broadcast path runs model.load_weights, never the custom
    # loader: deltasync's payload would land as checkpoint names.
    server = SGLangServerStandIn(1, LOADER)
    ok, message = server.update_weights_from_distributed(
        [ds_sglang.MANIFEST], ["uint8"], [[8]], load_format=ds_sglang.LOAD_FORMAT)
    assert not ok and "__deltasync__" in message and not server.loader_calls
    pusher = ds_sglang.SGLangPusher(server)
    pusher.push(make_checkpoint(15))
    assert server.distributed_calls == 1 and server.loader_calls


@pytest.mark.parametrize("draft_first", [True, False])
def test_a_draft_model_gets_the_same_payload_and_each_model_applies_it_once(draft_first):
    server = SGLangServerStandIn(2, LOADER, draft="mtp", draft_first=draft_first)
    pusher = ds_sglang.SGLangPusher(server, bucket_bytes=24 << 10)
    ckpt = make_checkpoint(16)
    for step in range(3):
        if step:
            rl_step(ckpt, step)
        pusher.push(ckpt)
        for m, d in zip(server.workers, server.drafts):
            assert_matches_reference(m, ckpt)
            assert draft_matches_reference(d, ckpt)
    assert pusher._seen_workers == 4  # two models in each of two ranks
    # Per rank, the draft and the target got the very same payload, in SGLang's order.
    calls = server.loader_calls
    for i in range(0, len(calls), 2):
        (r0, role0, p0), (r1, role1, p1) = calls[i], calls[i + 1]
        assert r0 == r1 and [n for n, _ in p0] == [n for n, _ in p1]
        assert all(a is b for (_, a), (_, b) in zip(p0, p1))
        assert (role0, role1) == (("draft", "target") if draft_first else ("target", "draft"))
    # The same call again, to the same model: nothing to do, nothing refused.
    rank, role, last = calls[-1]
    model = server.workers[rank] if role == "target" else server.drafts[rank]
    before = params(model)
    stats = dict(ds_sglang.engine_weights(model).stats)
    ds_sglang.custom_loader(model, last)
    assert unchanged(model, before) and ds_sglang.sync_status(model)["error"] is None
    assert ds_sglang.engine_weights(model).stats == stats


def test_a_draft_model_that_cannot_take_the_checkpoint_is_named_or_left_alone():
    server = SGLangServerStandIn(2, LOADER, draft="eagle")
    ckpt = make_checkpoint(17)
    pusher = ds_sglang.SGLangPusher(server)
    with pytest.raises(ds.FailedPreconditionError, match="EagleDraft.*skip_models"):
        pusher.push(ckpt)
    assert server.alive
    for m in server.workers:  # the target took it (SGLang goes on after a loader that returns)
        assert_matches_reference(m, ckpt)
    assert all(torch.count_nonzero(d.down) == 0 for d in server.drafts)

    server.restart()
    pusher = ds_sglang.SGLangPusher(server, skip_models=["EagleDraft"])
    for step in range(2):
        if step:
            rl_step(ckpt, step)
        assert pusher.push(ckpt)["full"] == (step == 0)
        for m, d in zip(server.workers, server.drafts):
            assert_matches_reference(m, ckpt)
            assert torch.count_nonzero(d.down) == 0
    assert isinstance(server.drafts[0], EagleDraft) and issubclass(EagleDraft, MTPDraft)


# --- a pair fused only when both arrive in one call --------------------------


class DeepseekEngine:
    """One TP worker running SGLang's DeepSeek loader (standins_engines.
    PoolModel, or the model ``make()`` builds): each update_weights_from_tensor
    call reaches the custom loader as one call of its own."""

    def __init__(self, make=None):
        from standins_engines import PoolModel

        self.model = (make or PoolModel)()
        self.calls = []

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        self.calls.append([n for n, _ in named_tensors])
        ds_sglang.custom_loader(self.model, list(named_tensors))
        return True, "Success"


def _matches_fresh_load(model, ckpt, make=None):
    """``model`` holds what a fresh one (``make(seed)``, by default a
    PoolModel) loaded whole from ``ckpt`` holds, the weights its loader
    derives after loading included."""
    from standins_engines import PPMissingLayer, PoolModel, reference

    ref = reference(make or PoolModel, ckpt)
    got, want = dict(model.named_parameters()), dict(ref.named_parameters())
    assert sorted(got) == sorted(want)
    for n in got:
        assert same_bits(got[n].data, want[n].data), f"parameter {n} differs from a fresh load"
    for a, b in zip(model.model.layers, ref.model.layers):
        if isinstance(b, PPMissingLayer):  # another pipeline stage's layer
            continue
        assert same_bits(a.self_attn.w_kc, b.self_attn.w_kc)
        assert same_bits(a.self_attn.w_vc, b.self_attn.w_vc)


def test_a_fused_pair_split_across_calls_and_a_delta_to_one_of_them_reach_the_fused_weight():
    from standins_engines import randn_checkpoint

    engine = DeepseekEngine()
    ckpt = randn_checkpoint(engine.model.shapes(), 31)
    pusher = ds_sglang.SGLangPusher(engine, bucket_bytes=4096)
    pusher.push(ckpt)
    qa, kva = "model.layers.0.self_attn.q_a_proj.weight", \
        "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"
    call = {n: i for i, names in enumerate(engine.calls) for n in names}
    assert call[qa] != call[kva], "the push was to split the pair across calls"
    state = ds_sglang.engine_weights(engine.model)
    assert state.map.joint[qa] == [qa, kva]
    _matches_fresh_load(engine.model, ckpt)
    # A delta to one of the pair only.
    ckpt[qa].view(-1)[::5] += 1
    r = pusher.push(ckpt)
    assert not r["full"] and r["tensors_changed"] == 1
    _matches_fresh_load(engine.model, ckpt)
    rl_step(ckpt, 3)
    pusher.push(ckpt)
    _matches_fresh_load(engine.model, ckpt)


# --- a worker that holds one pipeline stage ---------------------------------------


def test_a_worker_of_one_pipeline_stage_keeps_no_copy_of_the_other_stages_tensors():
    from standins_engines import PoolModel, layer_id, randn_checkpoint

    def make(seed=7):  # the second of two stages: layers 2 and 3 of 4
        return PoolModel(seed, pp_rank=1, pp_size=2)

    engine = DeepseekEngine(make)
    ckpt = randn_checkpoint(engine.model.shapes(), 32)
    others = {n for n in ckpt if layer_id(n) in (0, 1)}
    # A bound under the larger tensors: they travel as ranges, the other
    # stages' too, and the stock-path ones are assembled on the host.
    pusher = ds_sglang.SGLangPusher(engine, bucket_bytes=4096)
    for k in range(3):
        if k:
            rl_step(ckpt, k)
        assert pusher.push(ckpt)["full"] == (k == 0)
        assert ds_sglang.sync_status(engine.model)["error"] is None
        state = ds_sglang.engine_weights(engine.model)
        assert set(state.skipped) == others
        # Host copies only of this stage's stock-path tensors.
        assert sorted(state.shadows) == [f"model.layers.{i}.self_attn.kv_b_proj.weight"
                                         for i in (2, 3)]
        _matches_fresh_load(engine.model, ckpt, make)
    ranged = {n.split("#")[0] for names in engine.calls for n in names if "#range." in n}
    assert ranged & others and ranged - others
    assert state.stats["skipped_deltas"] > 0
