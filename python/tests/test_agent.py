"""The agent and the coordinator from Python: the trainer publishes and every
engine host's agent pulls, verifies and reloads through a Python callable."""

import socket

import pytest
import torch

import deltasync as ds
import st_io


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_coordinator_syncs_two_agents_and_reloads_in_python(tmp_path):
    w = {"w": torch.randn(128, 64).to(torch.bfloat16), "b": torch.randn(7)}
    (tmp_path / "base").mkdir()
    st_io.write(tmp_path / "base" / "model.safetensors", w)
    reloads = {0: [], 1: []}
    agents = [ds.Agent(tmp_path / f"local{i}", tmp_path / "store", tmp_path / "base",
                       reload=lambda path, version, i=i: reloads[i].append((path, version)))
              for i in range(2)]
    try:
        with ds.SyncCoordinator(tmp_path / "store", [a.url for a in agents], w) as coord:
            start = coord.pull_all(0)
            assert start["ok"] and len(start["engines"]) == 2
            for k in range(3):
                w["w"].view(-1)[k * 5] += 1
                report = coord.sync(w)
                assert report["ok"] and report["version"] == k + 1
                assert all(e["version"] == k + 1 for e in report["engines"])
                assert report["publish"]["changed_elements"] == 1
                for i in range(2):
                    got = st_io.read(tmp_path / f"local{i}" / "model.safetensors")
                    assert torch.equal(got["w"].view(torch.int16), w["w"].view(torch.int16))
            assert coord.latest_version == 3
        assert [v for _, v in reloads[0]][-3:] == [1, 2, 3]
        assert reloads[1][-1][0] == str(tmp_path / "local1")
    finally:
        for a in agents:
            a.close()
    with pytest.raises(ds.FailedPreconditionError, match="Agent is closed"):
        agents[0].port


def test_a_failed_engine_raises_with_the_report(tmp_path):
    w = {"w": torch.zeros(16)}
    dead = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ds.AbortedError) as e:
        ds.pull_on_engines([dead], 1, retries=0, connect_timeout_s=1, timeout_s=2)
    assert e.value.report["engines"][0]["error_code"] == "connection"
    report = ds.pull_on_engines([dead], 1, retries=0, connect_timeout_s=1, timeout_s=2,
                                check=False)
    assert not report["ok"]
    with pytest.raises(ds.InvalidArgumentError, match="scheme"):
        ds.SyncCoordinator(tmp_path / "store", ["ftp://h:1"], w)
    with pytest.raises(ds.InvalidArgumentError, match="at least one engine"):
        ds.SyncCoordinator(tmp_path / "store", [], w)


def test_a_reload_that_raises_fails_the_pull(tmp_path):
    w = {"w": torch.zeros(16)}
    (tmp_path / "base").mkdir()
    st_io.write(tmp_path / "base" / "model.safetensors", w)

    def broken(path, version):
        raise RuntimeError("engine refused")

    with ds.Agent(tmp_path / "local", tmp_path / "store", tmp_path / "base", reload=broken) as a:
        with ds.SyncCoordinator(tmp_path / "store", [a.url], w, retries=0) as coord:
            w["w"][0] = 1
            with pytest.raises(ds.AbortedError, match="engine refused") as e:
                coord.sync(w)
            assert e.value.report["version"] == 1
