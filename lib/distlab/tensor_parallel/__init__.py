"""Tensor and sequence parallelism, Megatron-LM style, built from the lab's dense GPT (lab 05).

* :mod:`~distlab.tensor_parallel.communication` — the autograd functions at the edges of a
  TP region (``f``/``g``, sequence all-gather/reduce-scatter) and the TP process groups;
* :mod:`~distlab.tensor_parallel.layers` — column/row-parallel linears, the Megatron MLP,
  head-parallel attention, vocabulary-parallel embedding and cross-entropy;
* :mod:`~distlab.tensor_parallel.gpt` — :class:`TensorParallelGPT`, sharding rules, size checks;
* :mod:`~distlab.tensor_parallel.theory` — collectives, activation bytes and link times, as formulas;
* :mod:`~distlab.tensor_parallel.dtensor` — the same layers made by PyTorch's ``parallelize_module``;
* :mod:`~distlab.tensor_parallel.workers` — functions that run on ranks, and :func:`train` for torchrun::

      torchrun --nproc-per-node=4 -m distlab.torchrun distlab.tensor_parallel:train steps=20
"""

from distlab.tensor_parallel.communication import *  # noqa: F401,F403
from distlab.tensor_parallel.gpt import *  # noqa: F401,F403
from distlab.tensor_parallel.layers import *  # noqa: F401,F403
from distlab.tensor_parallel.theory import *  # noqa: F401,F403
from distlab.tensor_parallel.workers import *  # noqa: F401,F403
