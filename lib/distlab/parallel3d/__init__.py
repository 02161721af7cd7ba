"""3D parallelism: a DP × PP × TP grid of real ranks, its training worker, and the layout planner.

- ``grid``: :class:`Grid` (which rank sits where, which groups it joins) and the 3D training worker
  (``python -m distlab.torchrun distlab.parallel3d.grid:train``)
- ``planner``: memory, step time and MFU of a layout from the library's formulas; ranks every layout
"""
