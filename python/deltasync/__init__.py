"""deltasync: keep rollout engines' weights in sync with an RL trainer by
shipping only the bytes that changed, bit-exactly.

Two transports, one package:

* the stream (online, every step): :class:`StreamSender` on the trainer,
  :class:`StreamReceiver` in each engine, over a :class:`Group` deltasync
  forms (gloo, nccl) or a :class:`TorchGroup` over an existing
  ``torch.distributed`` group;
* the disk store (versions on shared storage): :class:`Publisher`,
  :class:`LocalCheckpoint`, the per-host :class:`Agent` and the trainer's
  :class:`SyncCoordinator`.

Engines take deltas in place through :mod:`deltasync.adapters` (SGLang,
vLLM). Tensors are torch tensors (CPU, and CUDA in a CUDA build) or numpy
arrays, borrowed without copies; every heavy call releases the GIL; errors
are :class:`DeltasyncError` subclasses carrying the core's message.
"""

import os as _os
import sys as _sys

# torch carries its own Gloo; the extension's libgloo must bind to its own
# symbols, not to torch's (an ABI of another version): RTLD_DEEPBIND.
_flags = _sys.getdlopenflags()
if hasattr(_os, "RTLD_DEEPBIND") and not _os.environ.get("DELTASYNC_NO_DEEPBIND"):
    _sys.setdlopenflags(_flags | _os.RTLD_DEEPBIND)
try:
    from . import _deltasync
finally:
    _sys.setdlopenflags(_flags)

from ._tensors import Prepared, Raw, prepare
from .agent import Agent, SyncCoordinator, pull_on_engines
from .codec import Changes, decode_apply, diff, dtype_size, encode, encodings, quantize_fp8
from .errors import *  # noqa: F401,F403 - the exception classes
from .errors import DeltasyncError, error_for_code
from .store import LocalCheckpoint, Publisher, prune, versions
from .stream import Group, ShardSpec, StreamReceiver, StreamSender, built_communicators
from .stream import (Fp8ShardQuantizer, fp8_shard_specs, quantize_fp8_shard,
                     shard_spec_from_dtensor)
from .torch_group import TorchGroup

__version__ = _deltasync.__version__


def built_with_cuda() -> bool:
    """True when this build has the CUDA data path (CUDA tensors accepted)."""
    return _deltasync.built_with_cuda()


__all__ = [
    "Agent",
    "Changes",
    "DeltasyncError",
    "Fp8ShardQuantizer",
    "Group",
    "LocalCheckpoint",
    "Prepared",
    "Publisher",
    "Raw",
    "ShardSpec",
    "StreamReceiver",
    "StreamSender",
    "SyncCoordinator",
    "TorchGroup",
    "built_communicators",
    "built_with_cuda",
    "decode_apply",
    "diff",
    "dtype_size",
    "encode",
    "encodings",
    "fp8_shard_specs",
    "error_for_code",
    "prepare",
    "prune",
    "pull_on_engines",
    "quantize_fp8",
    "quantize_fp8_shard",
    "shard_spec_from_dtensor",
    "versions",
] + [n for n in dir() if n.endswith("Error")]
