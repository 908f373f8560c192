"""Tensors in, borrowed: numpy arrays and torch tensors as the core's TensorArg.

Nothing is copied. The caller's object must stay alive while the core uses
its memory; every public call keeps its arguments referenced until it
returns, and a receiver keeps its registered destinations.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterable, Mapping
from typing import Any

from . import _deltasync
from .errors import InvalidArgumentError, UnsupportedError

try:  # torch is optional: numpy arrays work without it
    import torch
except ImportError:  # pragma: no cover - exercised where torch is absent
    torch = None

import numpy as np

_TORCH_DTYPES: dict[Any, str] = {}
if torch is not None:
    _TORCH_DTYPES = {
        torch.bool: "BOOL",
        torch.uint8: "U8",
        torch.int8: "I8",
        torch.int16: "I16",
        torch.float16: "F16",
        torch.bfloat16: "BF16",
        torch.int32: "I32",
        torch.float32: "F32",
        torch.int64: "I64",
        torch.float64: "F64",
    }
    # Where this torch has them: the FP8 types from torch 2.1, the ue8m0
    # scale type (float8_e8m0fnu) from 2.7, the wide unsigned ones from 2.3.
    # Without them, such data is held as uint8 (or uint16, ...) tensors and
    # passed as ``Raw(t, "F8_E4M3")``.
    for _name, _code in (
        ("float8_e4m3fn", "F8_E4M3"),
        ("float8_e5m2", "F8_E5M2"),
        ("float8_e8m0fnu", "F8_E8M0"),
        ("uint16", "U16"),
        ("uint32", "U32"),
        ("uint64", "U64"),
    ):
        if hasattr(torch, _name):
            _TORCH_DTYPES[getattr(torch, _name)] = _code

if torch is not None:
    _deltasync.set_torch_types(torch.Tensor, torch.strided, dict(_TORCH_DTYPES))

_NUMPY_DTYPES = {
    np.dtype(np.bool_): "BOOL",
    np.dtype(np.uint8): "U8",
    np.dtype(np.int8): "I8",
    np.dtype(np.int16): "I16",
    np.dtype(np.uint16): "U16",
    np.dtype(np.float16): "F16",
    np.dtype(np.int32): "I32",
    np.dtype(np.uint32): "U32",
    np.dtype(np.float32): "F32",
    np.dtype(np.int64): "I64",
    np.dtype(np.uint64): "U64",
    np.dtype(np.float64): "F64",
}


class Raw:
    """Memory of a dtype the array's library has no type for:
    ``Raw(uint16_array, "BF16")``, or ``Raw(uint8_tensor, "F8_E4M3")`` on a
    torch without float8 types.

    The array's (a numpy array's or a torch tensor's) bytes are taken as
    ``dtype`` elements; the shape is the array's (its item size must be the
    dtype's).
    """

    def __init__(self, array: Any, dtype: str) -> None:
        if is_torch(array):
            itemsize, kind = array.element_size(), array.dtype
        elif isinstance(array, np.ndarray):
            itemsize, kind = array.dtype.itemsize, array.dtype
        else:
            raise InvalidArgumentError(
                f"Raw: expected a numpy array or a torch tensor, got {type(array).__name__}"
            )
        size = _deltasync.dtype_size(dtype)
        if itemsize != size:
            raise InvalidArgumentError(
                f"Raw: a {kind} array has {itemsize}-byte items, {dtype} has {size}"
            )
        self.array = array
        self.dtype = dtype


def is_torch(obj: Any) -> bool:
    return torch is not None and isinstance(obj, torch.Tensor)


def dtype_name(obj: Any) -> str:
    """The safetensors dtype name of a tensor or array ("BF16", "F32", ...)."""
    if isinstance(obj, Raw):
        return obj.dtype
    if is_torch(obj):
        code = _TORCH_DTYPES.get(obj.dtype)
        if code is None:
            raise UnsupportedError(f"dtype {obj.dtype} has no deltasync counterpart")
        return code
    if isinstance(obj, np.ndarray):
        code = _NUMPY_DTYPES.get(obj.dtype)
        if code is None:
            raise UnsupportedError(f"dtype {obj.dtype} has no deltasync counterpart")
        return code
    raise InvalidArgumentError(f"expected a torch tensor or numpy array, got {type(obj).__name__}")


def _over_immutable_bytes(t: Any) -> bool:
    """Whether a CPU tensor's memory is the contents of a Python ``bytes``
    object (``torch.frombuffer(b"...")``: torch cannot mark such a tensor
    read-only, and writing through it would change an immutable object).

    CPython keeps a bytes object's contents at a fixed offset after its
    header, whose type field then holds the address of ``bytes`` itself;
    the header is read only when it lies on the same memory page as the
    contents, so the check never touches memory that may be unmapped. A
    tensor at an offset inside the bytes object is not recognised."""
    ptr = t.data_ptr()
    header = bytes.__basicsize__ - 1  # where ob_sval starts
    if ptr == 0 or ptr % 4096 < header:
        return False
    type_field = ctypes.c_size_t.from_address(ptr - header + ctypes.sizeof(ctypes.c_ssize_t))
    return type_field.value == id(bytes)


def memory_of(t: Any) -> tuple[int, int]:
    """(data pointer, bytes its storage holds from there on) of a torch
    tensor: what a receiver checks before each sync writes into it."""
    storage = t.untyped_storage() if hasattr(t, "untyped_storage") else t.storage()
    owned = storage.nbytes() - t.storage_offset() * t.element_size()
    return t.data_ptr(), max(0, owned)


def arg(name: str, obj: Any, *, writable: bool = False) -> _deltasync.TensorArg:
    """A TensorArg for ``obj``, named ``name`` in every error.

    Refuses (InvalidArgumentError naming the tensor) what the core cannot
    read in place: a non-contiguous or sparse tensor, an array that does not
    own plain memory, a read-only array or a tensor over an immutable
    ``bytes`` object where ``writable``.
    """
    if isinstance(obj, Raw):
        array, code = obj.array, obj.dtype
    else:
        array, code = obj, None
    try:
        code = code or dtype_name(array)
    except (InvalidArgumentError, UnsupportedError) as e:
        raise type(e)(f"tensor '{name}': {e}") from None
    if is_torch(array):
        t = array
        if t.layout != torch.strided:
            raise InvalidArgumentError(f"tensor '{name}': a {t.layout} tensor (need a dense one)")
        if not t.is_contiguous():
            if writable:
                # .contiguous() would be a copy: writes into it would never
                # reach the tensor.
                raise InvalidArgumentError(
                    f"tensor '{name}': not contiguous (strides {tuple(t.stride())}), and it is "
                    "written in place: register the contiguous tensor it is a view of (with "
                    "runs for the part it holds), not a copy"
                )
            raise InvalidArgumentError(
                f"tensor '{name}': not contiguous (strides {tuple(t.stride())}); "
                "pass .contiguous()"
            )
        device, stream = -1, 0
        kind = t.device.type
        if kind == "cuda":
            device = t.device.index if t.device.index is not None else torch.cuda.current_device()
            stream = torch.cuda.current_stream(t.device).cuda_stream
        elif kind != "cpu":
            raise UnsupportedError(f"tensor '{name}': on {t.device} (deltasync takes cpu and cuda)")
        if writable and kind == "cpu" and t.numel() > 0 and _over_immutable_bytes(t):
            raise InvalidArgumentError(
                f"tensor '{name}': its memory is an immutable bytes object "
                "(torch.frombuffer over bytes), but it is written: use a bytearray or a copy"
            )
        return _deltasync.TensorArg(name, code, list(t.shape), t.data_ptr(),
                                    t.numel() * t.element_size(), device, stream, True)
    if isinstance(array, np.ndarray):
        if not array.flags.c_contiguous:
            raise InvalidArgumentError(
                f"tensor '{name}': not C-contiguous; pass np.ascontiguousarray(...)"
            )
        if writable and not array.flags.writeable:
            raise InvalidArgumentError(f"tensor '{name}': read-only array, but it is written")
        return _deltasync.TensorArg(name, code, list(array.shape),
                                    array.ctypes.data if array.nbytes else 0, array.nbytes, -1, 0,
                                    bool(array.flags.writeable))
    raise InvalidArgumentError(
        f"tensor '{name}': expected a torch tensor or numpy array, got {type(array).__name__}"
    )


def named(tensors: Any) -> list[tuple[str, Any]]:
    """(name, tensor) pairs from a mapping (a state dict) or an iterable of pairs
    (``model.named_parameters()``). Tensors that require grad are detached
    (the same memory). Duplicate names are refused."""
    if isinstance(tensors, Mapping):
        items = list(tensors.items())
    elif isinstance(tensors, Iterable):
        items = list(tensors)
    else:
        raise InvalidArgumentError(
            f"expected a mapping of names to tensors or (name, tensor) pairs, "
            f"got {type(tensors).__name__}"
        )
    out = []
    seen = set()
    for item in items:
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
            raise InvalidArgumentError(f"expected (name, tensor) pairs, got {item!r:.80}")
        name, t = item
        if name in seen:
            raise InvalidArgumentError(f"tensor '{name}': named twice")
        seen.add(name)
        if is_torch(t) and t.requires_grad:
            t = t.detach()
        out.append((name, t))
    return out


def host(obj: Any) -> Any:
    """``obj`` in host memory: a CUDA tensor is copied (for the disk transport)."""
    if is_torch(obj) and obj.device.type != "cpu":
        return obj.detach().to("cpu")
    if isinstance(obj, Raw) and is_torch(obj.array) and obj.array.device.type != "cpu":
        return Raw(obj.array.detach().to("cpu"), obj.dtype)
    return obj


def args(pairs: list[tuple[str, Any]], *, to_host: bool = False) -> tuple[Any, list]:
    """TensorArgs for (name, tensor) pairs, and the objects to keep alive.
    Dense host torch tensors are read by the extension in one call; every
    other object goes through :func:`arg`."""
    if to_host:
        pairs = [(name, host(t)) for name, t in pairs]
    return _deltasync.args_from_pairs(pairs, arg), pairs


class Prepared:
    """Tensors read once, for a call made on the same tensors again and again.

    ``prepare(model.named_parameters())`` reads each tensor's dtype, shape,
    device and memory once. A sender's :meth:`~deltasync.StreamSender.sync`,
    a publisher's :meth:`~deltasync.Publisher.publish` and a coordinator's
    :meth:`~deltasync.SyncCoordinator.sync` take the result wherever they
    take tensors, and then skip that reading, which on a model of hundreds
    of tensors is about half of the binding's cost per call.

    The promise: the tensors stay the same objects over the same memory
    (an optimizer's in-place step, ``copy_`` and ``param.data.add_`` keep
    it; ``param.data = ...``, ``model.to(...)`` or ``load_state_dict(...,
    assign=True)`` break it). Every use checks each torch tensor's data
    pointer and size and raises FailedPreconditionError naming the first
    one that moved: prepare again then. CUDA tensors are used on the
    caller's current stream of each use, as unprepared ones are.
    """

    __slots__ = ("_pairs", "_sources", "_targs", "_devices")

    def __init__(self, tensors: Any) -> None:
        if isinstance(tensors, Prepared):
            tensors = tensors._sources
        if isinstance(tensors, Mapping):
            tensors = list(tensors.items())
        elif isinstance(tensors, Iterable):
            tensors = list(tensors)
        self._pairs = named(tensors)
        # The objects as given: a Parameter whose .data is replaced keeps
        # its identity, while the detached view in _pairs would not see it.
        self._sources = tensors
        self._targs = _deltasync.args_from_pairs(self._pairs, arg)
        self._devices = sorted({t.device for t in self._targs if t.device >= 0})

    def __len__(self) -> int:
        return len(self._pairs)

    def names(self) -> list[str]:
        """The tensors' names, in order."""
        return [name for name, _ in self._pairs]

    def _use(self, to_host: bool) -> tuple[Any, list]:
        if to_host and self._devices:
            # The disk transport copies device tensors to host on each use.
            return args(self._pairs, to_host=True)
        streams = {d: torch.cuda.current_stream(d).cuda_stream for d in self._devices}
        _deltasync.check_prepared(self._targs, self._sources, streams)
        return self._targs, self._pairs


def prepare(tensors: Any) -> Prepared:
    """The tensors (a state dict or (name, tensor) pairs) read once, for
    calls that take them again; see :class:`Prepared`."""
    return Prepared(tensors)


def tensor_args(tensors: Any, *, to_host: bool = False) -> tuple[Any, list]:
    """TensorArgs for what a public call was given (tensors, pairs or a
    :class:`Prepared`), and the objects to keep alive while it runs."""
    if isinstance(tensors, Prepared):
        return tensors._use(to_host)
    return args(named(tensors), to_host=to_host)
