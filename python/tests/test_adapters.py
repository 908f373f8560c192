"""The engine adapters against stand-ins with SGLang's and vLLM's call
signatures: after every delta each worker's parameters are bit-identical to
loading the full new checkpoint with the model's own load_weights."""

import threading

import pytest
import torch

import deltasync as ds
from deltasync.adapters import EngineWeights, learn
from deltasync.adapters import sglang as ds_sglang
from standins import (
    SGLangEngineStandIn,
    TinyTPModel,
    VLLMClientStandIn,
    assert_matches_reference,
    checkpoint_shapes,
    install_vllm_standin,
    make_checkpoint,
    rl_step,
)


def meta(ckpt):
    return [(n, "BF16", list(t.shape)) for n, t in ckpt.items()]


def test_dry_run_maps_slices_fused_stacked_and_renamed_tensors():
    ckpt = make_checkpoint()
    for rank in range(2):
        model = TinyTPModel(rank, 2)
        wm = learn(model, meta(ckpt))
        # Only the transformed tensor takes the stock path, with its reason.
        assert sorted(wm.unmapped) == ["model.layers.0.rotary.scale", "model.layers.1.rotary.scale"]
        assert "computed" in wm.unmapped["model.layers.0.rotary.scale"]
        q = wm.placements["model.layers.0.self_attn.q_proj.weight"]
        k = wm.placements["model.layers.0.self_attn.k_proj.weight"]
        assert q.param_name == k.param_name == "model.layers.0.self_attn.qkv_proj.weight"
        assert q.run_tuples() == [(rank * 32 * 64, 32 * 64, 0, 1)]  # one run: a row slice
        assert k.run_tuples() == [(rank * 16 * 64, 16 * 64, 32 * 64, 1)]
        o = wm.placements["model.layers.0.self_attn.o_proj.weight"]
        assert len(o.runs) == 64  # a column slice: one run per row
        assert wm.placements["model.norm.weight"].param_name == "model.final_layernorm.weight"
        e1 = wm.placements["model.layers.1.mlp.experts.1.w1.weight"]
        assert e1.run_tuples() == [(rank * 48 * 64, 48 * 64, 48 * 64, 1)]
        # The dry run wrote nothing.
        assert all(torch.count_nonzero(p) == 0 for _, p in model.named_parameters())


def test_engine_weights_scatter_equals_full_load_and_keeps_nan():
    ckpt = make_checkpoint(1)
    models = [TinyTPModel(r, 2) for r in range(2)]
    states = [EngineWeights(m, meta(ckpt)) for m in models]
    for s in states:
        s.load_full(list(ckpt.items()))
    snapshot = {n: t.clone() for n, t in ckpt.items()}
    for step in range(3):
        rl_step(ckpt, step)
        for s in states:
            for n, t in ckpt.items():
                pos, val = ds.diff(t, snapshot[n], name=n).as_torch(torch.bfloat16)
                s.check_delta(n, pos, val)
                s.apply_delta(n, pos, val)
        for n, t in ckpt.items():
            snapshot[n].copy_(t)
        for m in models:
            assert_matches_reference(m, ckpt)
    assert states[0].stats["scattered_tensors"] > 0
    assert torch.isnan(ckpt[list(ckpt)[3]].float()).any()


def test_sglang_custom_loader_round_trip():
    engine = SGLangEngineStandIn(2, custom_weight_loader=[ds_sglang.LOAD_FORMAT])
    pusher = ds_sglang.SGLangPusher(engine)
    ckpt = make_checkpoint(2)
    first = pusher.push(ckpt)
    assert first["full"]
    for m in engine.workers:
        assert_matches_reference(m, ckpt)
    total = sum(t.numel() for t in ckpt.values())
    for step in range(4):
        rl_step(ckpt, step)
        r = pusher.push(ckpt)
        assert not r["full"] and 0 < r["changed_elements"] < total * 0.05
        for m in engine.workers:
            assert_matches_reference(m, ckpt)
    state = ds_sglang.engine_weights(engine.workers[0])
    assert state.fallback == ["model.layers.0.rotary.scale", "model.layers.1.rotary.scale"]
    assert state.stats["scattered_elements"] > 0


def test_sglang_loader_refuses_bad_payloads_and_writes_nothing():
    engine = SGLangEngineStandIn(1, custom_weight_loader=[ds_sglang.LOAD_FORMAT])
    ckpt = make_checkpoint(3)
    pusher = ds_sglang.SGLangPusher(engine)
    model = engine.workers[0]
    with pytest.raises(ds.FailedPreconditionError, match="before any full push"):
        ds_sglang.load_weights(model, [(ds_sglang.MANIFEST, ds_sglang._manifest_tensor(
            {"format": 1, "step": 2, "base_step": 1, "full": False, "tensors": []}))])
    pusher.push(ckpt)
    before = {n: p.clone() for n, p in model.named_parameters()}
    name = "model.layers.0.mlp.down_proj.weight"

    def payload(step, base, pos, val, count=None):
        m = {"format": 1, "step": step, "base_step": base, "full": False,
             "tensors": [{"name": "model.embed_tokens.weight", "dtype": "BF16",
                          "shape": [128, 64], "count": 1},
                         {"name": name, "dtype": "BF16", "shape": [64, 96],
                          "count": count if count is not None else pos.numel()}]}
        ok_pos = torch.tensor([0], dtype=torch.int64)
        ok_val = torch.tensor([1.0], dtype=torch.bfloat16)
        return [(ds_sglang.MANIFEST, ds_sglang._manifest_tensor(m)),
                ("model.embed_tokens.weight#positions", ok_pos),
                ("model.embed_tokens.weight#values", ok_val),
                (name + "#positions", pos), (name + "#values", val)]

    good_val = torch.tensor([2.0], dtype=torch.bfloat16)
    cases = [
        (payload(3, 2, torch.tensor([1]), good_val), ds.FailedPreconditionError, "holds step 1"),
        (payload(2, 1, torch.tensor([64 * 96]), good_val), ds.InvalidArgumentError, "outside"),
        (payload(2, 1, torch.tensor([1]), torch.tensor([2.0])), ds.InvalidArgumentError, "values of"),
        (payload(2, 1, torch.tensor([1, 2]), good_val), ds.InvalidArgumentError, "2 positions but 1"),
        (payload(2, 1, torch.tensor([1]), good_val, count=5), ds.InvalidArgumentError, "manifest says"),
    ]
    for p, exc, text in cases:
        with pytest.raises(exc, match=text):
            ds_sglang.load_weights(model, p)
        for n, t in model.named_parameters():
            assert torch.equal(t, before[n]), f"a refused payload changed {n}"
    bad = [(ds_sglang.MANIFEST, torch.frombuffer(bytearray(b"{not json"), dtype=torch.uint8))]
    with pytest.raises(ds.CorruptionError):
        ds_sglang.load_weights(model, bad)
    unknown = payload(2, 1, torch.tensor([1]), good_val)
    unknown[0] = (ds_sglang.MANIFEST, ds_sglang._manifest_tensor(
        {"format": 1, "step": 2, "base_step": 1, "full": False,
         "tensors": [{"name": "no.such.tensor", "dtype": "BF16", "shape": [1], "count": 1}]}))
    unknown += [("no.such.tensor#positions", torch.tensor([0])),
                ("no.such.tensor#values", good_val)]
    with pytest.raises(ds.NotFoundError, match="no.such.tensor"):
        ds_sglang.load_weights(model, unknown)


def test_vllm_weight_transfer_engine_over_the_stream(rendezvous):
    factory = install_vllm_standin()
    from deltasync.adapters import vllm as ds_vllm

    ds_vllm.register()

    class Config:
        backend = "deltasync"

    class ParallelConfig:
        def __init__(self, rank):
            self.rank = rank

    class VllmConfig:
        def __init__(self, rank):
            self.parallel_config = ParallelConfig(rank)

    workers = [TinyTPModel(r, 2) for r in range(2)]
    engines = [factory.create_engine(Config(), VllmConfig(r), torch.device("cpu"), workers[r])
               for r in range(2)]
    assert all(isinstance(e, ds_vllm.DeltasyncWeightTransferEngine) for e in engines)
    client = VLLMClientStandIn(engines)
    ckpt = make_checkpoint(4)
    trainer = ds_vllm.DeltasyncTrainer(client, ckpt, rendezvous=rendezvous, workers=2,
                                       timeout_s=30)
    try:
        for step in range(4):
            if step:
                rl_step(ckpt, step)
            stats = trainer.send_weights(ckpt)
            assert stats["sync_id"] == step + 1
            for m in workers:
                assert_matches_reference(m, ckpt)
        assert engines[0].fallback == ["model.layers.0.rotary.scale",
                                       "model.layers.1.rotary.scale"]
        assert client.calls[:4] == ["init", "start", "update", "finish"]
        with pytest.raises(ValueError, match="Invalid update_info"):
            engines[0].update_weights({"no_such_field": 1})
    finally:
        trainer.close()
        for e in engines:
            e.shutdown()
