"""The life cycle every deltasync object shares: close(), a context manager,
and a clear error when a closed object is used again."""

from __future__ import annotations

from typing import Any

from .errors import FailedPreconditionError


class Closing:
    """Base of the objects that hold a core object in ``self._impl``."""

    _impl: Any = None

    def _live(self) -> Any:
        if self._impl is None:
            raise FailedPreconditionError(f"{type(self).__name__} is closed")
        return self._impl

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran."""
        return self._impl is None

    def close(self) -> None:
        """Releases the core object (files, connections, snapshot memory).
        Idempotent."""
        impl, self._impl = self._impl, None
        if impl is not None:
            impl.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
