"""Exceptions raised by deltasync: one class per status code of the C++ core.

Every class derives from :class:`DeltasyncError` and, where one fits, from the
built-in exception a Python caller already catches (``ValueError`` for bad
arguments, ``FileNotFoundError`` for a missing file or version, ``OSError``
for the operating system's refusals, ``TimeoutError`` for a silent peer).
The message is the C++ core's, which names the tensor, file or peer.
"""

from __future__ import annotations


class DeltasyncError(Exception):
    """Base of every deltasync error. ``code`` is the core's status code."""

    code: int = -1


class InvalidArgumentError(DeltasyncError, ValueError):
    """The caller passed something unusable (dtype, shape, name, option)."""

    code = 1


class NotFoundError(DeltasyncError, LookupError):
    """A named file, tensor or version does not exist."""

    code = 2


class CorruptionError(DeltasyncError):
    """Stored or received bytes violate their format or checksum."""

    code = 3


class IoError(DeltasyncError, OSError):
    """The operating system refused an operation."""

    code = 4


class OutOfRangeError(DeltasyncError, IndexError):
    """An index, offset or size past a limit."""

    code = 5


class UnsupportedError(DeltasyncError, NotImplementedError):
    """Well-formed but not handled (an unknown dtype, no CUDA in this build)."""

    code = 6


class AlreadyExistsError(DeltasyncError, FileExistsError):
    """Refusing to overwrite."""

    code = 7


class FailedPreconditionError(DeltasyncError, RuntimeError):
    """The system is not in a state that allows the call (a closed object)."""

    code = 8


class AbortedError(DeltasyncError, RuntimeError):
    """Cancelled or interrupted."""

    code = 9


class InternalError(DeltasyncError, RuntimeError):
    """A broken invariant: a bug in deltasync, never bad input."""

    code = 10


class DeadlineExceededError(DeltasyncError, TimeoutError):
    """A peer did not answer within the operation's timeout."""

    code = 11


class UnavailableError(DeltasyncError, ConnectionError):
    """A peer or service cannot be reached (connection lost)."""

    code = 12


_BY_CODE = {
    cls.code: cls
    for cls in (
        InvalidArgumentError,
        NotFoundError,
        CorruptionError,
        IoError,
        OutOfRangeError,
        UnsupportedError,
        AlreadyExistsError,
        FailedPreconditionError,
        AbortedError,
        InternalError,
        DeadlineExceededError,
        UnavailableError,
    )
}


def error_for_code(code: int) -> type:
    """The exception class for a status code (DeltasyncError for an unknown one)."""
    return _BY_CODE.get(code, DeltasyncError)


__all__ = [cls.__name__ for cls in _BY_CODE.values()] + ["DeltasyncError", "error_for_code"]
