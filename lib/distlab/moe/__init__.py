"""Mixture of Experts: routing, capacity, load balancing, and expert parallelism with all-to-all.

One package, four modules in the order the lab builds them: :mod:`~distlab.moe.routing`,
:mod:`~distlab.moe.layer`, :mod:`~distlab.moe.training`, :mod:`~distlab.moe.scale`; every
public name is importable from ``distlab.moe``.

An MoE layer replaces a transformer block's MLP with ``E`` expert MLPs and a router.
Each token goes to its top-``k`` experts, so the layer holds ``E`` MLPs' parameters but a
token pays for ``k``. The pieces, in the order the lab builds them:

* :func:`route` — ``logits = x·Wᵀ``, softmax, top-k; the gates are the chosen
  probabilities, renormalised over the k choices when k > 1 (Mixtral), the raw
  probability when k = 1 (Switch: renormalising one gate would give 1 and cut the
  router off from the loss). A per-expert ``bias`` changes which experts are chosen,
  never the gates (DeepSeek-V3's auxiliary-loss-free balancing).
* :func:`expert_capacity` and :func:`assign_capacity` — an expert takes at most
  ``⌈capacity_factor · tokens · k / E⌉`` assignments; the rest are dropped (the token
  keeps only its residual). Priority is fixed: every token's first choice before any
  second choice, and in token order within a choice, so a distributed layer drops
  exactly the assignments a single device drops.
* :func:`load_balancing_loss` (Switch Transformer) and :func:`router_z_loss` (ST-MoE);
  :func:`update_expert_bias` (DeepSeek-V3).
* :func:`moe_forward` — the whole layer on one device, with an optional shared expert
  that every token uses. It is the reference the expert-parallel layer is checked against.
* :func:`expert_parallel_forward` — experts spread over ranks: exchange how many tokens
  go to each expert (an all-to-all of counts), send the tokens with
  ``all_to_all_single`` and uneven splits (:func:`all_to_all`, differentiable), run the
  local experts, send the results back with a second all-to-all, weight them by the gates.
  Capacity is counted per rank on its own tokens before anything is sent (as GShard's
  groups and Megatron-LM do), so rank r's output equals :func:`moe_forward` on rank r's tokens.

:class:`MoEGPT` is the lab's GPT with every MLP replaced by a :class:`MoELayer`;
:func:`train_moe` trains it expert-parallel on every rank (inside ``distlab.launch`` or
under torchrun) and :func:`train_moe_reference` is the same training in one process.
:func:`all_to_all_bytes` and :class:`MoEShape` (with :data:`DEEPSEEK_V3`) are the cost
model the lab compares its counted bytes with and uses at real scale.
"""

from distlab.moe.layer import *  # noqa: F401,F403
from distlab.moe.layer import __all__ as _layer
from distlab.moe.routing import *  # noqa: F401,F403
from distlab.moe.routing import __all__ as _routing
from distlab.moe.scale import *  # noqa: F401,F403
from distlab.moe.scale import __all__ as _scale
from distlab.moe.training import *  # noqa: F401,F403
from distlab.moe.training import __all__ as _training

__all__ = [*_routing, *_layer, *_training, *_scale]
