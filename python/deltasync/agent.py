"""The disk transport across hosts: the HTTP agent each engine host runs, and
the trainer's side that publishes, then has every engine pull.

An agent owns one host's :class:`~deltasync.LocalCheckpoint`; on
``POST /v1/pull`` it pulls, verifies, and tells the engine to reload (a
Python callable, an HTTP endpoint, or a command). The trainer's
:class:`SyncCoordinator` publishes a version and asks every agent for it.
The HTTP API is in docs/format.md ("Agent HTTP API").
"""

from __future__ import annotations

import os
from typing import Any, Callable, Optional, Sequence

from . import _deltasync
from ._closing import Closing
from ._tensors import tensor_args
from .errors import error_for_code
from .store import base_args


class EnginesFailedError(Exception):
    """Mixin of the error raised when some engines did not reach the version;
    the exception's ``report`` holds every engine's outcome."""


def _raise_on_failure(report: dict) -> dict:
    err = report.pop("error")
    report["ok"] = err is None
    if err is not None:
        code, message = err
        cls = error_for_code(code)
        e = type(cls.__name__, (cls, EnginesFailedError), {})(message)
        e.report = report
        raise e
    return report


class Agent(Closing):
    """Serves the agent HTTP API for the checkpoint at ``local`` (kept at a
    version of ``store``, whose version 0 is ``base``), on ``host:port``
    (port 0: an ephemeral one, see :attr:`port`). After each pull that
    changes the version the engine reloads through ``reload(model_path,
    version)``, ``reload_url`` (an engine's HTTP endpoint) or
    ``reload_command``; with none of them the pull only updates the files.
    A ``token`` is required as ``Authorization: Bearer`` when set; a host
    other than loopback needs one."""

    def __init__(
        self,
        local: str | os.PathLike,
        store: str | os.PathLike,
        base: str | os.PathLike = "",
        *,
        reload: Optional[Callable[[str, int], Any]] = None,
        reload_url: str = "",
        reload_command: str = "",
        host: str = "127.0.0.1",
        port: int = 0,
        token: str = "",
        verify_after_pull: bool = False,
    ) -> None:
        self._impl = _deltasync.Agent(
            os.fspath(local), os.fspath(store), os.fspath(base), reload, reload_url,
            reload_command, host, port, token, verify_after_pull,
        )

    @property
    def port(self) -> int:
        """The port the agent listens on."""
        return self._live().port

    @property
    def url(self) -> str:
        """``http://127.0.0.1:<port>``: the agent's address on this host."""
        return f"http://127.0.0.1:{self.port}"


def pull_on_engines(
    engines: Sequence[str],
    version: Optional[int] = None,
    *,
    token: str = "",
    connect_timeout_s: float = 10,
    timeout_s: float = 600,
    retries: int = 3,
    check: bool = True,
) -> dict:
    """Asks every agent in ``engines`` (``http://host:port``) to pull
    ``version`` (the latest when None), all at once. Returns ``{"ok",
    "engines": [per-engine outcome]}``; with ``check`` a failure of any
    engine raises (the exception's ``report`` is that dict)."""
    report = _deltasync.pull_on_engines(
        list(engines), version, token, connect_timeout_s, timeout_s, retries
    )
    return _raise_on_failure(report) if check else _mark(report)


def _mark(report: dict) -> dict:
    report["ok"] = report.pop("error") is None
    return report


class SyncCoordinator(Closing):
    """The trainer's side of the disk transport across hosts: :meth:`sync`
    publishes the weights as the next version of ``store`` (as
    :class:`~deltasync.Publisher` does, from ``base`` tensors or
    ``base_path``) and has every engine's agent pull it."""

    def __init__(
        self,
        store: str | os.PathLike,
        engines: Sequence[str],
        base: Any = None,
        *,
        base_path: Optional[str | os.PathLike] = None,
        encoding: str = "sparse",
        full_every: int = 0,
        checksum: str = "xxh3-128",
        zstd_level: int = 1,
        token: str = "",
        connect_timeout_s: float = 10,
        timeout_s: float = 600,
        retries: int = 3,
    ) -> None:
        targs, path, keep = base_args("SyncCoordinator", base, base_path)
        self._impl = _deltasync.SyncCoordinator(
            os.fspath(store), targs, path, list(engines), encoding,
            full_every, checksum, zstd_level, token, connect_timeout_s, timeout_s, retries,
        )
        del keep

    def sync(self, weights: Any, *, full: bool = False, check: bool = True) -> dict:
        """Publishes ``weights`` (tensors, or prepared with :func:`~deltasync.prepare`
        once) and has every engine pull the new version.
        Returns ``version``, ``publish`` (as Publisher.publish), ``engines``,
        ``ok`` and the timings; with ``check`` a failed engine raises (its
        ``report`` attached). A failed publish raises and asks no engine."""
        targs, keep = tensor_args(weights, to_host=True)
        report = self._live().sync(targs, full)
        del keep
        return _raise_on_failure(report) if check else _mark(report)

    def pull_all(self, version: Optional[int] = None, *, check: bool = True) -> dict:
        """Has every engine pull ``version`` without publishing (0: the base)."""
        report = self._live().pull_all(version)
        return _raise_on_failure(report) if check else _mark(report)

    @property
    def latest_version(self) -> int:
        """The last version published (0: only the base)."""
        return self._live().latest_version
