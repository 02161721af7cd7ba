"""How ``make test`` hands tests to its workers: each module whole to one worker, so its module-scoped fixtures (warm
ranks, a Ray cluster, a graded class) start once, as in a serial run; a test listed in :data:`RUN_APART` parameter by
parameter, wherever a worker is free.

A scheduler of our own, not ``--dist loadgroup``: pytest 9.2 reads a test's id from a field pytest-xdist 3.8's
``xdist_group`` does not rewrite, so the groups silently fell apart and each worker set up the same module fixtures
again (the forgery suite graded its 24 notebooks twice, 50 s each). Imports nothing heavy: ``tests/test_scheduling.py``
runs it in a pytest of its own.
"""

# Tests whose parameters may each run on whichever worker is free, beside the rest of their module: shares of a long
# test (the generated labs are graded in two shares, the reference seeds lab by lab).
RUN_APART = ("tests/test_notebooks.py::test_generated_labs_grade_zero_and_run_to_the_end",
             "tests/grading/test_reference_seeds.py::"
             "test_each_reference_passes_under_another_seed_and_its_cases_cover_its_edges")


def scope_of(nodeid: str) -> str:
    """The unit ``make test`` hands a worker a test in: its module, or the test itself when it is in RUN_APART."""
    return nodeid if nodeid.split("[", 1)[0] in RUN_APART else nodeid.split("::", 1)[0]


def make_scheduler(config, log):
    """pytest-xdist's load-scope scheduling, with our scopes (``pytest_xdist_make_scheduler`` returns it)."""
    from xdist.scheduler import LoadScopeScheduling  # noqa: PLC0415  only a run with workers has a scheduler

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return scope_of(nodeid)

    return ModuleScheduling(config, log)
