"""A submission that hands in, or calls, the library's own answer to its exercise scores 0 and is told why; the
student's own code, even under the reference's name, is not flagged."""

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
