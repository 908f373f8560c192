"""The disk transport: publish versions from in-memory tensors, pull them into a
host-local checkpoint.

A store is a directory of numbered versions (full checkpoints and deltas in
the vime/slime format, docs/format.md). The trainer publishes into it; each
engine host keeps a local safetensors checkpoint that :class:`LocalCheckpoint`
brings to any version, crash-safely, verifying every tensor's checksum.
"""

from __future__ import annotations

import os
from typing import Any, Optional

from . import _deltasync
from ._closing import Closing
from ._tensors import args, named, tensor_args
from .errors import InvalidArgumentError


def base_args(who: str, base: Any, base_path: Any) -> tuple:
    """A publisher's version 0, from tensors or a checkpoint path (exactly
    one): the tensor arguments, the path ("" for tensors), what to keep alive."""
    if (base is None) == (base_path is None):
        raise InvalidArgumentError(f"{who}: give exactly one of base (tensors) and base_path")
    if base is None:
        return [], os.fspath(base_path), []
    targs, keep = args(named(base), to_host=True)
    return targs, "", keep


class Publisher(Closing):
    """Publishes versions of a model into ``store`` from its in-memory tensors.

    ``base`` is version 0: the tensors (a state dict or ``named_parameters()``;
    CUDA tensors are copied to host) or, with ``base_path``, a safetensors
    checkpoint (file or directory) on disk. The publisher keeps a snapshot of
    the last published weights and writes each new version as a delta
    against it (a full checkpoint every ``full_every`` versions, if set).

    >>> pub = Publisher("/shared/store", model.state_dict())
    >>> pub.publish(model.state_dict())["version"]
    1
    """

    def __init__(
        self,
        store: str | os.PathLike,
        base: Any = None,
        *,
        base_path: Optional[str | os.PathLike] = None,
        encoding: str = "sparse",
        full_every: int = 0,
        checksum: str = "xxh3-128",
        zstd_level: int = 1,
    ) -> None:
        targs, path, keep = base_args("Publisher", base, base_path)
        self._impl = _deltasync.Publisher(
            os.fspath(store), targs, path, encoding, full_every, checksum, zstd_level
        )
        del keep

    def publish(self, weights: Any, *, full: bool = False) -> dict:
        """Publishes ``weights`` (same names, dtypes and shapes as the base;
        tensors, or prepared once with :func:`~deltasync.prepare`) as the
        next version; returns what was written: ``version``, ``is_delta``,
        ``tensors_changed``, ``changed_elements``, ``bytes_written``, ``seconds``.
        Nothing is published when it raises."""
        targs, keep = tensor_args(weights, to_host=True)
        result = self._live().publish(targs, full)
        del keep
        return result

    def publish_checkpoint(self, path: str | os.PathLike, *, full: bool = False) -> dict:
        """Publishes the safetensors checkpoint at ``path`` as the next version."""
        return self._live().publish_checkpoint(os.fspath(path), full)

    @property
    def latest_version(self) -> int:
        """The last version published (0: only the base)."""
        return self._live().latest_version


class LocalCheckpoint(Closing):
    """A host-local safetensors checkpoint kept at a version of ``store``.

    ``local`` is the directory the engine loads from; ``base`` is the store's
    version 0 checkpoint (a path). :meth:`pull` applies deltas in place
    (crash-safe: an interrupted pull is recovered at the next open) and
    verifies each tensor against the version's checksums.
    """

    def __init__(
        self,
        local: str | os.PathLike,
        store: str | os.PathLike,
        base: str | os.PathLike = "",
        *,
        replace_unknown: bool = False,
        durable: bool = False,
    ) -> None:
        self._impl = _deltasync.LocalCheckpoint(
            os.fspath(local), os.fspath(store), os.fspath(base), replace_unknown, durable
        )

    def pull(self, version: Optional[int] = None) -> dict:
        """Brings the checkpoint to ``version`` (the latest when None); returns
        ``version``, ``applied``, ``versions_applied``, ``bytes_read``, ..."""
        return self._live().pull(version)

    def current_version(self) -> Optional[int]:
        """The version the checkpoint holds, None before the first pull."""
        return self._live().current_version()

    def verify(self) -> None:
        """Re-reads every tensor and checks it; raises CorruptionError if not."""
        self._live().verify()

    @property
    def local(self) -> str:
        """The local checkpoint's directory."""
        return self._live().local


def versions(store: str | os.PathLike) -> list[dict]:
    """The store's versions, oldest first: ``version``, ``is_delta``,
    ``base_version``, ``encoding``, ``tensors``, ``bytes``, ``dir``."""
    return _deltasync.list_versions(os.fspath(store))


def prune(store: str | os.PathLike, keep: int) -> list[int]:
    """Removes all but the newest ``keep`` versions that are still reachable;
    returns the versions removed."""
    return _deltasync.prune(os.fspath(store), keep)
