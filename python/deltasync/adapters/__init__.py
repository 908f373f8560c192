"""Engine adapters: rollout engines take deltasync's deltas in place.

* :mod:`deltasync.adapters.sglang`: SGLang's ``--custom-weight-loader`` hook
  and its trainer-side pusher;
* :mod:`deltasync.adapters.vllm`: a vLLM ``WeightTransferEngine`` over the
  stream and its trainer-side counterpart;
* :mod:`deltasync.adapters.verl`: a verl checkpoint engine (``"deltasync"``)
  over the stream, from verl's trainer ranks to its rollout workers;
* :mod:`deltasync.adapters.weight_map`: the dry run of a model's own
  ``load_weights`` that both use to write each tensor's elements straight
  into the parameters (TP slices, fused q/k/v and gate/up, stacked experts).
"""

from .engine import EngineWeights
from .weight_map import Placement, WeightMap, learn

__all__ = ["EngineWeights", "Placement", "WeightMap", "learn"]
