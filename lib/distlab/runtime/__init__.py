"""The process runtime: start real torch.distributed ranks from a notebook cell and account for them.

Everything a lab's topic code builds on, and nothing of the topics: this package imports nothing of
distlab outside it (``tests/test_layout.py`` enforces it), so the engine can be read, tested and
changed without the exercises.

- ``launch``: :func:`launch`, :class:`Ranks`, argument checks, :class:`Run` — the public entry points
- ``group``: the rank group behind them: the forkserver, starting ranks, sending jobs, collecting results,
  the watchdog, closing
- ``diagnose``: root cause and report text, as pure functions over a snapshot of the ranks' states
- ``errors``: what a launch raises (:class:`LaunchError` and its kinds)
- ``interrupts``: the notebook's stop button stops a launch once, and cleanup always completes
- ``frames``: the one rule for which stack frames are the library's and which are the user's
- ``rank``: what runs inside each rank process (set-up, the job loop, :func:`device`)
- ``comm``: the counting wrapper around torch.distributed (bytes, calls, ledgers, the watchdog's status),
  and ``snapshot``/``since`` to read what a piece of code sent
- ``subgroups``: process groups over some of the ranks, made once per default group so warm ranks reuse them
- ``timeline``: spans on one clock across ranks, and their Gantt chart
- ``trace``: a run as a Trace Event Format file (Perfetto, chrome://tracing), and the numbers read off one
  (compute, communication, the share hidden, idle, the bubble)
- ``payload``: how jobs and results travel (cloudpickle, with code objects kept whole)
- ``reaper``: the process that ends the ranks if the launcher dies
- ``kernels``: the Jupyter kernels notebooks run in, forked warm from one factory, and the client that drives them
- ``output``: rank output a person can read (identical lines said once, rank order; HTML in a notebook), and
  who is watching (a notebook, a terminal, or nobody: nbval, CI, the grader)
- ``progress``: live progress bars for whoever watches, silent where nobody does; a loop inside ranks reports
  to the launcher, which draws it
- ``magic`` and ``console``: ``%load_ext distlab`` and the ``%%ranks`` cell magic (the notebook side), and the
  namespace each warm rank keeps between cells (the rank side)
"""
