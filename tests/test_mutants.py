"""The mutation tool (``distlab notebooks mutants``, lib/distlab/mutants.py) on small cells: every operator makes its
mutants inside the solution block and nowhere else, and a real checker's killed, surviving and hanging mutants are
classified as such, each in its own forked process."""

import pytest

from distlab import mutants
from distlab.mutants import OPERATORS, classify, mutants_of

pytestmark = [pytest.mark.timeout(300)]

CELL = '''def answer(x, group=None):
    "Not mutated: the docstring and the def line are outside the block."
    # BEGIN SOLUTION 9.9
    n = dist.get_world_size()
    r = dist.get_rank()
    if n > 1 and not x.is_cuda:
        y = x.clone()
        dist.all_reduce(y, op=dist.ReduceOp.MAX, group=group)
        y.add_(1)
        total = torch.sum(y) + min(n, 3)
        part = y[r % n: n]
        for i in range(n):
            total = total * 2
        return total / n + part[i]
    raise ValueError("x")
    # END SOLUTION


def outside(a, b):
    return a < b
'''

# One mutant each operator must make of CELL: (operator, code before, code after).
EXPECTED = [
    ("compare", "n > 1", "n >= 1"),
    ("off-by-one", "1", "2"),
    ("off-by-one", "range(n)", "range(n + 1)"),
    ("off-by-one", "r % n", "(r + 1) % n"),
    ("off-by-one", "i", "(i) + 1"),
    ("call-removed", "dist.all_reduce(y, op=dist.ReduceOp.MAX, group=group)", "pass"),
    ("call-removed", "x.clone()", "x"),
    ("call-removed", 'raise ValueError("x")', "pass"),
    ("arguments-swapped", "min(n, 3)", "min(3, n)"),
    ("rank-constant", "dist.get_world_size()", "2"),
    ("rank-constant", "dist.get_rank()", "0"),
    ("min-max", "min", "max"),
    ("min-max", "dist.ReduceOp.MAX", "dist.ReduceOp.MIN"),
    ("sum-mean", "torch.sum", "torch.mean"),
    ("guard-removed", "n > 1 and not x.is_cuda", "True"),
    ("arithmetic", "total * 2", "total / 2"),
    ("arithmetic", "total / n", "total // n"),
    ("reduce-op", "dist.all_reduce(y, op=dist.ReduceOp.MAX, group=group)",
     "dist.all_reduce(y, op=dist.ReduceOp.SUM, group=group)"),
    ("group-dropped", "dist.all_reduce(y, op=dist.ReduceOp.MAX, group=group)",
     "dist.all_reduce(y, op=dist.ReduceOp.MAX)"),
    ("out-of-place", "y.add_(1)", "y.add(1)"),
    ("logic", "n > 1 and not x.is_cuda", "n > 1 or not x.is_cuda"),
    ("logic", "not x.is_cuda", "(x.is_cuda)"),
]


def test_every_operator_makes_its_mutants_inside_the_block_only():
    made, generated = mutants_of(CELL, "9.9", limit=None)
    assert generated == len(made) > len(EXPECTED)
    changes = {(m.operator, m.before, m.after) for m in made}
    missing = [e for e in EXPECTED if e not in changes]
    assert not missing, missing
    assert {m.operator for m in made} == set(OPERATORS)
    swapped = [m for m in made if m.operator == "statements-swapped"]
    assert any(m.before.startswith("n = dist.get_world_size()") and m.after.startswith("r = dist.get_rank()")
               for m in swapped), [m.change for m in swapped]
    first, last = CELL.index("# BEGIN SOLUTION"), CELL.index("# END SOLUTION")
    for mutant in made:
        compile(mutant.source, "<mutant>", "exec")
        assert mutant.source[:first] == CELL[:first] and mutant.source.endswith(CELL[last:]), mutant.change
    assert len({m.source for m in made}) == len(made)


def test_a_limit_keeps_every_operator_and_the_same_mutants_each_time():
    every, _ = mutants_of(CELL, "9.9", limit=None)
    some, generated = mutants_of(CELL, "9.9", limit=len(OPERATORS) + 2)
    assert generated == len(every) and len(some) == len(OPERATORS) + 2
    assert {m.operator for m in some} == set(OPERATORS)
    assert some == mutants_of(CELL, "9.9", limit=len(OPERATORS) + 2)[0]
    keys = mutants.keys_of(every)
    assert len(set(keys)) == len(keys) and all(k.startswith("9.9 ") for k in keys)


def test_classify_reads_where_to_look_from_the_message():
    assert classify("passed", "5 cases") == "survived"
    assert classify("failed", "rank 0 of 3 returned world_size=2; use dist.get_world_size()") == "specific"
    assert classify("failed", "for zero_stage=1, world_size=8: expected 16 bytes/param, got 8") == "vague"
    assert classify("failed", "rank 0: the mean differs from the reference by up to 4.5, more than 8e-06 "
                              "(at [0]: 6.0, expected 1.5)") == "vague"
    assert classify("failed", "rank 0: ... (at [0]: 6.0, expected 1.5): divide by the world size") == "specific"
    assert classify("failed", "raised ZeroDivisionError: division by zero (at line 4: n = 1 / 0)") == "vague"
    assert classify("failed", "raised RuntimeError: a Tensor with 3 elements cannot be converted to Scalar (at "
                              "line 5: x.item()); the usual slip: .item() needs one element") == "specific"
    assert classify("failed", "the 2 ranks together sent 5460 bytes; a ring sends each chunk N-1 times per phase, "
                              "3640 bytes in all (world size 2, 455 float32 elements)") == "specific"
    assert classify("failed", "your ring deadlocked on 3 ranks: no rank is sending (timed out after 8 s). Hint: each "
                              "rank must send to (rank + 1) % N") == "specific"
    assert classify("failed", "job_mtbf(16384) = 3.15 h, expected 3.093 h") == "vague"
    assert classify("failed", "raised RankFailed: ranks 0, 1 raised UnboundLocalError: cannot access local variable "
                              "'n' where it is not associated with a value") == "specific"  # a slip, read anew


def test_killed_surviving_and_hanging_mutants_of_a_real_checker():
    """Exercise 1.1 of lab 01 (its checker runs in-process, in a fork of this one): a flipped comparison is killed,
    two independent assignments swapped survive, and an endless loop is stopped at the limit as hung."""
    source = mutants.lab_source(1)
    namespace, errors = mutants.reference_namespace(source)
    assert not errors
    text = source.cells[source.answers["1.1"]]
    made = {m.change: m for m in mutants_of(text, "1.1", limit=None)[0]}
    killed = made["compare: `zero_stage >= 3` → `zero_stage > 3`"]
    survivor = next(m for change, m in made.items() if change.startswith("statements-swapped: `params = "))
    looping = text.replace("    n = world_size\n", "    n = world_size\n    while n:\n        pass\n")
    kind, detail, _ = mutants.check_mutant(source, namespace, "1.1", killed.source, limit=120)
    assert kind == "specific" and "that is stage 2's count" in detail, (kind, detail)
    kind, detail, _ = mutants.check_mutant(source, namespace, "1.1", survivor.source, limit=120)
    assert kind == "survived", (kind, detail)
    kind, _, seconds = mutants.check_mutant(source, namespace, "1.1", looping, limit=3)
    assert kind == "hung" and 3 <= seconds < 60
    kind, detail, _ = mutants.check_mutant(source, namespace, "1.1", text.replace("2 / n if", "2 // n if"), 120)
    assert kind == "specific" and "// rounds each share down" in detail, detail
