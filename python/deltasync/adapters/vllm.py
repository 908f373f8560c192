"""vLLM: a weight transfer engine that receives deltas over deltasync's stream.

Engine side: :func:`register` adds ``"deltasync"`` to vLLM's
``WeightTransferEngineFactory``; start vLLM with that weight transfer
backend. Each worker's :class:`DeltasyncWeightTransferEngine` learns where
every checkpoint tensor lives in its model (a dry run of the model's
``load_weights``, :mod:`.weight_map`), joins the stream group as receiver
``rank_offset + worker rank``, and registers the parameters themselves as
the destinations, so each sync's changed elements land in place. Tensors
the dry run cannot map are received into host copies and loaded through the
stock ``load_weights`` (reported in :attr:`DeltasyncWeightTransferEngine.fallback`).

Trainer side: :class:`DeltasyncTrainer` drives the round trip through a
client with vLLM's weight-sync calls (``init_weight_transfer_engine``,
``start_weight_update``, ``update_weights``, ``finish_weight_update``) and
runs the sender (:class:`deltasync.StreamSender`, rank 0) beside it.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Callable, Iterator, Optional

import torch

from ..errors import FailedPreconditionError, InvalidArgumentError
from ..stream import Group, StreamReceiver, StreamSender
from .._tensors import dtype_name, named
from .engine import EngineWeights

try:  # the real base class where vLLM is installed
    from vllm.distributed.weight_transfer.base import WeightTransferEngine as _Base
except ImportError:  # pragma: no cover - vLLM absent: the same interface, standalone

    class _Base:  # type: ignore[no-redef]
        """vLLM's WeightTransferEngine interface, for use without vLLM."""

        init_info_cls: Any
        update_info_cls: Any

        def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
            self.config = config

        def parse_init_info(self, init_dict: dict) -> Any:
            """The typed init info from a dict; ValueError when it does not fit."""
            try:
                return self.init_info_cls(**init_dict)
            except TypeError as e:
                raise ValueError(f"Invalid init_info for {type(self).__name__}: {e}") from e

        def parse_update_info(self, update_dict: dict) -> Any:
            """The typed update info from a dict; ValueError when it does not fit."""
            try:
                return self.update_info_cls(**update_dict)
            except TypeError as e:
                raise ValueError(f"Invalid update_info for {type(self).__name__}: {e}") from e

        def update_weights(self, update_info: dict) -> None:
            """Receives one update described by a dict."""
            self.receive_weights(self.parse_update_info(update_info))


BACKEND = "deltasync"


@dataclasses.dataclass
class DeltasyncInitInfo:
    """What every worker needs to join the stream group: the group's
    rendezvous (``file:/dir`` or ``redis://host:port``), its size (1 + the
    number of workers), this engine's first receiver rank, and the
    checkpoint's tensors as [name, dtype, shape] (what the trainer syncs)."""

    rendezvous: str
    size: int
    checkpoint: list
    rank_offset: int = 1
    group: str = "deltasync"
    backend: str = "gloo"
    timeout_s: float = 600.0


@dataclasses.dataclass
class DeltasyncUpdateInfo:
    """One sync: its id as the trainer's sender numbers it (0: unchecked)."""

    sync_id: int = 0


class DeltasyncWeightTransferEngine(_Base):
    """vLLM's ``WeightTransferEngine`` for deltasync's stream (one per worker)."""

    init_info_cls = DeltasyncInitInfo
    update_info_cls = DeltasyncUpdateInfo

    def __init__(self, config: Any, vllm_config: Any = None, device: Any = None,
                 model: Optional[torch.nn.Module] = None) -> None:
        if model is not None:
            super().__init__(config, vllm_config, device, model)
        else:  # vLLM before the model moved into the engine's constructor
            super().__init__(config, vllm_config)
        self.model = model
        self.device = device
        self.parallel_config = getattr(vllm_config, "parallel_config", vllm_config)
        self.weights: Optional[EngineWeights] = None
        self.receiver: Optional[StreamReceiver] = None
        self.last: Optional[dict] = None

    def set_weight_update_target(self, model: torch.nn.Module, model_config: Any) -> None:
        """Updates ``model`` from now on (vLLM's draft-model hook)."""
        self.model = model

    def _worker_rank(self) -> int:
        pc = self.parallel_config
        for attr in ("rank", "tensor_parallel_rank", "tp_rank"):
            if hasattr(pc, attr) and isinstance(getattr(pc, attr), int):
                return getattr(pc, attr)
        return 0

    def init_transfer_engine(self, init_info: DeltasyncInitInfo) -> None:
        """Learns the model's weight map (a dry run of its load_weights),
        joins the stream group and registers every checkpoint tensor."""
        if self.model is None:
            raise FailedPreconditionError("deltasync: the engine has no model to update")
        self.weights = EngineWeights(self.model, [tuple(e) for e in init_info.checkpoint])
        rank = init_info.rank_offset + self._worker_rank()
        self.receiver = StreamReceiver(Group(init_info.rendezvous, rank, init_info.size,
                                             backend=init_info.backend, group=init_info.group,
                                             timeout_s=init_info.timeout_s))
        self.weights.register(self.receiver)

    @property
    def fallback(self) -> list[str]:
        """Checkpoint tensors loaded through the stock load_weights."""
        return self.weights.fallback if self.weights else []

    def start_weight_update(self) -> None:
        """Nothing to prepare: deltas are applied in place."""

    def receive_weights(self, update_info: DeltasyncUpdateInfo,
                        load_weights: Optional[Callable] = None) -> None:
        """Takes one sync from the stream (the changes land in the
        parameters), then loads the fallback tensors through the stock
        load_weights. Raises if the sync is not the one announced."""
        if self.receiver is None or self.weights is None:
            raise FailedPreconditionError("deltasync: init_transfer_engine was not called")
        stats = self.receiver.receive()
        if update_info.sync_id and stats["sync_id"] != update_info.sync_id:
            raise FailedPreconditionError(
                f"deltasync: received sync {stats['sync_id']}, expected {update_info.sync_id}"
            )
        self.weights.reload_shadows()
        self.last = stats

    def finish_weight_update(self) -> None:
        """Nothing to finish: every sync was verified by its digests."""

    def shutdown(self) -> None:
        """Leaves the stream group."""
        if self.receiver is not None:
            self.receiver.close()
            self.receiver = None

    @staticmethod
    def trainer_send_weights(iterator: Iterator, trainer_args: Any) -> None:
        """vLLM's static trainer call: ``trainer_args["sender"]`` syncs the weights."""
        sender = trainer_args["sender"] if isinstance(trainer_args, dict) else trainer_args
        sender.sync(list(iterator))


def register() -> None:
    """Registers ``"deltasync"`` with vLLM's WeightTransferEngineFactory."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    WeightTransferEngineFactory.register_engine(
        BACKEND, "deltasync.adapters.vllm", "DeltasyncWeightTransferEngine"
    )


class DeltasyncTrainer:
    """The trainer's side. ``client`` has vLLM's weight-sync calls (the
    engine client, the HTTP routes' client, or a Ray handle's wrapper);
    ``workers`` is the engine's worker count. ``checkpoint`` names the
    tensors ((name, tensor) pairs or a state dict) the trainer will sync."""

    def __init__(self, client: Any, checkpoint: Any, *, rendezvous: str, workers: int,
                 group: str = "deltasync", backend: str = "gloo", timeout_s: float = 600.0,
                 encoding: str = "indices") -> None:
        pairs = named(checkpoint)
        self.client = client
        self.init_info = DeltasyncInitInfo(
            rendezvous=rendezvous, size=1 + workers,
            checkpoint=[[n, dtype_name(t), list(t.shape)] for n, t in pairs],
            group=group, backend=backend, timeout_s=timeout_s)
        client.init_weight_transfer_engine(dataclasses.asdict(self.init_info))
        self.sender = StreamSender(Group(rendezvous, 0, 1 + workers, backend=backend, group=group,
                                         timeout_s=timeout_s), encoding=encoding)

    def send_weights(self, weights: Any) -> dict:
        """One round trip: start, the workers' receive beside this sender's
        sync, finish. Returns the sync's stats."""
        self.client.start_weight_update()
        sync_id = self.sender.committed_sync_id + 1
        failure: list = []

        def workers() -> None:
            try:
                self.client.update_weights(dataclasses.asdict(DeltasyncUpdateInfo(sync_id)))
            except BaseException as e:  # reported after the sync
                failure.append(e)

        t = threading.Thread(target=workers, name="deltasync-vllm-update")
        t.start()
        try:
            stats = self.sender.sync(weights)
        finally:
            t.join()
        if failure:
            raise failure[0]
        self.client.finish_weight_update()
        return stats

    def close(self) -> None:
        """Closes the sender (leaves the stream group)."""
        self.sender.close()


__all__ = ["BACKEND", "DeltasyncInitInfo", "DeltasyncTrainer", "DeltasyncUpdateInfo",
           "DeltasyncWeightTransferEngine", "register"]
