"""The stream as users and attackers meet it from Python: destinations whose
memory moves, calls and close() from several threads, training steps longer
than the timeout, the rendezvous forms, the authenticated mode, and the
checks a Group makes when it is built."""

import os
import queue
import shutil
import socket
import subprocess
import threading
import time
import warnings

import pytest
import torch

import deltasync as ds

pytestmark = pytest.mark.skipif("gloo" not in ds.built_communicators(),
                                reason="this build has no gloo communicator")


def model(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"emb": torch.randn(64, 32, generator=g).to(torch.bfloat16),
            "norm": torch.randn(32, generator=g)}


def step(w, k):
    w["emb"].view(-1)[k::41] += 1
    w["norm"][k % 32] += 0.5


def bits(t):
    return t.contiguous().view(torch.uint8)


class Worker:
    """A receiver on a thread of its own that runs what it is told, one
    call at a time, and hands back each call's result or exception."""

    def __init__(self, rx):
        self.rx = rx
        self._calls = queue.Queue()
        self._results = queue.Queue()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while True:
            fn = self._calls.get()
            if fn is None:
                return
            try:
                self._results.put((True, fn()))
            except BaseException as e:  # handed to the test
                self._results.put((False, e))

    def start(self, fn):
        self._calls.put(fn)

    def result(self, timeout=30):
        return self._results.get(timeout=timeout)

    def stop(self):
        self._calls.put(None)
        self._thread.join(timeout=30)


def seeded_pair(rendezvous, w, dests, **rx_kwargs):
    """A sender and a receiver (on a Worker) that took the first sync."""
    rx = ds.StreamReceiver(ds.Group(rendezvous, 1, 2, timeout_s=20), **rx_kwargs)
    rx.register_all(dests)
    worker = Worker(rx)
    tx = ds.StreamSender(ds.Group(rendezvous, 0, 2, timeout_s=20))
    worker.start(rx.receive)
    tx.sync(w)
    ok, got = worker.result()
    assert ok, got
    return tx, rx, worker


def round_trip(tx, worker, w):
    """One sync: (the sender's result or exception, the receiver's)."""
    worker.start(worker.rx.receive)
    try:
        sent = tx.sync(w)
    except ds.DeltasyncError as e:
        sent = e
    _, got = worker.result()
    return sent, got


def _storage(t):
    return t.untyped_storage() if hasattr(t, "untyped_storage") else t.storage()


MOVERS = {
    "set_": lambda t: t.set_(torch.zeros_like(t)),
    "data": lambda t: setattr(t, "data", torch.zeros_like(t)),
    "freed": lambda t: _storage(t).resize_(0),
}


@pytest.mark.parametrize("how", sorted(MOVERS))
def test_a_destination_whose_memory_moved_is_refused_and_rebind_reseeds_it(rendezvous, how):
    w = model(1)
    dests = {n: torch.zeros_like(t) for n, t in w.items()}
    tx, rx, worker = seeded_pair(rendezvous, w, dests)
    try:
        emb = dests["emb"]
        MOVERS[how](emb)
        now = bits(emb).clone() if how != "freed" else None
        step(w, 1)
        sent, got = round_trip(tx, worker, w)
        assert isinstance(got, ds.FailedPreconditionError), got
        assert "tensor 'emb'" in str(got) and "nothing was written" in str(got)
        assert isinstance(sent, ds.DeltasyncError) and "tensor 'emb'" in str(sent), sent
        assert tx.committed_sync_id == 1
        if now is not None:
            assert torch.equal(bits(emb), now)  # the new memory untouched
        # The engine's tensor gets its memory back and the receiver is told.
        fresh = torch.zeros_like(w["emb"])
        rx.rebind("emb", fresh)
        sent, got = round_trip(tx, worker, w)
        assert isinstance(got, ds.FailedPreconditionError) and "asks for a seed" in str(got)
        sent, got = round_trip(tx, worker, w)
        assert not isinstance(sent, Exception), sent
        assert sent["seeded"] == 1
        assert torch.equal(bits(fresh), bits(w["emb"]))
        assert torch.equal(bits(dests["norm"]), bits(w["norm"]))
    finally:
        tx.close()
        rx.close()
        worker.stop()


def test_close_from_another_thread_ends_a_receive_and_a_second_caller_is_refused(rendezvous):
    w = model(2)
    tx, rx, worker = seeded_pair(rendezvous, w, {n: torch.zeros_like(t) for n, t in w.items()})
    try:
        worker.start(rx.receive)  # waits for a sync that does not come
        deadline = time.monotonic() + 10
        while not rx.health()["waiting"] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert rx.health()["in_call"]
        with pytest.raises(ds.FailedPreconditionError, match="one call at a time"):
            rx.receive()
        t0 = time.monotonic()
        rx.close()
        ok, got = worker.result()
        assert time.monotonic() - t0 < 3
        assert not ok and isinstance(got, ds.DeltasyncError), got
        assert "closed by another thread" in str(got)
        with pytest.raises(ds.FailedPreconditionError, match="closed"):
            rx.receive()
    finally:
        tx.close()
        worker.stop()


def _catch(fn):
    try:
        return fn()
    except BaseException as e:  # handed to the test
        return e


def test_close_from_another_thread_ends_a_sync_and_a_second_caller_is_refused(rendezvous):
    w = model(3)
    tx, rx, worker = seeded_pair(rendezvous, w, {n: torch.zeros_like(t) for n, t in w.items()})
    try:
        step(w, 1)
        # The receiver does not come to this sync: the sender waits on it.
        result = {}
        t = threading.Thread(target=lambda: result.update(r=_catch(lambda: tx.sync(w))))
        t.start()
        time.sleep(0.5)
        with pytest.raises(ds.FailedPreconditionError, match="one call at a time"):
            tx.sync(w)
        t0 = time.monotonic()
        tx.close()
        t.join(timeout=10)
        assert not t.is_alive()
        assert time.monotonic() - t0 < 3
        assert isinstance(result["r"], ds.DeltasyncError), result
        assert "closed by another thread" in str(result["r"])
    finally:
        rx.close()
        worker.stop()


def test_training_steps_longer_than_the_timeout_keep_the_delta(rendezvous):
    w = model(4)
    dests = {n: torch.zeros_like(t) for n, t in w.items()}
    results = []

    def receiver():
        with ds.StreamReceiver(ds.Group(rendezvous, 1, 2, timeout_s=1)) as rx:
            rx.register_all(dests)
            for _ in range(3):
                results.append(rx.receive())

    t = threading.Thread(target=receiver)
    t.start()
    with ds.StreamSender(ds.Group(rendezvous, 0, 2, timeout_s=1)) as tx:
        seeded = []
        for k in range(3):
            if k:
                time.sleep(2.2)  # a training step: over twice the timeout
                step(w, k)
            seeded.append(tx.sync(w)["seeded"])
    t.join(timeout=30)
    assert seeded == [1, 0, 0]
    assert [r["seed"] for r in results] == [True, False, False]
    assert results[2]["wait_s"] > 1.5
    for n, x in w.items():
        assert torch.equal(bits(dests[n]), bits(x)), n


def _bytes_off_a_page_start():
    # The check reads the bytes object's header only on the contents' own
    # memory page: keep an object whose header is there.
    kept = []
    for k in range(64):
        b = bytes(range(256)) * 4 + bytes([k])
        t = torch.frombuffer(b, dtype=torch.uint8)
        if t.data_ptr() % 4096 >= 64:
            return b, t
        kept.append(b)
    pytest.skip("no bytes object off a page start")


def test_a_tensor_over_immutable_bytes_is_refused_as_a_destination(rendezvous):
    rx = ds.StreamReceiver(ds.Group(rendezvous, 1, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        b, t = _bytes_off_a_page_start()
        with pytest.raises(ds.InvalidArgumentError, match="immutable bytes"):
            rx.register("b", t)
        rx.register("ok", torch.frombuffer(bytearray(b), dtype=torch.uint8))
        # Reading from bytes is fine: a sender only reads.
        ds.diff(t, t.clone())
    rx.close()


def test_messages_name_what_is_wrong(rendezvous):
    with pytest.raises(ds.InvalidArgumentError, match=r"\[10\].*\[12\]"):
        ds.diff(torch.zeros(10), torch.zeros(12))
    rx = ds.StreamReceiver(ds.Group(rendezvous, 1, 2))
    with pytest.raises(ds.InvalidArgumentError, match="not contiguous") as e:
        rx.register("w", torch.zeros(4, 4).t())
    assert ".contiguous()" not in str(e.value) and "view of" in str(e.value)
    rx.close()
    for bad, match in [(dict(rank=2, size=2), "rank 2 is outside a group of 2"),
                       (dict(rank=0, size=0), "size 0"),
                       (dict(rank=0, size=2, backend="mpi"), "backend 'mpi'"),
                       (dict(rank=0, size=2, timeout_s=0), "timeouts must be positive"),
                       (dict(rank=0, size=2, group="a/b"), "group name")]:
        with pytest.raises(ds.InvalidArgumentError, match=match):
            ds.Group(rendezvous, **bad)
    with pytest.raises(ds.InvalidArgumentError, match="unknown kind"):
        ds.Group("etcd://host", 0, 2)
    with pytest.raises(ds.InvalidArgumentError, match="password in the spec"):
        ds.Group("redis://:pw@127.0.0.1:6379", 0, 2)
    doc = " ".join(ds.StreamReceiver.__doc__.split())
    assert "holds either its committed value or the failed sync's" in doc
    assert "counts no changes" in " ".join(ds.StreamReceiver.receive.__doc__.split())


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def redis_server(tmp_path):
    binary = shutil.which("redis-server") or "/usr/bin/redis-server"
    if not os.path.exists(binary):
        pytest.skip("redis-server is not installed")
    servers = []

    def start(*extra):
        port = _free_port()
        p = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                              "--appendonly", "no", "--dir", str(tmp_path), *extra],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        servers.append(p)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                return port
            except OSError:
                time.sleep(0.02)
        pytest.skip("redis-server did not start")

    yield start
    for p in servers:
        p.terminate()
        p.wait(timeout=5)


def _sync_once(spec, w, **group):
    got = {n: torch.zeros_like(t) for n, t in w.items()}
    errors = []

    def receiver():
        try:
            with ds.StreamReceiver(ds.Group(spec, 1, 2, timeout_s=20, **group)) as rx:
                rx.register_all(got)
                rx.receive()
        except BaseException as e:  # handed to the test
            errors.append(e)

    t = threading.Thread(target=receiver)
    t.start()
    try:
        with ds.StreamSender(ds.Group(spec, 0, 2, timeout_s=20, **group)) as tx:
            tx.sync(w)
    finally:
        t.join(timeout=30)
    assert not errors, errors
    for n, x in w.items():
        assert torch.equal(bits(got[n]), bits(x)), n


def test_every_documented_rendezvous_form_connects(tmp_path, redis_server):
    w = model(5)
    _sync_once("file://" + str(tmp_path / "url"), w)
    assert os.stat(tmp_path / "url").st_mode & 0o777 == 0o700
    port = redis_server()
    _sync_once(f"redis://127.0.0.1:{port}", w, group="url")
    _sync_once(f"redis:127.0.0.1:{port}", w, group="plain")
    # A server with a password, given from a private file.
    secured = redis_server("--requirepass", "the-redis-pw")
    pw = tmp_path / "redis-pw"
    pw.write_text("the-redis-pw\n")
    pw.chmod(0o600)
    _sync_once(f"redis://127.0.0.1:{secured}", w, redis_password_file=str(pw))
    with pytest.raises(ds.DeltasyncError, match="asks for a password"):
        with ds.StreamSender(ds.Group(f"redis://127.0.0.1:{secured}", 0, 1)) as tx:
            tx.sync(w)


def test_the_authenticated_mode_syncs_and_a_member_with_another_key_is_never_taken(tmp_path):
    w = model(6)
    key = tmp_path / "key"
    key.write_bytes(os.urandom(32))
    key.chmod(0o600)
    _sync_once("file:" + str(tmp_path / "auth"), w, key_file=str(key))
    # A key others may read is refused.
    loose = tmp_path / "loose"
    loose.write_bytes(os.urandom(32))
    loose.chmod(0o644)
    with pytest.raises(ds.InvalidArgumentError, match="chmod 600"):
        ds.StreamSender(ds.Group("file:" + str(tmp_path / "x"), 0, 2, key_file=str(loose)))
    # A rogue rank 0 with another key: the receiver refuses it, holding
    # nothing of its model.
    rogue = tmp_path / "rogue"
    rogue.write_bytes(os.urandom(32))
    rogue.chmod(0o600)
    spec = "file:" + str(tmp_path / "rogue-rdv")
    got = {n: torch.zeros_like(t) for n, t in w.items()}
    errors = []

    def receiver():
        try:
            with ds.StreamReceiver(ds.Group(spec, 1, 2, timeout_s=10, key_file=str(key))) as rx:
                rx.register_all(got)
                rx.receive()
        except ds.DeltasyncError as e:
            errors.append(e)

    t = threading.Thread(target=receiver)
    t.start()
    with ds.StreamSender(ds.Group(spec, 0, 2, timeout_s=10, key_file=str(rogue))) as tx:
        with pytest.raises(ds.DeltasyncError):
            tx.sync(w)
    t.join(timeout=30)
    assert errors and isinstance(errors[0], ds.CorruptionError), errors
    assert "authentication failed" in str(errors[0])
    assert all(not x.any() for x in got.values())
