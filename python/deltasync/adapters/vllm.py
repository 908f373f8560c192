"""vLLM: a weight transfer engine that receives deltas over deltasync's stream.

**Versions.** vLLM 0.25.0 or later: the engine is vLLM's worker-side
``WeightTransferEngine`` as its factory builds it there,
``create_engine(config, vllm_config, device, model)``, driven by
``start_weight_update`` / ``update_weights`` / ``finish_weight_update``.
Earlier forms of that interface do not fit: 0.16.0, which introduced it,
built engines as ``create_engine(config, parallel_config)`` (no model to
write into) and took only the backend names of a closed
``Literal["nccl", "ipc"]``, and 0.21.0 still passed no model.
:func:`register` refuses a vLLM whose engine constructor lacks
``vllm_config``, ``device`` and ``model``.

**Engine side.** Installing the package adds a ``vllm.general_plugins``
entry point, :func:`vllm_plugin`, which vLLM runs in every process it
starts (the API server, each engine core, each worker, Ray's included), so
``vllm serve MODEL --weight-transfer-config '{"backend": "deltasync"}'``
(or ``LLM(..., weight_transfer_config={"backend": "deltasync"})``) is all
it takes. :func:`register` does the same by hand, in its own process only;
both may run any number of times. Each worker's
:class:`DeltasyncWeightTransferEngine` learns where every checkpoint
tensor lives in its model (a dry run of the model's ``load_weights``,
:mod:`.weight_map`), joins the stream group as receiver
``rank_offset + data_parallel_index * world_size + rank`` (vLLM's own
numbering of a worker across data-parallel replicas), on the worker's
current CUDA device, and registers the parameters themselves as the
destinations, so each sync's changed elements land in place. Tensors the
dry run cannot map are received into host copies and loaded through the
stock ``load_weights`` (reported in
:attr:`DeltasyncWeightTransferEngine.fallback`). vLLM's post-load
processing (``process_weights_after_loading`` of each quant method, then
of each attention layer) is dry-run too: after each sync the steps that
derive weights from loaded ones run again (MLA's ``W_UK_T``/``W_UV``),
a parameter a step rewrites into the kernel's layout (the unquantized MoE's
``w13`` on FlashInfer-CUTLASS or AITER) is loaded whole from its host
copies and the step run again, every weight keeping its memory; a model
neither keeps right is refused at ``init_transfer_engine``, naming the
tensor (:mod:`.engine`). A speculative-decoding draft model is not updated
(``supports_draft_weight_update`` is False).

**Update flow.** From 0.25.0 vLLM's worker hands ``start_weight_update`` and
``finish_weight_update`` to the engine, and an engine that writes weights in
place leaves them as no-ops (``vllm/distributed/weight_transfer/base.py``);
only an engine that loads checkpoint-format tensors runs vLLM's layerwise
reload there. This engine writes in place, so vLLM never moves its layers.
A worker that runs the layerwise reload itself, as vLLM's own did before the
engines owned the update (``start_weight_update(is_checkpoint_format=True)``
calling ``initialize_layerwise_reload``), puts every layer's weights on the
meta device until ``finalize_layerwise_reload`` and expects them back whole
through ``load_weights``: ``receive_weights`` refuses such a round before
receiving or writing anything (FailedPreconditionError naming it), and the
worker's finish puts the untouched weights back. Start such a worker's
update with ``is_checkpoint_format=False``.

**Trainer side.** :class:`DeltasyncTrainer` drives the round trip
(``init_weight_transfer_engine`` once, then ``start_weight_update``,
``update_weights`` beside the sender's sync, ``finish_weight_update``)
and runs the sender (:class:`deltasync.StreamSender`, rank 0) beside it.
Each kind of client gets the arguments it takes:

* a client of vLLM's ``VLLMWeightSyncClient`` shape (the HTTP routes'
  client, a Ray actor's wrapper): plain ``init_info`` / ``update_info``
  dicts;
* ``vllm.LLM``: ``{"init_info": ...}`` / ``{"update_info": ...}``;
* ``AsyncLLM`` (its calls are coroutines): ``WeightTransferInitRequest`` /
  ``WeightTransferUpdateRequest``, awaited on the engine's event loop
  (``loop=``).

An error in a round returns at once: the trainer never waits on the
workers' side of a round that failed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import logging
import threading
from typing import Any, Callable, Iterator, Optional

import torch

from ..errors import (
    DeadlineExceededError,
    FailedPreconditionError,
    InvalidArgumentError,
    UnsupportedError,
)
from ..stream import Group, StreamReceiver, StreamSender
from .._tensors import dtype_name, named
from .engine import EngineWeights, post_load_steps

log = logging.getLogger("deltasync.adapters")

try:  # the real base class where vLLM is installed
    from vllm.distributed.weight_transfer.base import WeightTransferEngine as _Base
except ImportError:  # pragma: no cover - vLLM absent: the same interface, standalone

    class _Base:  # type: ignore[no-redef]
        """vLLM's WeightTransferEngine interface, for use without vLLM."""

        init_info_cls: Any
        update_info_cls: Any
        supports_draft_weight_update: bool = True

        def __init__(self, config: Any, vllm_config: Any, device: Any, model: Any) -> None:
            self.config = config
            self.vllm_config = vllm_config
            self.parallel_config = getattr(vllm_config, "parallel_config", None)
            self.device = device
            self.model = model

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
VLLM_MIN_VERSION = "0.25.0"
_MODULE = "deltasync.adapters.vllm"


@dataclasses.dataclass
class DeltasyncInitInfo:
    """What every worker needs to join the stream group: the group's
    rendezvous (``file:/dir`` or ``redis://host:port``), its size (1 + the
    number of workers of every data-parallel replica), this engine's first
    receiver rank, and the checkpoint's tensors as [name, dtype, shape]
    (what the trainer syncs)."""

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


def _int_attr(obj: Any, name: str) -> Optional[int]:
    v = getattr(obj, name, None)
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def worker_index(parallel_config: Any) -> int:
    """A worker's index among all the workers of every data-parallel
    replica, as vLLM numbers it for its own weight transfer:
    ``data_parallel_index * world_size + rank`` (``world_size`` is one
    replica's workers, TP x PP)."""
    rank = _int_attr(parallel_config, "rank") or 0
    dp = _int_attr(parallel_config, "data_parallel_index")
    if dp is None:
        dp = _int_attr(parallel_config, "data_parallel_rank") or 0
    world = _int_attr(parallel_config, "world_size") or 1
    return dp * world + rank


def _current_cuda_device() -> Optional[int]:
    """The calling thread's CUDA device, None without CUDA."""
    if torch.cuda.is_available():
        return int(torch.cuda.current_device())
    return None


def _group(rendezvous: str, rank: int, size: int, **kwargs: Any) -> Group:
    """A Group on the current CUDA device (an ``nccl`` group's GPU)."""
    device = _current_cuda_device()
    if device is not None:
        kwargs["cuda_device"] = device
    return Group(rendezvous, rank, size, **kwargs)


class DeltasyncWeightTransferEngine(_Base):
    """vLLM's ``WeightTransferEngine`` for deltasync's stream (one per worker)."""

    init_info_cls = DeltasyncInitInfo
    update_info_cls = DeltasyncUpdateInfo
    # The receiver's destinations are the target model's own parameters,
    # registered once: a round cannot be pointed at another model.
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: Any = None,
                 model: Optional[torch.nn.Module] = None) -> None:
        super().__init__(config, vllm_config, device, model)
        self.model = model
        self.device = device
        self.vllm_config = vllm_config
        self.parallel_config = getattr(vllm_config, "parallel_config", vllm_config)
        self.weights: Optional[EngineWeights] = None
        self.receiver: Optional[StreamReceiver] = None
        self.rank: Optional[int] = None
        self.last: Optional[dict] = None
        self._meta_at_init: set[str] = set()

    def set_weight_update_target(self, model: torch.nn.Module, model_config: Any,
                                 **kwargs: Any) -> None:
        """vLLM's hook to point a round at another model (a speculative
        draft): refused, the deltas go to the target model only."""
        if model is not self.model:
            raise UnsupportedError(
                "deltasync: updating a speculative-decoding draft model is not supported "
                "(supports_draft_weight_update is False); only the target model is synced"
            )

    def reset_weight_update_target(self) -> None:
        """Nothing to reset: the target model is always the one updated."""

    def init_transfer_engine(self, init_info: DeltasyncInitInfo) -> None:
        """Learns the model's weight map (a dry run of its load_weights),
        joins the stream group and registers every checkpoint tensor."""
        if self.model is None:
            raise FailedPreconditionError("deltasync: the engine has no model to update")
        index = worker_index(self.parallel_config)
        rank = init_info.rank_offset + index
        if not 0 < rank < init_info.size:
            raise InvalidArgumentError(
                f"deltasync: this worker's rank {rank} (rank_offset {init_info.rank_offset} + "
                f"data-parallel index x world size + rank = {index}) is outside the group of "
                f"{init_info.size}: the trainer's workers= counts every worker of every "
                "data-parallel replica"
            )
        self.weights = EngineWeights(self.model, [tuple(e) for e in init_info.checkpoint],
                                     post_load=self._post_load)
        self._meta_at_init = {n for n, p in self.model.named_parameters() if p.is_meta}
        if self.receiver is not None:
            self.receiver.close()
        # A worker that holds none of some tensors (other experts, other
        # pipeline stages) takes part of the model on purpose.
        self.receiver = StreamReceiver(_group(init_info.rendezvous, rank, init_info.size,
                                              backend=init_info.backend, group=init_info.group,
                                              timeout_s=init_info.timeout_s),
                                       partial=bool(self.weights.skipped))
        self.rank = rank
        self.weights.register(self.receiver)

    def _post_load(self, model: torch.nn.Module) -> list:
        """vLLM's post-load processing of ``model``, one step per module:
        each quant method's, then each attention layer's with the model's
        dtype (:func:`.engine.post_load_steps`)."""
        dtype = getattr(getattr(self.vllm_config, "model_config", None), "dtype", None)
        if not isinstance(dtype, torch.dtype):
            dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()),
                         torch.get_default_dtype())
        return post_load_steps(model, dtype)

    @property
    def fallback(self) -> list[str]:
        """Checkpoint tensors loaded through the stock load_weights."""
        return self.weights.fallback if self.weights else []

    def start_weight_update(self) -> None:
        """Nothing to prepare: deltas are written in place, so no layerwise
        reload (vLLM's contract for an in-place engine)."""

    def _in_layerwise_reload(self) -> Optional[str]:
        """A parameter the worker moved to the meta device since
        init_transfer_engine (vLLM's layerwise reload does so to every
        layer), None if none."""
        for name, p in self.model.named_parameters():
            if p.is_meta and name not in self._meta_at_init:
                return name
        return None

    def receive_weights(self, update_info: DeltasyncUpdateInfo,
                        load_weights: Optional[Callable] = None) -> None:
        """Takes one sync from the stream (the changes land in the
        parameters), then loads the fallback tensors through the stock
        load_weights. Raises if the sync is not the one announced, and
        before receiving anything if the worker started vLLM's layerwise
        reload (see the module's *Update flow*). ``load_weights``, which a
        worker running that reload passes, is not used."""
        if self.receiver is None or self.weights is None:
            raise FailedPreconditionError("deltasync: init_transfer_engine was not called")
        on_meta = self._in_layerwise_reload()
        if on_meta is not None:
            raise FailedPreconditionError(
                f"deltasync: parameter '{on_meta}' is on the meta device: the worker started "
                "vLLM's layerwise reload (start_weight_update(is_checkpoint_format=True) runs "
                "initialize_layerwise_reload), which takes whole checkpoint-format tensors "
                "through load_weights, but deltasync writes changed elements into the live "
                "parameters; start the update with is_checkpoint_format=False. Nothing was "
                "received or written"
            )
        # Parameters the engine moved since the last sync (a reload from
        # disk, sleep and wake, expert rebalancing) are found before any
        # write: the receiver follows them, or the round fails naming them.
        self.weights.refresh(self.receiver)
        stats = self.receiver.receive()
        if update_info.sync_id and stats["sync_id"] != update_info.sync_id:
            raise FailedPreconditionError(
                f"deltasync: received sync {stats['sync_id']}, expected {update_info.sync_id}"
            )
        # The stock-path tensors, then the post-load steps (derived weights,
        # kernel layouts) over what the receiver wrote.
        self.weights.reload_shadows()
        self.last = stats

    def finish_weight_update(self) -> None:
        """Nothing to finish: every sync was verified by its digests."""

    def shutdown(self) -> None:
        """Leaves the stream group (a receive in flight ends with an error)."""
        if self.receiver is not None:
            self.receiver.close()
            self.receiver = None

    @staticmethod
    def trainer_send_weights(iterator: Iterator, trainer_args: Any) -> None:
        """vLLM's static trainer call: ``trainer_args["sender"]`` syncs the weights."""
        sender = trainer_args["sender"] if isinstance(trainer_args, dict) else trainer_args
        sender.sync(list(iterator))


def _check_engine_interface(base: type) -> None:
    """Refuses a vLLM whose engines are not built with (config, vllm_config,
    device, model)."""
    params = list(inspect.signature(base.__init__).parameters)[1:]
    if not all(p in params for p in ("vllm_config", "device", "model")):
        raise UnsupportedError(
            f"deltasync: this vLLM builds weight transfer engines with ({', '.join(params)}), "
            f"not (config, vllm_config, device, model): vLLM {VLLM_MIN_VERSION} or later is needed"
        )


def register() -> None:
    """Registers ``"deltasync"`` with vLLM's WeightTransferEngineFactory in
    this process. Idempotent: a second call (or the plugin's) does nothing.
    Raises ImportError without vLLM's weight transfer API and
    UnsupportedError on a vLLM older than the adapter supports."""
    from vllm.distributed.weight_transfer.base import WeightTransferEngine
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    _check_engine_interface(WeightTransferEngine)
    registry = getattr(WeightTransferEngineFactory, "_registry", None)
    if isinstance(registry, dict) and BACKEND in registry:
        return
    try:
        WeightTransferEngineFactory.register_engine(
            BACKEND, _MODULE, "DeltasyncWeightTransferEngine"
        )
    except ValueError as e:  # registered meanwhile
        if "already registered" not in str(e):
            raise


def vllm_plugin() -> None:
    """The package's ``vllm.general_plugins`` entry point: vLLM calls it in
    every process it starts, workers included, before any engine is built.
    Registers the backend (:func:`register`); on a vLLM without a fitting
    weight transfer API it logs why and changes nothing."""
    try:
        register()
    except ImportError as e:
        log.info("deltasync: no vLLM weight transfer API here (%s); backend %r not registered",
                 e, BACKEND)
    except UnsupportedError as e:
        log.warning("%s; backend %r not registered", e, BACKEND)


_APIS = ("plain", "llm", "async")


def client_api(client: Any) -> str:
    """Which arguments ``client`` takes: ``"async"`` (its calls are
    coroutines, as AsyncLLM's: request objects), ``"llm"`` (its
    init_weight_transfer_engine takes a ``request``, as ``vllm.LLM``'s:
    ``{"init_info": ...}`` dicts) or ``"plain"`` (``init_info`` /
    ``update_info`` dicts, as vLLM's VLLMWeightSyncClient)."""
    fn = getattr(client, "init_weight_transfer_engine", None)
    if fn is None:
        raise InvalidArgumentError(
            f"deltasync: {type(client).__name__} has no init_weight_transfer_engine"
        )
    if inspect.iscoroutinefunction(fn):
        return "async"
    try:
        params = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return "plain"
    return "llm" if params[:1] == ["request"] else "plain"


class _Calls:
    """vLLM's four weight-sync calls, in the form one client takes."""

    def __init__(self, client: Any, api: str, loop: Optional[asyncio.AbstractEventLoop]) -> None:
        self.client = client
        self.api = client_api(client) if api == "auto" else api
        if self.api not in _APIS:
            raise InvalidArgumentError(
                f"deltasync: api {api!r}: expected 'auto', 'plain', 'llm' or 'async'"
            )
        self.loop = loop
        if self.api == "async":
            if loop is None:
                raise InvalidArgumentError(
                    "deltasync: an AsyncLLM client needs loop= (the event loop it runs on)"
                )
            from vllm.distributed.weight_transfer.base import (
                WeightTransferInitRequest,
                WeightTransferUpdateRequest,
            )

            self._init_request = WeightTransferInitRequest
            self._update_request = WeightTransferUpdateRequest

    def _call(self, name: str, *args: Any) -> Any:
        fn = getattr(self.client, name)
        if self.api != "async":
            return fn(*args)
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self.loop:
            raise FailedPreconditionError(
                "deltasync: the trainer's calls wait for the engine, so they cannot run on "
                "the engine's own event loop: call them from another thread "
                "(asyncio.to_thread)"
            )
        return asyncio.run_coroutine_threadsafe(fn(*args), self.loop).result()

    def init(self, info: dict) -> None:
        if self.api == "async":
            self._call("init_weight_transfer_engine", self._init_request(init_info=info))
        elif self.api == "llm":
            self._call("init_weight_transfer_engine", {"init_info": info})
        else:
            self._call("init_weight_transfer_engine", info)

    def start(self) -> None:
        self._call("start_weight_update")

    def update(self, info: dict) -> None:
        if self.api == "async":
            self._call("update_weights", self._update_request(update_info=info))
        elif self.api == "llm":
            self._call("update_weights", {"update_info": info})
        else:
            self._call("update_weights", info)

    def finish(self) -> None:
        self._call("finish_weight_update")


class DeltasyncTrainer:
    """The trainer's side. ``client`` has vLLM's weight-sync calls: an
    engine client of vLLM's ``VLLMWeightSyncClient`` shape (the HTTP routes'
    client, a Ray actor's wrapper), ``vllm.LLM``, or ``AsyncLLM`` with
    ``loop`` its event loop; ``api`` names which when the call signatures
    do not tell (:func:`client_api`). ``workers`` counts the engine's
    workers, every data-parallel replica's. ``checkpoint`` names the
    tensors ((name, tensor) pairs or a state dict) the trainer will sync.

    A round that fails returns its error at once and leaves nothing to
    wait for: an error of the sender's leaves the workers' update_weights
    running (the next round is refused until it ends); a worker's error
    ends the sync in flight by closing the sender, after which the trainer
    is closed (build a new one)."""

    def __init__(self, client: Any, checkpoint: Any, *, rendezvous: str, workers: int,
                 group: str = "deltasync", backend: str = "gloo", timeout_s: float = 600.0,
                 encoding: str = "indices", api: str = "auto",
                 loop: Optional[asyncio.AbstractEventLoop] = None) -> None:
        pairs = named(checkpoint)
        self.client = client
        self.timeout_s = timeout_s
        self._calls = _Calls(client, api, loop)
        self._update: Optional[threading.Thread] = None
        # How long a sync may go on after the workers' update failed before
        # the sender is closed to end it (a refusal ends it sooner).
        self.cancel_grace_s = min(0.5, timeout_s)
        # The sender numbers every sync it starts, one that fails too: after
        # a failed sync the next one's id is not known here.
        self._ids_known = True
        self.init_info = DeltasyncInitInfo(
            rendezvous=rendezvous, size=1 + workers,
            checkpoint=[[n, dtype_name(t), list(t.shape)] for n, t in pairs],
            group=group, backend=backend, timeout_s=timeout_s)
        self._calls.init(dataclasses.asdict(self.init_info))
        self.sender = StreamSender(_group(rendezvous, 0, 1 + workers, backend=backend,
                                          group=group, timeout_s=timeout_s), encoding=encoding)

    @property
    def api(self) -> str:
        """The arguments the client is given: "plain", "llm" or "async"."""
        return self._calls.api

    def send_weights(self, weights: Any) -> dict:
        """One round trip: start, the workers' receive beside this sender's
        sync, finish. Returns the sync's stats."""
        if self._update is not None and self._update.is_alive():
            raise FailedPreconditionError(
                "deltasync: the workers are still in the update_weights of a round that "
                "failed on the trainer's side; wait for it to end"
            )
        self._calls.start()
        sync_id = self.sender.committed_sync_id + 1 if self._ids_known else 0  # 0: unchecked
        lock = threading.Lock()
        state: dict[str, Any] = {"failure": None, "in_sync": True}
        done = threading.Event()
        ended = threading.Event()  # the sender's sync returned
        sender = self.sender

        def workers() -> None:
            try:
                self._calls.update(dataclasses.asdict(DeltasyncUpdateInfo(sync_id)))
            except BaseException as e:
                with lock:
                    state["failure"] = e
                    waiting = state["in_sync"]
                if waiting:
                    # A worker that refused the round tells the sender too, whose
                    # sync then ends on its own and the next round repairs it; one
                    # that will never answer leaves the sync waiting: after a grace
                    # period the sender is closed to end it.
                    ended.wait(self.cancel_grace_s)
                    with lock:
                        close = state["in_sync"]
                    if close:
                        sender.close()
            finally:
                done.set()

        # A daemon: a failed round never waits for it (nor does the interpreter's exit).
        t = threading.Thread(target=workers, name="deltasync-vllm-update", daemon=True)
        self._update = t
        t.start()
        try:
            stats = self.sender.sync(weights)
        except BaseException as e:
            self._ids_known = False
            with lock:
                state["in_sync"] = False
                failure = state["failure"]
            ended.set()
            if failure is not None:
                raise failure from e
            raise
        self._ids_known = True
        with lock:
            state["in_sync"] = False
        ended.set()
        if not done.wait(self.timeout_s):
            raise DeadlineExceededError(
                f"deltasync: the workers' update_weights did not return within "
                f"{self.timeout_s} s of the sync"
            )
        if state["failure"] is not None:
            raise state["failure"]
        self._calls.finish()
        return stats

    def close(self) -> None:
        """Closes the sender (leaves the stream group)."""
        self.sender.close()


__all__ = ["BACKEND", "VLLM_MIN_VERSION", "DeltasyncInitInfo", "DeltasyncTrainer",
           "DeltasyncUpdateInfo", "DeltasyncWeightTransferEngine", "client_api", "register",
           "vllm_plugin", "worker_index"]
