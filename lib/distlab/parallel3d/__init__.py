"""3D parallelism: a DP × PP × TP grid of real ranks, its training worker, and the layout planner.

- ``grid``: :class:`Grid` (which rank sits where, which groups it joins) and the 3D training worker
  (``python -m distlab.torchrun distlab.parallel3d.grid:train``)
- ``planner``: memory, step time and MFU of a layout from the library's formulas; ranks every layout
- ``calibration``: this machine measured as the planner should see it (``calibrate``, cached per machine and world
  size); with it the planner prices a layout from measured costs instead of an assumed matmul efficiency
"""
