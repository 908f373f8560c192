"""The online transport: push each step's changed elements from the trainer to
every rollout engine over a communicator, bit-exactly.

A group has one sender (rank 0) and its receivers (ranks 1..n-1). Each
:meth:`StreamSender.sync` diffs the tensors against the snapshot of the
last sync, sends only what changed, and returns once every receiver has
applied it and agreed on the state digests; a receiver that cannot keep up
is reseeded. Protocol: docs/format.md ("The stream").

The group is a :class:`Group` (deltasync forms it: ``gloo`` over TCP, or
``nccl``, meeting through a rendezvous directory or a redis server) or a
:class:`~deltasync.TorchGroup` over an existing ``torch.distributed`` group.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Mapping, Optional, Sequence

from . import _deltasync
from ._closing import Closing
from ._tensors import Raw, arg, dtype_name, is_torch, named, tensor_args
from .errors import InvalidArgumentError, UnsupportedError

ShardSpec = _deltasync.ShardSpec


# FP8 dtypes a uint8 array stands for in sync_shards (a shard spec's dtype).
_FP8_NAMES = frozenset({"F8_E4M3", "F8_E5M2", "F8_E8M0"})


def _is_uint8(t: Any) -> bool:
    return str(getattr(t, "dtype", "")) in ("uint8", "torch.uint8")


@dataclasses.dataclass
class Group:
    """A group deltasync forms itself.

    ``rendezvous`` is ``file:/a/dir/every/member/sees`` (also
    ``file:///a/dir``; a directory it creates is private to the user) or
    ``redis://host:port`` (also ``redis:host:port``; the port defaults to
    6379). A Redis password is never part of the spec: give
    ``redis_password_file`` (a file only its owner may read) or set
    ``DELTASYNC_REDIS_PASSWORD``. Every member gives the same
    ``rendezvous``, ``size`` and ``group`` name, and its own ``rank``.
    ``backend`` is ``"gloo"`` (host memory, TCP) or ``"nccl"``;
    ``timeout_s`` bounds every call on a silent peer inside a sync (a
    receiver's wait for the next sync has its own bound, see
    :class:`StreamReceiver`). Bad values are refused here, not at the first
    sync.

    Authenticated mode: ``key_file`` names a file holding a secret every
    member shares (at least 16 bytes; only its owner may read it); without
    it, ``DELTASYNC_STREAM_KEY_FILE`` or ``DELTASYNC_STREAM_KEY`` in the
    environment give one. Every message then carries a BLAKE3 tag, and a
    process without the key can neither take over a rank nor have a
    forged or replayed message taken (docs/format.md, "Authenticated
    messages"). Without a key the group trusts whoever reaches its
    rendezvous and its ports.
    """

    rendezvous: str
    rank: int
    size: int
    backend: str = "gloo"
    group: str = "deltasync"
    hostname: str = ""
    timeout_s: float = 30.0
    connect_timeout_s: float = 60.0
    cuda_device: int = 0
    redis_password_file: str = ""
    key_file: str = ""

    def __post_init__(self) -> None:
        if self.backend not in ("gloo", "nccl"):
            raise InvalidArgumentError(
                f"Group: backend {self.backend!r}: expected 'gloo' or 'nccl'"
            )
        if not (isinstance(self.size, int) and self.size >= 1):
            raise InvalidArgumentError(f"Group: size {self.size!r}: at least 1")
        if not (isinstance(self.rank, int) and 0 <= self.rank < self.size):
            raise InvalidArgumentError(
                f"Group: rank {self.rank!r} is outside a group of {self.size} (0 <= rank < size)"
            )
        if not (self.timeout_s > 0 and self.connect_timeout_s > 0):
            raise InvalidArgumentError(
                f"Group: timeouts must be positive (timeout_s {self.timeout_s}, "
                f"connect_timeout_s {self.connect_timeout_s})"
            )
        if not self.group or "/" in self.group:
            raise InvalidArgumentError(f"Group: group name {self.group!r} must be non-empty, no '/'")
        _deltasync.parse_rendezvous(self.rendezvous)


def built_communicators() -> list[str]:
    """The built-in communicators this build has ("gloo", "nccl")."""
    return list(_deltasync.built_communicators())


class StreamSender(Closing):
    """The trainer's side: rank 0 of ``group``.

    ``encoding`` is the frames' encoding: ``"indices"`` (positions + values),
    ``"sparse"`` (zstd-compressed) or ``"dense"``. ``verify_every``: every
    n-th sync each receiver re-hashes all it holds (0: never beyond the
    digests). For a sharded trainer, every trainer rank builds a sender with
    ``trainers`` (the trainer ranks' group) and calls :meth:`sync_shards`;
    trainer rank 0 is also ``group``'s rank 0, the other trainer ranks pass
    ``group=None``. ``pinned_snapshot``: keep a CUDA tensor's snapshot in
    pinned host memory instead of device memory (no device memory for it;
    the diff reads it over the bus). ``threads``: threads for a host
    tensor's diff and the commit's copy (0: the cores available; 1: the
    calling thread alone). ``dense_by_time``: a unit of a delta framed on
    the host (a host tensor's, or a CUDA tensor's whose changes come back
    to host frames) goes dense when that takes less time than its
    positions, by the work per byte and per change measured on this
    machine and the wire's speed measured from the syncs (False: only when
    positions take more bytes).

    ``quantize`` sends weights as FP8 (quantize-then-diff; whole-tensor
    senders only): ``{name: (scheme, scale_format)}`` or ``{name: (scheme,
    scale_format, scale_name)}``, scheme and scale format as for
    :func:`deltasync.quantize_fp8`. The named tensors (2-D BF16, F16 or F32,
    host or CUDA: a CUDA tensor is quantized on its GPU) are quantized at
    every sync exactly as
    :func:`~deltasync.quantize_fp8` does, and the receivers get their codes
    (``float8_e4m3fn``/uint8, same name and shape) and scales (under
    ``scale_name``, default the name + ``"_scale_inv"``), each diffed
    against the sender's snapshot of the quantized state: a sync sends the
    codes and scales that changed. A weight the recipe cannot take (a NaN,
    an infinity, not 2-D) raises InvalidArgumentError naming it, and nothing
    is sent.
    """

    def __init__(
        self,
        group: Any,
        *,
        trainers: Any = None,
        encoding: str = "indices",
        bucket_bytes: int = 16 << 20,
        verify_every: int = 0,
        zstd_level: int = 1,
        pinned_snapshot: bool = False,
        threads: int = 0,
        dense_by_time: bool = True,
        quantize: Optional[Mapping[str, Sequence[str]]] = None,
    ) -> None:
        if group is None and trainers is None:
            raise InvalidArgumentError("StreamSender: needs a group")
        specs = {}
        for name, spec in (quantize or {}).items():
            spec = (spec,) if isinstance(spec, str) else tuple(spec)
            if not 1 <= len(spec) <= 3 or not all(isinstance(x, str) for x in spec):
                raise InvalidArgumentError(
                    f"StreamSender: quantize[{name!r}] must be (scheme, scale_format"
                    f"[, scale_name]), not {spec!r}")
            specs[name] = (spec + ("f32", "")[len(spec) - 1:])[:3]
        self._impl = _deltasync.StreamSender(
            group, trainers, encoding, bucket_bytes,
            verify_every, zstd_level, bool(pinned_snapshot), int(threads),
            bool(dense_by_time), specs,
        )

    def sync(self, tensors: Any) -> dict:
        """Sends the change of ``tensors`` (a state dict or (name, tensor)
        pairs, host or CUDA, or the same prepared once with
        :func:`~deltasync.prepare` for a lower cost per call) since the last
        sync to every receiver. The first sync, and any after a receiver
        joins or fails, seeds the whole model. Returns ``sync_id``,
        ``changed`` (elements that differ from the last committed state: 0
        for the first sync, which has none to compare with),
        ``bytes_sent``, ``seeded``, ``receivers``, ``partial_receivers``
        and the time split (``quantize_s`` for the tensors sent as FP8,
        ``diff_s``, ``encode_s``, ``transfer_s``,
        ``report_s``, ``commit_s``, ``total_s``), and ``committed_bytes``
        (what the commit copied into the snapshot). On an error nothing is
        committed: the next sync resends. One call at a time: another
        thread's call meanwhile raises FailedPreconditionError, and
        :meth:`close` from another thread ends a sync in flight with an
        error."""
        targs, keep = tensor_args(tensors)
        stats = self._live().sync(targs)
        del keep
        return stats

    def sync_shards(self, model: Any, shards: Sequence[tuple[Any, Any]]) -> dict:
        """One trainer rank's part of a sharded sync (every trainer rank calls
        it). ``model`` is the whole model: ``{name: (dtype, shape)}`` or
        (name, dtype, shape) triples, the same on every rank; ``shards`` are
        this rank's (ShardSpec, local tensor) pairs (host or CUDA tensors; a
        CUDA shard is diffed on its GPU). A uint8 tensor stands for the
        bytes of a spec's FP8 dtype (:func:`fp8_shard_specs`)."""
        if isinstance(model, Mapping):
            entries = [(n, d, list(s)) for n, (d, s) in model.items()]
        else:
            entries = [(n, d, list(s)) for n, d, s in model]
        pairs = []
        keep = []
        for spec, t in shards:
            if not isinstance(spec, ShardSpec):
                raise InvalidArgumentError(
                    f"sync_shards: expected (ShardSpec, tensor) pairs, got {type(spec).__name__}"
                )
            name = spec.pieces[0].hf_name if spec.pieces else "shard"
            if spec.dtype in _FP8_NAMES and not isinstance(t, Raw) and _is_uint8(t):
                # FP8 bytes from a library without float8 types
                # (quantize_fp8_shard's codes and ue8m0 scales).
                t = Raw(t, spec.dtype)
            keep.append(t)
            pairs.append((spec, arg(name, t)))
        stats = self._live().sync_shards(entries, pairs)
        del keep
        return stats

    def snapshot(self, name: str) -> bytes:
        """The bytes of tensor ``name`` as of the last committed sync."""
        return self._live().snapshot(name)

    @property
    def committed_sync_id(self) -> int:
        """The id of the last sync every receiver committed (0: none)."""
        return self._live().committed_sync_id


class StreamReceiver(Closing):
    """An engine's side: rank ``r >= 1`` of ``group``.

    Register the tensors the sender syncs, then call :meth:`receive` once
    per sync. Changes are written in place into the registered tensors
    (host or CUDA). By default a receiver registers every tensor the sender
    syncs, and the sender refuses one that lacks some, naming the first;
    ``partial=True`` says this receiver holds only some on purpose (a
    pipeline stage), and the stats report it.

    A sync that fails is not undone: frames applied before the failure stay
    applied, so each element holds either its committed value or the
    failed sync's, and the next sync brings every element to the sender's
    state (it resends what the failed one changed, or reseeds).

    ``sync_wait_s`` bounds how long :meth:`receive` waits for the next sync
    to begin (``None``, the default: no bound; a trainer's step takes as
    long as it takes). A sender that dies meanwhile is noticed at once over
    ``gloo``; :meth:`health` says what the receiver is doing. Everything
    inside a sync stays bounded by the group's ``timeout_s``.

    A registered tensor must keep its memory: before a sync writes
    anything, the receiver checks that no registered torch tensor's storage
    was swapped (``t.data = ...``, ``set_``) or freed
    (``untyped_storage().resize_(0)``), refuses the sync naming the first
    one that was, and :meth:`rebind` points it at the new memory.

    Threads: one call at a time (a second thread's call while
    :meth:`receive` runs raises FailedPreconditionError); :meth:`close`
    from another thread ends a receive in flight with an error and then
    closes; :meth:`health` may be called from any thread.
    """

    def __init__(
        self,
        group: Any,
        *,
        max_frame_bytes: int = 1 << 30,
        sync_wait_s: Optional[float] = None,
        partial: bool = False,
    ) -> None:
        self._dests: dict[str, Any] = {}
        self._impl = _deltasync.StreamReceiver(group, max_frame_bytes, sync_wait_s, partial)

    def register(
        self,
        name: str,
        dest: Any,
        *,
        runs: Optional[Iterable[tuple[int, int, int, int]]] = None,
        shape: Optional[Sequence[int]] = None,
        dtype: Optional[str] = None,
    ) -> None:
        """Receives tensor ``name`` into ``dest``.

        Without ``runs``, ``dest`` is the whole tensor (its dtype and shape
        are the sender's). With ``runs``, ``dest`` holds only parts of it
        (a TP slice, a fused parameter): each run ``(first, count, offset,
        stride)`` puts the tensor's flat elements ``first .. first+count-1``
        at ``dest``'s flat elements ``offset, offset+stride, ...``; ``shape``
        and ``dtype`` are then the sender's tensor's (dtype defaults to
        ``dest``'s). Elements no run covers are not received."""
        a = arg(name, dest, writable=True)
        run_list = [tuple(int(x) for x in r) for r in runs] if runs is not None else []
        if runs is not None and shape is None:
            raise InvalidArgumentError(f"tensor '{name}': runs need the sender's shape")
        self._live().register(a, _torch_or_none(dest), run_list, dtype or "",
                              list(shape) if shape is not None else [])
        self._dests.setdefault(name, []).append(dest)

    def register_all(self, tensors: Any) -> None:
        """Registers every tensor of a state dict (or (name, tensor) pairs) whole."""
        for name, t in named(tensors):
            self.register(name, t)

    def rebind(self, name: str, dest: Any) -> None:
        """Points registered tensor ``name`` at new memory of the same dtype
        and size (an engine that reallocated the parameter), between
        receives. What the new memory holds is unknown, so the receiver asks
        for a seed: the next sync is refused (the sender is told why) and
        the one after reseeds it."""
        a = arg(name, dest, writable=True)
        self._live().rebind(a, _torch_or_none(dest))
        self._dests[name] = [dest]

    def receive(self) -> dict:
        """Takes one sync: returns ``sync_id``, ``seed``, ``frames``, ``bytes``,
        ``elements_written``, ``tensors``, ``partial`` and the time split
        (``wait_s``, ``receive_s``, ``apply_s``, ``verify_s``). A seed writes
        every element and counts no changes (the sender's ``changed`` counts
        a delta's)."""
        return self._live().receive()

    def health(self) -> dict:
        """Where the receiver stands, from any thread: ``connected``,
        ``seeded``, ``in_call``, ``waiting`` (for a sync to begin) and
        ``waiting_s``, ``last_sync_id``, ``failures_in_a_row``, and ``ok``
        with ``error`` (the connection's state, or why it broke)."""
        return self._live().health()

    def close(self) -> None:
        super().close()
        self._dests = {}


def _torch_or_none(t: Any) -> Any:
    """The torch tensor whose memory a receiver checks before each sync
    (numpy memory cannot be swapped under an array)."""
    return t if is_torch(t) else None


def shard_spec_from_dtensor(name: str, dt: Any) -> ShardSpec:
    """The :class:`ShardSpec` of an FSDP2 / tensor-parallel ``DTensor``
    parameter named ``name``: which box of the whole tensor this rank's
    local shard holds. ``Shard(d)`` placements split like ``torch.chunk``
    (nested ones too); under ``Replicate`` only the replica at mesh
    coordinate 0 contributes. ``Partial`` placements are refused (reduce
    them first), and so is any other kind of shard (``_StridedShard``, as
    FSDP2 over tensor parallelism makes): describe those with
    :meth:`ShardSpec.box`. Also available as ``ShardSpec.from_dtensor``."""
    placements = getattr(dt, "placements", None)
    mesh = getattr(dt, "device_mesh", None)
    if placements is None or mesh is None:
        raise InvalidArgumentError(f"tensor '{name}': not a DTensor (no placements/device_mesh)")
    shape = [int(x) for x in dt.shape]
    coord = mesh.get_coordinate()
    if coord is None:
        raise InvalidArgumentError(f"tensor '{name}': this rank is not in the DTensor's mesh")
    offset = [0] * len(shape)
    extent = list(shape)
    contributes = True
    for mesh_dim, p in enumerate(placements):
        kind = type(p).__name__
        if kind == "Replicate":
            contributes = contributes and coord[mesh_dim] == 0
            continue
        if kind != "Shard" and kind.endswith("Shard"):
            # _StridedShard (FSDP2 over TP on a 2-D mesh) and any other kind
            # of Shard lay elements out otherwise than nested torch.chunk:
            # read as a plain Shard they would describe elements this rank
            # does not hold. Never guess.
            raise UnsupportedError(
                f"tensor '{name}': a {p!r} placement (deltasync reads Shard and Replicate "
                "exactly; describe this rank's part with ShardSpec.box(name, dtype, shape, "
                "offset, extent) instead)"
            )
        if kind == "Shard":
            d = int(p.dim)
            if d < 0:
                d += len(shape)
            n = int(mesh.size(mesh_dim))
            c = int(coord[mesh_dim])
            chunk = -(-extent[d] // n) if extent[d] else 0
            start = min(c * chunk, extent[d])
            size = max(0, min(extent[d], start + chunk) - start)
            offset[d] += start
            extent[d] = size
            continue
        raise UnsupportedError(
            f"tensor '{name}': a {kind} placement (deltasync takes Shard and Replicate; "
            "reduce a Partial tensor first)"
        )
    local = dt.to_local() if hasattr(dt, "to_local") else None
    if local is not None and [int(x) for x in local.shape] != extent:
        raise InvalidArgumentError(
            f"tensor '{name}': its local shard is {list(local.shape)}, but its placements "
            f"give {extent} (uneven sharding other than torch.chunk's is not supported)"
        )
    spec = ShardSpec.box(name, dtype_name(local if local is not None else dt), shape, offset, extent)
    spec.contributes = contributes
    return spec


ShardSpec.from_dtensor = staticmethod(shard_spec_from_dtensor)


def quantize_fp8_shard(group: Any, window: Any, windows: Sequence[Sequence[int]],
                       shape: Sequence[int], scheme: str = "block128",
                       scale_format: str = "f32", *, name: str = "weight") -> tuple:
    """This trainer rank's piece of a sharded 2-D weight quantized to FP8
    E4M3 exactly as quantizing the whole weight would (see
    :func:`deltasync.quantize_fp8` for ``scheme`` and ``scale_format``).

    A collective over ``group`` (a :class:`Group` or a :class:`TorchGroup`
    of the trainer's ranks): every rank calls it with ``windows``, every
    rank's ``(row_begin, row_end, col_begin, col_end)`` in the weight of
    ``shape``, and ``window``, its own elements (host memory, BF16, F16 or
    F32). A scale block that crosses a shard border takes the amax of every
    rank that holds part of it: only those blocks' amax travel, never their
    elements. Returns ``(codes, scales, groups)``: the window's codes
    (uint8), the scales of the scale groups it touches, and those groups'
    ``(row_begin, row_end, col_begin, col_end)`` in the scale grid. A NaN or
    infinite weight on any rank raises InvalidArgumentError on every rank."""
    return _deltasync.quantize_fp8_shard(
        group, arg(name, window), [list(map(int, w)) for w in windows],
        list(map(int, shape)), scheme, scale_format)


def fp8_shard_specs(name: str, windows: Sequence[Sequence[int]], shape: Sequence[int],
                    rank: int, scheme: str = "block128", scale_format: str = "f32",
                    scale_name: Optional[str] = None) -> tuple:
    """The :class:`ShardSpec` pair that rank ``rank`` passes
    :meth:`StreamSender.sync_shards` with the ``codes`` and ``scales`` that
    :func:`quantize_fp8_shard` (or :class:`Fp8ShardQuantizer`) gave it for
    the weight ``name`` of ``shape``, with the same ``windows``, ``scheme``
    and ``scale_format``: ``(codes_spec, scales_spec)``. The codes travel as
    the ``F8_E4M3`` tensor ``name``, the scales as ``scale_name`` (default
    ``name + "_scale_inv"``, as the engines' checkpoints name them). A scale
    group that several ranks' windows touch is sent by the lowest of them
    only, so every code and scale is sent once across the ranks; receivers
    register ``name`` as ``F8_E4M3`` of ``shape`` and ``scale_name`` as the
    recipe's scale tensor (the shape :func:`quantize_fp8` returns)."""
    return _deltasync.fp8_shard_specs(
        name, [list(map(int, w)) for w in windows], list(map(int, shape)), int(rank), scheme,
        scale_format, scale_name if scale_name is not None else name + "_scale_inv")


class Fp8ShardQuantizer:
    """:func:`quantize_fp8_shard` over one communicator, formed once.

    ``quantize_fp8_shard`` forms a communicator over ``group`` at every
    call (a rendezvous for a :class:`Group`); a trainer that quantizes every
    weight at every step makes one ``Fp8ShardQuantizer(group)`` instead
    (a collective: every rank of the group makes it) and calls
    :meth:`quantize` for each weight, every rank the same weights in the
    same order. Use it as a context manager, or :meth:`close` it. After
    the communicator fails (a peer gone, a timeout) every later call fails
    too: close it and make a new one."""

    def __init__(self, group: Any):
        self._impl = _deltasync.Fp8ShardQuantizer(group)

    @property
    def rank(self) -> int:
        """This rank in the group."""
        return self._impl.rank

    @property
    def size(self) -> int:
        """The group's number of ranks."""
        return self._impl.size

    def quantize(self, window: Any, windows: Sequence[Sequence[int]], shape: Sequence[int],
                 scheme: str = "block128", scale_format: str = "f32", *,
                 name: str = "weight") -> tuple:
        """What :func:`quantize_fp8_shard` returns, over this quantizer's
        communicator; the same arguments but ``group``."""
        return self._impl.quantize(
            arg(name, window), [list(map(int, w)) for w in windows],
            list(map(int, shape)), scheme, scale_format)

    def close(self) -> None:
        """Releases the communicator; later calls raise
        FailedPreconditionError."""
        self._impl.close()

    def __enter__(self) -> "Fp8ShardQuantizer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
