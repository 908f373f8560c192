"""The stream over a ``torch.distributed`` process group the trainer already has.

``TorchGroup(group)`` lets a :class:`~deltasync.StreamSender` and its
receivers talk through an existing Gloo or NCCL process group instead of
forming their own. The group's rank 0 is the sender; every other rank is a
receiver. Over Gloo frames are host buffers, sent in place. Over NCCL a
frame in device memory (every tensor of a side on the group's device) is
sent in place too, and a host frame is staged through a device buffer.
"""

from __future__ import annotations

from typing import Any, Optional

from .errors import InvalidArgumentError, UnsupportedError

try:
    import torch
    import torch.distributed as dist
except ImportError:  # pragma: no cover
    torch = None
    dist = None


def _global_rank(group: Any, rank: int) -> int:
    if group is None or group is dist.group.WORLD:
        return rank
    if hasattr(dist, "get_global_rank"):
        return dist.get_global_rank(group, rank)
    return dist.distributed_c10d._get_global_rank(group, rank)  # torch < 2.0


class DeviceBytes:
    """Bytes in CUDA device memory that deltasync hands a communicator:
    ``torch.as_tensor(DeviceBytes(...), device="cuda")`` views them in place
    (``__cuda_array_interface__``)."""

    def __init__(self, pointer: int, nbytes: int) -> None:
        self.pointer = int(pointer)
        self.nbytes = int(nbytes)

    @property
    def __cuda_array_interface__(self) -> dict:
        return {"shape": (self.nbytes,), "typestr": "|u1", "data": (self.pointer, False),
                "version": 3, "strides": None}


class TorchGroup:
    """A communicator over ``group`` (None: the default group).

    ``timeout_s`` is what deltasync reports as the communicator's timeout;
    the group's own timeout (``init_process_group(timeout=...)``) decides
    when a silent peer fails a call. ``device`` is the CUDA device an NCCL
    group stages through (default: the current one). ``key_file`` (or the
    environment's ``DELTASYNC_STREAM_KEY_FILE`` / ``DELTASYNC_STREAM_KEY``)
    authenticates every message as :class:`~deltasync.Group`'s does; frames
    then travel through host memory.
    """

    backend = ""  # not a built-in communicator: deltasync calls the methods below

    def __init__(self, group: Any = None, *, timeout_s: float = 1800, device: Any = None,
                 key_file: str = "") -> None:
        if dist is None or not dist.is_available():
            raise UnsupportedError("TorchGroup: this torch has no torch.distributed")
        if not dist.is_initialized():
            raise InvalidArgumentError(
                "TorchGroup: torch.distributed is not initialized (call init_process_group first)"
            )
        self.group = group
        self.torch_backend = str(dist.get_backend(group)).lower()
        if self.torch_backend not in ("gloo", "nccl"):
            raise UnsupportedError(
                f"TorchGroup: a {self.torch_backend} group (deltasync takes gloo and nccl groups)"
            )
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        if self.rank < 0:
            raise InvalidArgumentError("TorchGroup: this process is not a member of the group")
        self.name = "torch-" + self.torch_backend
        self.timeout_s = float(timeout_s)
        self.key_file = key_file
        self._device: Optional[Any] = None
        if self.torch_backend == "nccl":
            self._device = torch.device("cuda", torch.cuda.current_device()) if device is None \
                else torch.device(device)
        # deltasync hands an NCCL group its device frames (on this device)
        # as DeviceBytes.
        self.device_buffers = self._device is not None
        self.cuda_device = self._device.index if self._device is not None else -1

    @property
    def impl(self) -> "TorchGroup":
        """The object whose methods deltasync calls: this one."""
        return self

    def _global(self, rank: int) -> int:
        return _global_rank(self.group, rank)

    def _wrap(self, view: Any) -> "torch.Tensor":
        if isinstance(view, DeviceBytes):
            return torch.as_tensor(view, device=self._device)
        return torch.frombuffer(view, dtype=torch.uint8)

    def _staged(self, host: "torch.Tensor") -> "torch.Tensor":
        return host if self._device is None or host.is_cuda else host.to(self._device)

    def _back(self, staged: "torch.Tensor", host: "torch.Tensor") -> None:
        if staged is not host:
            host.copy_(staged)
        elif host.is_cuda:
            self._done()

    def _done(self) -> None:
        # deltasync reads and reuses its device buffers on streams of its
        # own as soon as a call returns: the collective must be done.
        torch.cuda.current_stream(self._device).synchronize()

    def send(self, peer: int, view: Any) -> None:
        """Sends the bytes of ``view`` (a memoryview, or DeviceBytes over
        NCCL) to group rank ``peer``."""
        mine = self._wrap(view)
        t = self._staged(mine)
        dist.send(t, dst=self._global(peer), group=self.group)
        if t is mine and t.is_cuda:
            self._done()

    def recv(self, peer: int, view: Any) -> None:
        """Receives ``len(view)`` bytes from group rank ``peer`` into ``view``."""
        host = self._wrap(view)
        t = self._staged(host)
        dist.recv(t, src=self._global(peer), group=self.group)
        self._back(t, host)

    def broadcast(self, root: int, view: Any) -> None:
        """Broadcasts ``view`` from group rank ``root`` into every member's ``view``."""
        host = self._wrap(view)
        t = self._staged(host)
        dist.broadcast(t, src=self._global(root), group=self.group)
        self._back(t, host)

    def barrier(self) -> None:
        """Waits for every member of the group."""
        dist.barrier(group=self.group)

    def gather(self, root: int, record: memoryview, out: Optional[memoryview]) -> None:
        """Gathers each member's ``record`` into ``out`` (rank order) on ``root``."""
        t = self._staged(self._wrap(record))
        if out is None:
            dist.gather(t, gather_list=None, dst=self._global(root), group=self.group)
            return
        host = self._wrap(out).view(self.size, -1)
        staged = self._staged(host)
        rows = list(staged.unbind(0))
        dist.gather(t, gather_list=rows, dst=self._global(root), group=self.group)
        self._back(staged, host)

    def all_gather(self, record: memoryview, out: memoryview) -> None:
        """Gathers each member's ``record`` into every member's ``out``."""
        t = self._staged(self._wrap(record))
        host = self._wrap(out).view(self.size, -1)
        staged = self._staged(host)
        dist.all_gather(list(staged.unbind(0)), t, group=self.group)
        self._back(staged, host)
