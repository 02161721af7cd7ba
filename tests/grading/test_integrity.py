"""A submission that hands in, or calls, the library's own answer to its exercise scores 0 and is told why; the
student's own code, even under the reference's name, is not flagged."""

from pathlib import Path

import pytest

import distlab
import distlab.collectives as coll
import distlab.zero.zero2
from distlab import grading
from distlab.collectives import ring_all_reduce
from distlab.grading.integrity import reference_use
from distlab.grading.registry import Exercise

pytestmark = pytest.mark.pass_through  # the detection the other tests switch off (tests/conftest.py)

REFERENCES = ("distlab.collectives.ring_all_reduce",)


def through_a_global(tensor):
    return ring_all_reduce(tensor)


def through_the_package(tensor):
    return distlab.collectives.ring_all_reduce(tensor)


def through_an_alias(tensor):
    return coll.ring_all_reduce(tensor)


def through_a_helper_of_the_notebook(tensor):
    return through_a_global(tensor)


def through_a_lambda(tensor):
    return (lambda t: coll.ring_all_reduce(t))(tensor)


def with_a_closure():
    answer = ring_all_reduce

    def wrapped(tensor):
        return answer(tensor)

    return wrapped


class ThroughAMethod:
    def __call__(self, tensor):
        return coll.ring_all_reduce(tensor)


def my_own(tensor):
    """The student's own ring (here only its shape: sends and receives, no library answer)."""
    return coll.split_chunks(tensor.flatten(), 2)


def test_the_reference_and_every_way_of_calling_it_are_recognised():
    assert reference_use((ring_all_reduce,), REFERENCES) == (
        "this is distlab.collectives.ring_all_reduce, the library's own answer")
    for wrapper in (through_a_global, through_the_package, through_an_alias, through_a_helper_of_the_notebook,
                    through_a_lambda, with_a_closure(), ThroughAMethod):
        why = reference_use((wrapper,), REFERENCES)
        assert why and why.endswith("calls distlab.collectives.ring_all_reduce, the library's own answer"), wrapper


def test_a_subclass_of_a_reference_class_is_recognised_and_a_library_base_is_scaffolding():
    from distlab.zero.optim import ShardedOptimizer

    class Mine(ShardedOptimizer):
        pass

    assert reference_use((Mine,), ("distlab.zero.optim.ShardedOptimizer",)) == (
        "test_a_subclass_of_a_reference_class_is_recognised_and_a_library_base_is_scaffolding.<locals>.Mine "
        "subclasses distlab.zero.optim.ShardedOptimizer, the library's own answer")
    assert reference_use((Mine,), ("distlab.zero.optim.mixed_precision_step",)) is None


def test_decorated_functions_are_told_apart_by_their_own_bodies():
    """``@torch.no_grad()`` gives every function it wraps the same wrapper code; the student's decorated stub is
    not the library's decorated answer, and calling the decorated answer is still found."""
    import torch

    @torch.no_grad()
    def reduce_scatter_grads(flat):
        raise NotImplementedError("Exercise 4.2: replace this line with your solution")

    @torch.no_grad()
    def wraps_it(flat):
        return distlab.zero.zero2.reduce_scatter_grads(flat)

    answer = ("distlab.zero.zero2.reduce_scatter_grads",)
    assert reference_use((reduce_scatter_grads,), answer) is None
    assert reference_use((wraps_it,), answer).endswith("calls distlab.zero.zero2.reduce_scatter_grads, the library's "
                                                       "own answer")


def test_the_students_own_code_is_not_flagged_even_under_the_references_name():
    def ring_all_reduce(tensor):  # noqa: F811  the student's own function with the reference's name
        return my_own(tensor)

    assert reference_use((my_own,), REFERENCES) is None
    assert reference_use((ring_all_reduce,), REFERENCES) is None
    assert reference_use((through_a_global,), ()) is None  # an exercise without references checks nothing


def test_check_scores_a_pass_through_zero_with_the_reason(monkeypatch, capsys):
    exercise = Exercise("9.1", "ring all-reduce", 3, lambda fn: "every case matched", references=REFERENCES)
    monkeypatch.setattr(grading, "find_exercise", lambda i: exercise)
    monkeypatch.setattr(grading, "_ledger", {})
    assert grading.check("9.1", my_own).status == "passed"
    result = grading.check("9.1", through_the_package)
    assert result.status == "failed" and result.points == 0
    assert capsys.readouterr().out.splitlines()[-1] == (
        "✗ Exercise 9.1 ring all-reduce: 0/3 points (through_the_package calls distlab.collectives.ring_all_reduce, "
        "the library's own answer: write your own (a submission that uses it scores 0))")


def test_every_exercises_references_name_library_objects():
    """A typo in a reference would make the check skip it silently; each must import and be the library's."""
    import importlib

    from distlab.grading.registry import all_exercises

    listed = {e.id: e.references for e in all_exercises().values() if e.references}
    assert len(listed) >= 30, f"only {len(listed)} exercises name their library answer"
    for exercise_id, references in listed.items():
        for dotted in references:
            module, _, name = dotted.rpartition(".")
            answer = getattr(importlib.import_module(module), name, None)
            assert answer is not None and answer.__module__.startswith("distlab."), (exercise_id, dotted)


def test_a_submission_held_apart_is_asked_where_its_code_lives():
    """Under ``distlab grade`` the checker holds stand-ins (grading/isolation.py): the question goes to the sandbox
    that executed the student's statements, and only its answer comes back."""
    from distlab.grading.definitions import Definitions
    from distlab.grading.isolation import Sandbox, SealedCode

    source = ("from distlab.collectives import ring_all_reduce\n\n"
              "def through_a_global(tensor):\n    return ring_all_reduce(tensor)\n\n"
              "def my_own(tensor):\n    return tensor * 2\n")
    sandbox = Sandbox(Definitions(((3, source, (1, 3, 6)),)))
    try:
        assert reference_use((SealedCode(sandbox, "through_a_global"),), REFERENCES) == (
            "through_a_global calls distlab.collectives.ring_all_reduce, the library's own answer")
        assert reference_use((SealedCode(sandbox, "my_own"),), REFERENCES) is None
    finally:
        sandbox.close()


# ---------------------------------------------------------------- the installation the grader imports from


def test_the_grader_watches_distlabs_own_files_and_every_folder_it_imports_from():
    from distlab.grading import classroom
    from distlab.runtime.confine import InstallationWatch, available, import_path

    if not available():
        pytest.skip("inotify is Linux's")
    watch = InstallationWatch(roots=(str(classroom._PACKAGE),))
    try:
        watched = set(watch._paths.values())
        assert str(classroom._PACKAGE / "grading") in watched
        assert {p for p in import_path() if "site-packages" in p} <= watched
    finally:
        watch.close()


def test_a_changed_module_is_seen_and_a_module_python_compiled_itself_is_not(tmp_path):
    """A ``.pyc`` is what Python runs in place of its source: one that is the source compiled (Python caching it)
    is no change; one with other code is."""
    import importlib.util
    import py_compile

    from distlab.runtime.confine import InstallationWatch, available

    if not available():
        pytest.skip("inotify is Linux's")
    installed, elsewhere = tmp_path / "installed", tmp_path / "elsewhere"
    installed.mkdir()
    elsewhere.mkdir()
    (installed / "checker.py").write_text("def check():\n    return 'as shipped'\n")
    (elsewhere / "checker.py").write_text("def check():\n    return 'passed'\n")
    watch = InstallationWatch(roots=(str(installed),))
    try:
        cached = Path(py_compile.compile(str(installed / "checker.py"), doraise=True))  # what an import writes
        assert cached == Path(importlib.util.cache_from_source(str(installed / "checker.py")))
        assert watch.changes() == []
        (installed / "helper.py").write_text("x = 1\n")
        assert watch.changes() == [f"{installed / 'helper.py'} (created, written)"]
        forged = Path(py_compile.compile(str(elsewhere / "checker.py"), doraise=True)).read_bytes()
        cached.write_bytes(cached.read_bytes()[:16] + forged[16:])  # the source's size and time: Python loads it
        assert watch.changes() == [f"{cached} (written)"]
    finally:
        watch.close()
