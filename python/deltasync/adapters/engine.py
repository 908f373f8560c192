"""One engine worker's weights as deltasync updates them, shared by the
SGLang and vLLM adapters.

Tensors the dry run (:mod:`.weight_map`) mapped are written straight into
the model's parameters: each delta's changed elements are scattered into
their places, with no full-size tensor and no NaN sentinel (a true NaN is a
value like any other). Each tensor it could not map keeps a full host copy
(its *shadow*); a delta updates the shadow, and the shadow goes through the
model's stock ``load_weights``, which is what both engines do for every
tensor today. :attr:`EngineWeights.stats` counts both paths.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterable, Optional

import torch

from .._tensors import _TORCH_DTYPES, dtype_name
from ..errors import InvalidArgumentError, NotFoundError
from .weight_map import WeightMap, learn

log = logging.getLogger("deltasync.adapters")


def _code(dtype: Any) -> str:
    """A safetensors dtype name for a name or a torch dtype."""
    return dtype if isinstance(dtype, str) else dtype_name(torch.empty(0, dtype=dtype))


def torch_dtype(code: str) -> torch.dtype:
    """The torch dtype of a safetensors dtype name."""
    for t, c in _TORCH_DTYPES.items():
        if c == code:
            return t
    raise InvalidArgumentError(f"dtype {code} has no torch counterpart")


class EngineWeights:
    """The weights of ``model`` (one TP worker) for the checkpoint tensors
    ``checkpoint`` ((name, dtype, shape) triples)."""

    def __init__(
        self,
        model: torch.nn.Module,
        checkpoint: Iterable[tuple[str, Any, Any]],
        load_weights: Optional[Callable[[list], Any]] = None,
    ) -> None:
        self.model = model
        self.load_weights = load_weights or model.load_weights
        self.meta = {
            name: (_code(dtype), [int(x) for x in shape]) for name, dtype, shape in checkpoint
        }
        self.map: WeightMap = learn(model, [(n, d, s) for n, (d, s) in self.meta.items()],
                                    self.load_weights)
        self.shadows: dict[str, torch.Tensor] = {}
        self.stats = {"scattered_tensors": 0, "scattered_elements": 0, "stock_loads": 0}
        if self.map.unmapped:
            log.warning("deltasync: %s", self.map.report())

    @property
    def fallback(self) -> list[str]:
        """The tensors that take the stock load_weights path."""
        return sorted(self.map.unmapped)

    def _check_name(self, name: str) -> None:
        if name not in self.meta:
            raise NotFoundError(f"tensor '{name}': not a tensor of this model's checkpoint")

    def load_full(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Loads whole tensors through the stock path (the first sync, or a
        resync), keeping a shadow of each unmapped one."""
        for name, t in named_tensors:
            self._check_name(name)
            dtype, shape = self.meta[name]
            if list(t.shape) != shape:
                raise InvalidArgumentError(
                    f"tensor '{name}': shape {list(t.shape)}, the checkpoint's is {shape}"
                )
        with torch.no_grad():
            self.load_weights(list(named_tensors))
        for name, t in named_tensors:
            if name in self.map.unmapped:
                self.shadows[name] = t.detach().to("cpu", copy=True)
        self.stats["stock_loads"] += len(named_tensors)

    def check_delta(self, name: str, positions: torch.Tensor, values: torch.Tensor) -> None:
        """Refuses (naming the tensor) a delta that does not fit the checkpoint."""
        self._check_name(name)
        dtype, shape = self.meta[name]
        numel = 1
        for x in shape:
            numel *= x
        if positions.dtype != torch.int64 or positions.dim() != 1:
            raise InvalidArgumentError(f"tensor '{name}': positions must be a 1-D int64 tensor")
        if values.dim() != 1 or values.numel() != positions.numel():
            raise InvalidArgumentError(
                f"tensor '{name}': {positions.numel()} positions but {values.numel()} values"
            )
        if _code(values.dtype) != dtype:
            raise InvalidArgumentError(
                f"tensor '{name}': values of {values.dtype}, the checkpoint's is {dtype}"
            )
        if positions.numel() and (int(positions.min()) < 0 or int(positions.max()) >= numel):
            raise InvalidArgumentError(
                f"tensor '{name}': a position outside its {numel} elements"
            )
        if name in self.map.unmapped and name not in self.shadows:
            raise InvalidArgumentError(
                f"tensor '{name}': takes the stock path and has no full copy yet "
                "(send it whole first)"
            )

    def apply_delta(self, name: str, positions: torch.Tensor, values: torch.Tensor) -> None:
        """Writes the changed elements of one tensor (check_delta first)."""
        placement = self.map.placements.get(name)
        if placement is None:
            shadow = self.shadows[name]
            shadow.view(-1)[positions.to(shadow.device)] = values.to(shadow.device)
            with torch.no_grad():
                self.load_weights([(name, shadow.to(self._device()))])
            self.stats["stock_loads"] += 1
            return
        param = placement.param
        pos = positions.to(param.device)
        held, dest = placement.destinations(pos)
        with torch.no_grad():
            flat = param.data.view(-1)
            flat[dest] = values.to(param.device)[held]
        self.stats["scattered_tensors"] += 1
        self.stats["scattered_elements"] += int(dest.numel())

    def _device(self) -> torch.device:
        for p in self.model.parameters():
            return p.device
        return torch.device("cpu")

    def register(self, receiver: Any) -> None:
        """Registers every checkpoint tensor with a StreamReceiver: mapped ones
        into their parameters (with their runs), the others into shadows
        (call :meth:`reload_shadows` after each receive)."""
        for name, (dtype, shape) in self.meta.items():
            placement = self.map.placements.get(name)
            if placement is not None:
                try:
                    receiver.register(name, placement.param.data, runs=placement.run_tuples(),
                                      shape=shape, dtype=placement.dtype)
                    continue
                except InvalidArgumentError as e:
                    # The stream cannot hold this layout: the stock path.
                    del self.map.placements[name]
                    self.map.unmapped[name] = f"the stream refuses its layout ({e})"
            shadow = self.shadows.get(name)
            if shadow is None:
                shadow = torch.zeros(shape, dtype=torch_dtype(dtype))
                self.shadows[name] = shadow
            receiver.register(name, shadow)

    def reload_shadows(self) -> None:
        """Loads every shadow through the stock load_weights (after a receive)."""
        if not self.shadows:
            return
        dev = self._device()
        with torch.no_grad():
            self.load_weights([(n, s.to(dev)) for n, s in self.shadows.items()])
        self.stats["stock_loads"] += len(self.shadows)
