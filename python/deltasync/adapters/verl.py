"""verl: a checkpoint-engine backend over deltasync's stream.

verl moves weights from its trainer (the actor worker group) to its rollout
replicas through a *checkpoint engine* it picks by name from
``CheckpointEngineRegistry``. This module registers ``"deltasync"`` there,
so a verl run switches to it in its config::

    actor_rollout_ref.rollout.checkpoint_engine.backend=deltasync
    actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=deltasync.adapters.verl

(the second line makes every verl worker import this module, which
registers the backend, before it builds its engine). Options go in
``actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.deltasync``:
``rendezvous`` (``file:/dir`` every worker sees or ``redis://host:port``;
without it the trainer's rank 0 makes a private directory, which serves
workers of one host only, and workers on several hosts are refused),
``communicator`` (``"gloo"`` or ``"nccl"``), ``rollout_dtype`` (cast the
trainer's floating-point tensors to it before the diff, e.g.
``bfloat16``), ``device`` (where each rollout worker keeps its copy:
``"cpu"``, the default, or ``"cuda"``), ``shard``, ``encoding``,
``timeout_s``, ``key_file`` and the rest of
:class:`DeltasyncCheckpointEngine`'s keywords.

**How verl drives it.** Each step verl's ``CheckpointEngineManager`` calls
``prepare`` on every worker (trainer ranks first, then every rollout
worker of every replica), hands the results to ``build_topology``, calls
``init_process_group`` with the kwargs that returns, then ``send_weights``
on each trainer rank (with the generator of (name, tensor) pairs its
training engine exports) beside ``receive_weights`` on each rollout worker
(whose (name, tensor) pairs the worker's server adapter loads into the
inference engine), and ``finalize`` on all. This backend forms its groups
once and keeps them: a repeated ``init_process_group`` with the same
topology changes nothing, so every sync after the first is a delta. A new
topology (a replica added or removed) forms new groups, and the next sync
seeds every worker.

**Trainer side.** Trainer rank 0 is the stream's sender
(:class:`deltasync.StreamSender`, rank 0); every rollout worker is a
receiver. With several trainer ranks (FSDP) the sync is sharded: every
rank keeps only its flat ``1/N`` of each tensor the generator yields
(each rank sees every full tensor: verl's export gathers them
collectively), diffs it against its own snapshot, and the changed
elements meet at rank 0 (:meth:`deltasync.StreamSender.sync_shards`), so no
rank holds the whole model. A generator that yields ``DTensor`` parameters
instead (one's own export; verl's yields full tensors) is synced from
their local shards as they lie (:meth:`deltasync.ShardSpec.from_dtensor`).
``shard=False`` makes rank 0 alone sync the whole model (the other ranks
only drain the generator). The tensors of the first sync are the stream's
for good: a later sync that yields another set, dtype or shape is refused
on the trainer, naming the tensor, and every rollout worker's
``receive_weights`` raises the same error at once instead of waiting. A
sync that fails otherwise commits nothing, and the next one seeds.

**Rollout side.** verl's rollout worker hands the pairs
``receive_weights`` yields to its server adapter, which loads them into
the inference engine in another process (CUDA IPC, shared memory), so the
contract is (name, tensor) pairs. Each rollout worker keeps one copy of
the model, which the stream updates in place; ``receive_weights`` takes
one sync and then yields every tensor of that copy, bit-exact with the
trainer's (and refuses a sync whose ``global_steps`` is not its own).
Only the changes cross the network; the yielded tensors are the copy
itself: read them, do not keep or write them (the next sync writes into
them). The copy is the cost: host memory by default, one per rollout
worker, so a host of eight tensor-parallel workers holds eight. For
in-place updates inside the engine's own process, with no copy, use
:mod:`deltasync.adapters.vllm` or :mod:`deltasync.adapters.sglang` instead.

**Control messages.** Beside the model's group (``<group>``) the trainer's
rank 0 sends, before each sync, a control tensor over a second stream group
(``<group>-ctl``): the update's number, verl's ``global_steps``, the
tensor list, or the error that stopped the update (docs/format.md, "verl
checkpoint engine"). It is how a rollout worker learns the tensors it
holds before its first sync, and why it never waits for a sync that will
not come.

Where verl is importable the engine derives from verl's own
``CheckpointEngine`` and registers in verl's ``CheckpointEngineRegistry``;
elsewhere both are standalone equivalents with the same methods.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import shutil
import socket
import struct
import tempfile
import uuid
import zlib
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any, AsyncGenerator, Optional

import numpy as np
import torch

from .. import errors as _errors
from .._tensors import dtype_name
from ..errors import (
    CorruptionError,
    DeltasyncError,
    FailedPreconditionError,
    InvalidArgumentError,
)
from ..stream import Group, ShardSpec, StreamReceiver, StreamSender, shard_spec_from_dtensor
from .engine import torch_dtype

log = logging.getLogger("deltasync.adapters")

try:  # verl's own base class and registry where verl is installed
    from verl.checkpoint_engine.base import CheckpointEngine as _Base
    from verl.checkpoint_engine.base import CheckpointEngineRegistry

    VERL = True
except ImportError:  # verl absent: the same interface, standalone
    VERL = False

    class CheckpointEngineRegistry:  # type: ignore[no-redef]
        """verl's registry of checkpoint engines, for use without verl:
        ``register(name)`` decorates a class, ``get(name)`` finds it (a
        ValueError listing the registered names when absent), ``new(name,
        *args, **kwargs)`` builds one."""

        _registry: dict[str, type] = {}
        _import_errors: dict[str, ImportError] = {}

        def register(backend: str):  # noqa: N805 - called on the class, as verl's is
            def wrapper(cls: type) -> type:
                CheckpointEngineRegistry._registry[backend] = cls
                return cls

            return wrapper

        @classmethod
        def record_import_error(cls, module: str, error: ImportError) -> None:
            cls._import_errors[module] = error

        @classmethod
        def get(cls, backend: str) -> type:
            if backend not in cls._registry:
                raise ValueError(
                    f"Checkpoint engine {backend} not registered, registered backends: "
                    f"{sorted(cls._registry)}"
                )
            return cls._registry[backend]

        @classmethod
        def new(cls, backend: str, *args: Any, **kwargs: Any) -> Any:
            return cls.get(backend)(*args, **kwargs)

    class _Base(ABC):  # type: ignore[no-redef]
        """verl's CheckpointEngine interface, for use without verl."""

        wire_format = "named_tensors"

        @abstractmethod
        def prepare(self) -> dict[str, Any]: ...

        @classmethod
        @abstractmethod
        def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int,
                           metadata: list) -> tuple[dict, dict]: ...

        @abstractmethod
        def init_process_group(self, **kwargs: Any) -> None: ...

        @abstractmethod
        def finalize(self) -> None: ...

        @abstractmethod
        async def send_weights(self, weights: Any, global_steps: Optional[int] = None) -> Any: ...

        @abstractmethod
        async def receive_weights(self, global_steps: Optional[int] = None) -> Any: ...


BACKEND = "deltasync"
CONTROL_FORMAT = 1
CONTROL_TENSOR = "deltasync.control"
HEADER_BYTES = 4096  # the control tensor's first region: u32 length + JSON
_MIN_CONTROL_BYTES = HEADER_BYTES + 4096


def _parse_dtype(value: Any) -> Optional[torch.dtype]:
    """A torch dtype from None, a torch dtype, or a name ("bfloat16",
    "torch.bfloat16", "bf16", "BF16")."""
    if value is None or isinstance(value, torch.dtype):
        return value
    text = str(value).strip()
    short = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32,
             "half": torch.float16, "float": torch.float32}
    if text.lower() in short:
        return short[text.lower()]
    name = text[len("torch."):] if text.startswith("torch.") else text
    dt = getattr(torch, name, None)
    if isinstance(dt, torch.dtype):
        return dt
    try:
        return torch_dtype(text.upper())
    except InvalidArgumentError:
        raise InvalidArgumentError(f"deltasync: rollout_dtype {value!r} is not a dtype") from None


def _is_dtensor(t: Any) -> bool:
    return (hasattr(t, "placements") and hasattr(t, "device_mesh")
            and hasattr(t, "to_local"))


async def _pairs(weights: Any):
    """(name, tensor) pairs from a generator, an async iterator or a mapping."""
    if hasattr(weights, "__aiter__"):
        async for item in weights:
            yield item
        return
    if isinstance(weights, Mapping):
        weights = weights.items()
    for item in weights:
        yield item


def describe_difference(first: list, now: list) -> Optional[str]:
    """How tensor list ``now`` ((name, dtype, shape) triples) differs from
    ``first``, naming the first tensor that does (None: the same)."""
    old = {n: (d, list(s)) for n, d, s in first}
    new = {n: (d, list(s)) for n, d, s in now}
    for n, d, s in now:
        if n not in old:
            return (f"tensor '{n}' was not in the first sync (a stream's tensors are those of "
                    "its first sync)")
        if old[n] != (d, list(s)):
            return (f"tensor '{n}' is {d} {list(s)} here but was {old[n][0]} {old[n][1]} in the "
                    "first sync")
    for n, _, _ in first:
        if n not in new:
            return f"tensor '{n}' of the first sync is missing"
    return None


class DeltasyncCheckpointEngine(_Base):
    """verl's ``CheckpointEngine`` over deltasync's stream (one per trainer
    rank and per rollout worker; see the module's documentation).

    verl builds it with ``bucket_size`` (its IPC bucket, used by the
    server adapter, not here) and, on trainer rank 0, ``is_master=True``;
    every other keyword comes from ``engine_kwargs.deltasync``:

    * ``rendezvous``: where the groups meet (``file:/dir`` or
      ``redis://host:port``); None: a private directory the master makes
      (one host only);
    * ``communicator``: the model group's, ``"gloo"`` or ``"nccl"`` (the
      control group is always ``gloo``; not ``backend``, which verl's
      ``CheckpointEngineRegistry.new`` takes for the engine's name);
    * ``group``: the groups' name prefix; ``timeout_s`` (every call on a
      silent peer inside a sync), ``connect_timeout_s`` (forming a group:
      it covers the trainer's export before its first sync), ``key_file``
      (authenticated messages);
    * trainer: ``shard`` (sync from every trainer rank's part, default
      True), ``rollout_dtype`` (cast floating-point tensors to it first),
      and the sender's ``encoding``, ``bucket_bytes``, ``verify_every``,
      ``zstd_level``, ``pinned_snapshot``, ``threads``;
    * rollout: ``device`` (where the worker's copy of the model lives),
      ``pin_memory`` (a pinned host copy: faster to load into a GPU),
      ``max_frame_bytes``, ``sync_wait_s`` (how long ``receive_weights``
      waits for the trainer's update to begin: verl starts both sides
      together, so this bounds the trainer's export; None: no bound);
    * ``control_bytes``: the control tensor's size, the same everywhere
      (it holds the tensor list, zlib-compressed).
    """

    wire_format = "named_tensors"

    def __init__(
        self,
        bucket_size: int = 0,
        is_master: bool = False,
        rendezvous: Optional[str] = None,
        communicator: str = "gloo",
        group: str = "deltasync-verl",
        timeout_s: float = 600.0,
        connect_timeout_s: float = 600.0,
        key_file: str = "",
        shard: bool = True,
        rollout_dtype: Any = None,
        encoding: str = "indices",
        bucket_bytes: int = 16 << 20,
        verify_every: int = 0,
        zstd_level: int = 1,
        pinned_snapshot: bool = False,
        threads: int = 0,
        device: str = "cpu",
        pin_memory: bool = False,
        max_frame_bytes: int = 1 << 30,
        sync_wait_s: Optional[float] = 1800.0,
        control_bytes: int = 4 << 20,
    ) -> None:
        if communicator not in ("gloo", "nccl"):
            raise InvalidArgumentError(
                f"deltasync: communicator {communicator!r}: expected 'gloo' or 'nccl'")
        if not group or "/" in group:
            raise InvalidArgumentError(f"deltasync: group name {group!r} must be non-empty, no '/'")
        if int(control_bytes) < _MIN_CONTROL_BYTES:
            raise InvalidArgumentError(
                f"deltasync: control_bytes {control_bytes}: at least {_MIN_CONTROL_BYTES}")
        if rendezvous is not None:
            Group(rendezvous, 0, 1)  # refuses a malformed spec here, not at the first sync
        self.bucket_size = bucket_size
        self.is_master = bool(is_master)
        self.rendezvous = rendezvous
        self.communicator = communicator
        self.group = group
        self.timeout_s = float(timeout_s)
        self.connect_timeout_s = float(connect_timeout_s)
        self.key_file = key_file
        self.shard = bool(shard)
        self.rollout_dtype = _parse_dtype(rollout_dtype)
        self.sender_options = dict(encoding=encoding, bucket_bytes=int(bucket_bytes),
                                   verify_every=int(verify_every), zstd_level=int(zstd_level),
                                   pinned_snapshot=bool(pinned_snapshot), threads=int(threads))
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None and torch.cuda.is_available():
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.pin_memory = bool(pin_memory)
        self.max_frame_bytes = int(max_frame_bytes)
        self.sync_wait_s = None if sync_wait_s is None else float(sync_wait_s)
        self.control_bytes = int(control_bytes)
        self.id = uuid.uuid4().hex
        self._auto_dir: Optional[str] = None
        self._joined: Optional[tuple] = None
        self.role: Optional[str] = None
        self.last: Optional[dict] = None
        self._reset()

    # --- topology -------------------------------------------------------------

    def _reset(self) -> None:
        self._sender: Optional[StreamSender] = None
        self._ctl_sender: Optional[StreamSender] = None
        self._receiver: Optional[StreamReceiver] = None
        self._ctl_receiver: Optional[StreamReceiver] = None
        self._ctl: Optional[torch.Tensor] = None
        self._model: Optional[list] = None  # the first sync's (name, dtype, shape)
        self._manifest_digest: Optional[str] = None
        self._buffers: dict[str, torch.Tensor] = {}
        self._mirror: Optional[dict[str, torch.Tensor]] = None
        self._seq = 0
        self.sharded = False
        self.trainer_rank = -1
        self.trainers = 0

    def _rendezvous(self) -> str:
        if self.rendezvous is not None:
            return self.rendezvous
        if self._auto_dir is None:
            self._auto_dir = tempfile.mkdtemp(prefix="deltasync-verl-")
        return "file:" + self._auto_dir

    def prepare(self) -> dict[str, Any]:
        """This worker's part of the topology: its id, host and whether it is
        the master (trainer rank 0, which also names the rendezvous and the
        groups). Allocates nothing: the stream's buffers live as long as its
        groups."""
        meta: dict[str, Any] = {"id": self.id, "host": socket.gethostname(), "pid": os.getpid(),
                                "is_master": self.is_master}
        if self.is_master:
            meta.update(rendezvous=self._rendezvous(), auto_rendezvous=self.rendezvous is None,
                        group=self.group)
        return meta

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int,
                       metadata: list) -> tuple[dict[str, list], dict[str, list]]:
        """The ``init_process_group`` kwargs of every trainer rank and every
        rollout worker (lists as long as each group), from ``prepare``'s
        metadata, trainer ranks first. Trainer rank 0 is the stream's
        sender, rollout worker ``j`` its receiver ``1 + j``; the groups'
        name carries a digest of every member's id, so the same workers
        find the same groups each step and any other membership forms new
        ones."""
        a, r = int(actor_wg_world_size), int(rollout_world_size)
        if a < 1 or r < 0:
            raise InvalidArgumentError(
                f"deltasync: {a} trainer ranks and {r} rollout workers (at least one trainer rank)")
        if len(metadata) != a + r:
            raise InvalidArgumentError(
                f"deltasync: {len(metadata)} workers' metadata for {a} trainer ranks and {r} "
                "rollout workers")
        for i, m in enumerate(metadata):
            if not (isinstance(m, Mapping) and "id" in m and "is_master" in m):
                raise InvalidArgumentError(
                    f"deltasync: worker {i}'s metadata {m!r:.80} is not a deltasync engine's")
        master = metadata[0]
        if not master["is_master"]:
            raise InvalidArgumentError(
                "deltasync: trainer rank 0 must be the master (built with is_master=True)")
        others = [i for i, m in enumerate(metadata) if i and m["is_master"]]
        if others:
            raise InvalidArgumentError(
                f"deltasync: worker {others[0]} is a master too; only trainer rank 0 may be")
        hosts = sorted({str(m.get("host")) for m in metadata})
        if master.get("auto_rendezvous") and len(hosts) > 1:
            raise InvalidArgumentError(
                f"deltasync: the workers run on {len(hosts)} hosts ({', '.join(hosts[:4])}), but "
                "no rendezvous was given: set engine_kwargs.deltasync.rendezvous to a file: "
                "directory every host sees, or redis://host:port")
        digest = hashlib.sha256("\n".join(str(m["id"]) for m in metadata).encode()).hexdigest()
        name = f"{master['group']}-{digest[:16]}"
        rendezvous = master["rendezvous"]
        actor = {
            "role": ["trainer"] * a,
            "rank": [0] + [-1] * (a - 1),
            "world_size": [1 + r] * a,
            "trainer_rank": list(range(a)),
            "trainers": [a] * a,
            "rendezvous": [rendezvous] * a,
            "group": [name] * a,
        }
        rollout = {
            "role": ["rollout"] * r,
            "rank": list(range(1, 1 + r)),
            "world_size": [1 + r] * r,
            "trainer_rank": [-1] * r,
            "trainers": [a] * r,
            "rendezvous": [rendezvous] * r,
            "group": [name] * r,
        }
        return actor, rollout

    def _group(self, rendezvous: str, rank: int, size: int, name: str, backend: str) -> Group:
        kwargs: dict[str, Any] = {}
        if backend == "nccl" and torch.cuda.is_available():
            kwargs["cuda_device"] = int(torch.cuda.current_device())
        return Group(rendezvous, rank, size, backend=backend, group=name,
                     timeout_s=self.timeout_s, connect_timeout_s=self.connect_timeout_s,
                     key_file=self.key_file, **kwargs)

    def init_process_group(self, role: str, rank: int, world_size: int, trainer_rank: int,
                           trainers: int, rendezvous: str, group: str) -> None:
        """Joins the groups ``build_topology`` placed this worker in. The same
        placement as last time changes nothing (the stream keeps its state:
        the next sync is a delta); another one leaves the old groups, and
        the next sync seeds."""
        key = (role, rank, world_size, trainer_rank, trainers, rendezvous, group)
        if key == self._joined:
            return
        if role not in ("trainer", "rollout"):
            raise InvalidArgumentError(f"deltasync: role {role!r}: 'trainer' or 'rollout'")
        if self._joined is not None:
            log.warning("deltasync: the topology changed (%s -> %s): forming new groups; the "
                        "next sync seeds every rollout worker", self._joined, key)
        self._leave()
        self.role = role
        self.trainer_rank = int(trainer_rank)
        self.trainers = int(trainers)
        ctl_name = group + "-ctl"
        if role == "trainer":
            self.sharded = self.shard and self.trainers > 1
            self._sender_at = (rendezvous, world_size, group)
            self._sender = self._new_sender()
            if self.trainer_rank == 0:
                self._ctl_sender = StreamSender(
                    self._group(rendezvous, 0, world_size, ctl_name, "gloo"), encoding="indices")
                self._ctl = torch.zeros(self.control_bytes, dtype=torch.uint8)
        else:
            # The model's sync follows the control message at once: its wait
            # is a call's; the control message waits for the trainer's export.
            self._receiver = StreamReceiver(
                self._group(rendezvous, rank, world_size, group, self.communicator),
                max_frame_bytes=self.max_frame_bytes, sync_wait_s=self.timeout_s)
            self._ctl_receiver = StreamReceiver(
                self._group(rendezvous, rank, world_size, ctl_name, "gloo"),
                sync_wait_s=self.sync_wait_s)
            self._ctl = torch.zeros(self.control_bytes, dtype=torch.uint8)
            self._ctl_receiver.register(CONTROL_TENSOR, self._ctl)
        self._joined = key

    def _new_sender(self) -> Optional[StreamSender]:
        """This trainer rank's sender of the model (None: an unsharded sync's
        rank other than 0)."""
        rendezvous, world_size, group = self._sender_at
        peers = (self._group(rendezvous, self.trainer_rank, self.trainers, group + "-trainers",
                             self.communicator) if self.sharded else None)
        if self.trainer_rank == 0:
            return StreamSender(self._group(rendezvous, 0, world_size, group, self.communicator),
                                trainers=peers, **self.sender_options)
        if self.sharded:
            return StreamSender(None, trainers=peers, **self.sender_options)
        return None

    def finalize(self) -> None:
        """Nothing to free after a step: the groups, the snapshots and the
        rollout worker's copy serve the next step's delta."""

    def _leave(self) -> None:
        for obj in (self._sender, self._ctl_sender, self._receiver, self._ctl_receiver):
            if obj is not None:
                obj.close()
        self._reset()
        self._joined = None
        self.role = None

    def shutdown(self) -> None:
        """Leaves the groups (a sync in flight ends with an error); the
        master removes the rendezvous directory it made."""
        self._leave()
        if self._auto_dir is not None:
            shutil.rmtree(self._auto_dir, ignore_errors=True)
            self._auto_dir = None

    close = shutdown

    # --- trainer --------------------------------------------------------------

    def _cast(self, t: torch.Tensor) -> torch.dtype:
        if self.rollout_dtype is not None and t.is_floating_point():
            return self.rollout_dtype
        return t.dtype

    def _buffer(self, name: str, numel: int, dtype: torch.dtype,
                device: torch.device) -> torch.Tensor:
        buf = self._buffers.get(name)
        if buf is None or buf.numel() != numel or buf.dtype != dtype or buf.device != device:
            buf = torch.empty(numel, dtype=dtype, device=device)
            self._buffers[name] = buf
        return buf

    def _entry(self, name: str, dtype: torch.dtype, shape: Any) -> tuple:
        try:
            code = dtype_name(torch.empty(0, dtype=dtype))
        except DeltasyncError as e:
            raise type(e)(f"deltasync: tensor '{name}': {e}") from None
        return (name, code, [int(x) for x in shape])

    async def _collect(self, weights: Any) -> tuple[list, list, list]:
        """Drains ``weights``: the model's (name, dtype, shape), and this
        rank's (name, tensor) pairs (unsharded rank 0) or (ShardSpec,
        tensor) shards (sharded)."""
        model: list = []
        pairs: list = []
        shards: list = []
        seen: set = set()
        keep = self.trainer_rank == 0 or self.sharded
        async for item in _pairs(weights):
            if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
                raise InvalidArgumentError(
                    f"deltasync: expected (name, tensor) pairs, got {item!r:.80}")
            name, t = item
            if name in seen:
                raise InvalidArgumentError(f"deltasync: tensor '{name}' yielded twice")
            seen.add(name)
            if not keep:
                if _is_dtensor(t):
                    t.full_tensor()  # collective: rank 0 gathers it
                continue  # drained: producing each tensor may be collective
            if isinstance(t, torch.Tensor) and not _is_dtensor(t):
                t = t.detach()
            dtype = self._cast(t)
            model.append(self._entry(name, dtype, t.shape))
            if not self.sharded:
                if _is_dtensor(t):
                    t = t.full_tensor()
                if t.dtype != dtype:
                    t = t.to(dtype)
                pairs.append((name, t.contiguous()))
            elif _is_dtensor(t):
                spec = shard_spec_from_dtensor(name, t)
                local = t.to_local()
                if local.dtype != dtype or not local.is_contiguous():
                    buf = self._buffer(name, local.numel(), dtype, local.device)
                    buf.copy_(local.reshape(-1))
                    local = buf.view(local.shape)
                if spec.dtype != model[-1][1]:
                    piece = spec.pieces[0]
                    contributes = spec.contributes
                    spec = ShardSpec.box(name, model[-1][1], model[-1][2], list(piece.hf_offset),
                                         list(piece.extent))
                    spec.contributes = contributes
                shards.append((spec, local))
            else:
                flat = t.reshape(-1)
                n = flat.numel()
                chunk = -(-n // self.trainers)
                first = min(self.trainer_rank * chunk, n)
                count = min(n, first + chunk) - first
                if count > 0:
                    buf = self._buffer(name, count, dtype, flat.device)
                    buf.copy_(flat[first:first + count])
                    shards.append((ShardSpec.flat_range(name, model[-1][1], model[-1][2], first,
                                                        count), buf))
        return model, pairs, shards

    def _write_control(self, header: dict, manifest: Optional[bytes] = None) -> None:
        buf = self._ctl.numpy()
        body = json.dumps(header, separators=(",", ":")).encode()
        if len(body) > HEADER_BYTES - 4:
            header = dict(header, error=str(header.get("error", ""))[:1000])
            body = json.dumps(header, separators=(",", ":")).encode()
        buf[:HEADER_BYTES] = 0
        buf[:4 + len(body)] = np.frombuffer(struct.pack("<I", len(body)) + body, dtype=np.uint8)
        if manifest is not None:
            buf[HEADER_BYTES:] = 0
            end = HEADER_BYTES + 8 + len(manifest)
            buf[HEADER_BYTES:end] = np.frombuffer(struct.pack("<Q", len(manifest)) + manifest,
                                                  dtype=np.uint8)

    def _send_control(self, global_steps: Optional[int], *, error: Optional[BaseException] = None,
                      manifest: Optional[bytes] = None) -> None:
        header: dict[str, Any] = {"format": CONTROL_FORMAT, "seq": self._seq,
                                  "global_steps": global_steps, "error": None, "error_type": None,
                                  "tensors": len(self._model) if self._model else 0,
                                  "manifest_sha256": self._manifest_digest}
        if error is not None:
            header["error"] = str(error)
            header["error_type"] = type(error).__name__
        self._write_control(header, manifest)
        self._ctl_sender.sync([(CONTROL_TENSOR, self._ctl)])

    def _refuse(self, error: BaseException, global_steps: Optional[int]) -> None:
        """Tells every rollout worker why this update stops (rank 0)."""
        if self.trainer_rank != 0:
            return
        try:
            self._send_control(global_steps, error=error)
        except DeltasyncError as e:
            log.warning("deltasync: could not tell the rollout workers of %s: %s", error, e)

    def _manifest(self, model: list) -> bytes:
        body = zlib.compress(json.dumps({"tensors": model}, separators=(",", ":")).encode(), 6)
        room = self.control_bytes - HEADER_BYTES - 8
        if len(body) > room:
            raise InvalidArgumentError(
                f"deltasync: the list of {len(model)} tensors takes {len(body)} bytes compressed, "
                f"more than control_bytes {self.control_bytes} leaves ({room}): raise "
                "engine_kwargs.deltasync.control_bytes")
        return body

    async def send_weights(self, weights: Any, global_steps: Optional[int] = None) -> dict:
        """Syncs ``weights`` ((name, tensor) pairs: verl's export, a
        generator that may be collective, so every trainer rank calls this)
        to every rollout worker: the first sync seeds, the later ones send
        what changed. Returns verl's metrics (trainer rank 0; the other
        ranks return an empty dict). On an error nothing is committed, and
        every rollout worker's receive_weights raises it too."""
        if self.role != "trainer":
            raise FailedPreconditionError(
                "deltasync: send_weights on a worker that did not join as a trainer rank "
                "(init_process_group first)")
        self._seq += 1
        try:
            model, pairs, shards = await self._collect(weights)
        except BaseException as e:
            self._refuse(e, global_steps)
            raise
        if self.trainer_rank != 0 and not self.sharded:
            return {}
        manifest = None
        try:
            if self._model is None:
                manifest = self._manifest(model)  # on every rank: each refuses alike
            else:
                why = describe_difference(self._model, model)
                if why is not None:
                    raise InvalidArgumentError(f"deltasync: {why}")
        except BaseException as e:
            self._refuse(e, global_steps)
            raise
        if manifest is not None:
            self._model = model
            self._manifest_digest = hashlib.sha256(manifest).hexdigest()
        if self.trainer_rank == 0:
            self._send_control(global_steps, manifest=manifest)
        try:
            if self.sharded:
                stats = self._sender.sync_shards(model, shards)
            else:
                stats = self._sender.sync(pairs)
        except BaseException:
            # A sync the sender refused before any frame leaves the rollout
            # workers waiting for it: a new sender ends their wait at once
            # (they join its group at their next receive) and seeds them next.
            self._sender.close()
            self._sender = self._new_sender()
            raise
        finally:
            del pairs, shards
        if self.trainer_rank != 0:
            return {}
        self.last = stats
        total = sum(_numel(s) for _, _, s in model) or 1
        return {
            "checkpoint_engine/seeded": float(stats["seeded"]),
            "checkpoint_engine/changed_elems": float(stats["changed"]),
            "checkpoint_engine/changed_ratio": stats["changed"] / total,
            "checkpoint_engine/payload_mbytes": stats["bytes_sent"] / (1 << 20),
            "checkpoint_engine/sync_s": float(stats["total_s"]),
        }

    # --- rollout --------------------------------------------------------------

    async def _blocking(self, fn: Any) -> Any:
        """``fn()`` on the loop's executor, on this worker's CUDA device: a
        receive waits for the trainer, the event loop does not."""
        device = self.device.index if self.device.type == "cuda" else None

        def run() -> Any:
            if device is not None:
                torch.cuda.set_device(device)
            return fn()

        return await asyncio.get_running_loop().run_in_executor(None, run)

    def _read_control(self) -> tuple[dict, bytes]:
        buf = self._ctl.numpy()
        (n,) = struct.unpack("<I", buf[:4].tobytes())
        if n > HEADER_BYTES - 4:
            raise CorruptionError(
                f"deltasync: control header of {n} bytes (at most {HEADER_BYTES - 4})")
        try:
            header = json.loads(buf[4:4 + n].tobytes())
        except ValueError as e:
            raise CorruptionError(f"deltasync: control header is not JSON: {e}") from None
        if not isinstance(header, dict) or header.get("format") != CONTROL_FORMAT:
            raise CorruptionError(f"deltasync: control header {header!r:.120}: format "
                                  f"{CONTROL_FORMAT} expected")
        (m,) = struct.unpack("<Q", buf[HEADER_BYTES:HEADER_BYTES + 8].tobytes())
        if m > len(buf) - HEADER_BYTES - 8:
            raise CorruptionError(f"deltasync: control manifest of {m} bytes overruns its tensor")
        return header, buf[HEADER_BYTES + 8:HEADER_BYTES + 8 + m].tobytes()

    @staticmethod
    def _decode_manifest(raw: bytes) -> list:
        try:
            tensors = json.loads(zlib.decompress(raw))["tensors"]
            return [(str(n), str(d), [int(x) for x in s]) for n, d, s in tensors]
        except (ValueError, KeyError, TypeError, zlib.error) as e:
            raise CorruptionError(f"deltasync: the control tensor's tensor list: {e}") from None

    def _hold(self, model: list) -> None:
        """Allocates this worker's copy of the model and registers it."""
        mirror = {}
        for name, code, shape in model:
            pin = self.pin_memory and self.device.type == "cpu"
            mirror[name] = torch.empty(shape, dtype=torch_dtype(code), device=self.device,
                                       pin_memory=pin)
        self._receiver.register_all(mirror)
        self._mirror = mirror
        self._model = model

    async def receive_weights(self, global_steps: Optional[int] = None
                              ) -> AsyncGenerator[tuple[str, torch.Tensor], None]:
        """Takes one sync into this worker's copy of the model, then yields
        every (name, tensor) of it, in the trainer's order. Raises the
        trainer's error when the trainer refused the update, and refuses a
        sync whose ``global_steps`` is not this update's."""
        if self.role != "rollout":
            raise FailedPreconditionError(
                "deltasync: receive_weights on a worker that did not join as a rollout worker "
                "(init_process_group first)")
        await self._blocking(self._ctl_receiver.receive)
        header, raw = self._read_control()
        if header.get("error"):
            cls = getattr(_errors, str(header.get("error_type")), None)
            if not (isinstance(cls, type) and issubclass(cls, DeltasyncError)):
                cls = FailedPreconditionError
            raise cls(f"deltasync: the trainer stopped update {header.get('seq')} "
                      f"(global_steps {header.get('global_steps')}): {header['error']}")
        mismatch = None
        if self._mirror is None:
            self._hold(self._decode_manifest(raw))
            self._manifest_digest = hashlib.sha256(raw).hexdigest()
        elif header.get("manifest_sha256") != self._manifest_digest:
            why = describe_difference(self._model, self._decode_manifest(raw))
            mismatch = InvalidArgumentError(
                "deltasync: the trainer's tensors differ from the ones this rollout worker "
                f"holds: {why or 'another tensor list'}")
        try:
            stats = await self._blocking(self._receiver.receive)
        except DeltasyncError as e:
            if mismatch is not None:
                raise mismatch from e
            raise
        if mismatch is not None:
            raise mismatch
        self.last = dict(stats, seq=header.get("seq"), global_steps=header.get("global_steps"))
        sent = header.get("global_steps")
        if global_steps is not None and sent is not None and int(sent) != int(global_steps):
            raise FailedPreconditionError(
                f"deltasync: the trainer sent the weights of global_steps {sent}, this update "
                f"is for {global_steps}")
        for name, _, _ in self._model:
            yield name, self._mirror[name]

    async def get_weights(self) -> AsyncGenerator[tuple[str, torch.Tensor], None]:
        """Yields this rollout worker's copy as of its last sync (a rollout
        engine that restarted loads it without waiting for the trainer)."""
        if self._mirror is None:
            raise FailedPreconditionError("deltasync: no sync received yet")
        for name, _, _ in self._model:
            yield name, self._mirror[name]


def _numel(shape: list) -> int:
    n = 1
    for x in shape:
        n *= int(x)
    return n


CheckpointEngineRegistry.register(BACKEND)(DeltasyncCheckpointEngine)

__all__ = ["BACKEND", "CONTROL_FORMAT", "VERL", "CheckpointEngineRegistry",
           "DeltasyncCheckpointEngine", "describe_difference"]
