"""Lab 13: answers students plausibly write, each run through its checker: every one fails, naming the mistake.

The right answers are the solution notebook's own exercise cells, executed into one namespace as in a kernel (its
import lines first). A wrong answer is that same code with the one line a student gets wrong changed (the table
shows the line before and after), so each row is exactly one mistake, and the right answer passes beside it. The
four checkers are independent: each compares with the library's reference for its own piece, single-process (no
ranks: the layout is priced by the planner, the loader and the restart run in this process, the run card reads
made-up records and traces).
"""

import re

import pytest

import distlab
from wrong_answers import exercise_cells, solution_namespace

pytestmark = [pytest.mark.timeout(240), pytest.mark.usefixtures("one_thread")]

ANSWERS = {"13.1": "choose_layout", "13.2": "next_batch", "13.3": "resume", "13.4": "report_numbers"}
CELLS = exercise_cells("13_capstone.ipynb", ANSWERS)
IMPORTS = solution_namespace("13_capstone.ipynb", 13)


def answer(exercise: str, old: str = "", new: str = ""):
    """The notebook's answer to ``exercise``, with the line ``old`` replaced by ``new`` (a student's mistake)."""
    source = CELLS[exercise]
    if old:
        assert source.count(old) == 1, f"the solution of {exercise} no longer holds {old!r}"
        source = source.replace(old, new)
    source = source.split("\ndistlab.check")[0]  # the definition, not the check below it
    namespace = {k: v for k, v in IMPORTS.items() if k not in ANSWERS.values()}
    exec(source, namespace)  # noqa: S102  the notebook's own code
    return namespace[ANSWERS[exercise]]


# exercise, the solution's line, the student's line, what the failure must say
WRONG = [
    # 13.1: the layout
    ("13.1", "        if runnable(e.layout):\n            return e.layout",
     "        return e.layout", r"is feasible, but the capstone's worker runs only DP × PP × TP"),
    ("13.1", "    for e in result.feasible:  # fastest first",
     "    for e in sorted(result.feasible, key=lambda e: e.memory['total']):",
     r"the planner ranks .* is the fastest the worker runs|pick by step time"),
    ("13.1", "    for e in result.feasible:  # fastest first",
     "    for e in result.near_misses + result.feasible:",
     r"the planner rejects .*: needs .* per GPU|no layout the worker runs fits"),
    ("13.1", "                     + \"; \".join(f\"{e.layout}: {'; '.join(e.reasons)}\" for e in nearest))",
     "                     + \"no layout fits\")", r"without the planner's reasons: put the nearest runnable misses"),
    # 13.2: the loader
    ("13.2", "    first = position + dp_rank * rows", "    first = position",
     r"equals DP rank 0's rows of this step: each rank takes its own rows"),
    ("13.2", '"position": position + batch_size}', '"position": position + rows}',
     r"the rows DP rank \d read the step before: the position moves on by the global batch"),
    ("13.2", "tokens[k * seq_len:k * seq_len + seq_len + 1] for k in",
     "tokens[k * (seq_len + 1):k * (seq_len + 1) + seq_len + 1] for k in",
     r"windows start every seq_len \+ 1 tokens|window k is tokens\[k·seq_len"),
    ("13.2", "for k in order[first:first + rows].tolist()",
     "for k in order[position + dp_rank:position + batch_size:dp_size].tolist()",
     r"every \d+th window of the step .*DistributedSampler's habit.*its own block of the global batch"),
    ("13.2", "    if position + batch_size > windows // batch_size * batch_size:", "    if position >= windows:",
     r"the epoch's last batch is incomplete and is dropped \(drop_last\)|"
     r"incomplete batch and are dropped \(drop_last\)"),
    ("13.2", "    return batch[:, :-1], batch[:, 1:], {", "    return batch[:, :-1], batch[:, :-1], {",
     r"x is right but y is not: take y = window\[1:\] of the same windows, x shifted by one token"),
    ("13.2", "tokens[k * seq_len:k * seq_len + seq_len + 1] for k in",
     "tokens[k * seq_len:k * seq_len + seq_len] for k in",
     r"x has shape \(\d+, \d+\), expected .*a window is seq_len \+ 1 tokens.*check the slice's bounds"),
    ("13.2", "    rows = batch_size // dp_size\n", "    rows = batch_size\n",
     r"x has shape .*each DP rank takes batch_size // dp_size windows a step: check its rows"),
    ("13.2", "    order = window_order(windows, state[\"seed\"], epoch)",
     "    order = window_order(windows, state[\"seed\"], 0)",
     r"epoch 0's order in a later epoch"),
    # 13.3: the restart wiring
    ("13.3", "        return 0\n", "        return -1\n",
     r"resume returned -1: a fresh job starts at step 0, so return 0 when latest_checkpoint finds none"),
    ("13.3", "    return state.step\n", "    return state.step + 1\n",
     r"so the job continues with step \d+: step_k holds the state after k updates"),
    ("13.3", "    load_checkpoint(state.checkpoint, latest)\n", "",
     r"resume did not load the checkpoint.*load_checkpoint\(state.checkpoint, path\)"),
    ("13.3", "    latest = latest_checkpoint(ckpt_dir)  # committed ones only: a partial save is never a candidate",
     "    latest = max(Path(ckpt_dir).glob('step_*'), default=None)",
     r"a checkpoint that was never committed.*partial"),
    ("13.3", "    load_checkpoint(state.checkpoint, latest)\n", "    load_checkpoint({'train': state}, latest)\n",
     r"the checkpoint did not load: .* load state.checkpoint"),
    # 13.4: the run card's figures
    ("13.4", "    steps = sorted(records[0][\"step_times\"])[1:]  # the first step warms up",
     "    steps = sorted(records[0][\"step_times\"])", r"the first step counted: .* skip it"),
    ("13.4", "        return statistics.median(max(value(r, k) for r in records) for k in steps)",
     "        return statistics.fmean(max(value(r, k) for r in records) for k in steps)",
     r"the mean step time: one slow step pulls it"),
    ("13.4", "        return statistics.median(max(value(r, k) for r in records) for k in steps)",
     "        return statistics.median(value(records[0], k) for k in steps)",
     r"rank 0's step time: a step ends when its slowest rank does"),
    ("13.4", 'step_time = slowest(lambda r, k: r["step_times"][k])',
     'step_time = slowest(lambda r, k: r["step_times"][k + 1])',
     r"raised KeyError \d+: a record's step_times and bytes are keyed by the step numbers it lists"),
    ("13.4", '"mfu": mfu(flops_per_token, rate / len(records), peak_flops),',
     '"mfu": mfu(flops_per_token, rate, peak_flops),', r"MFU against one rank's peak"),
    ("13.4", "trace_bubble(trace, step=k).fraction for k in steps",
     "trace_bubble(trace, step=k).mean_idle for k in steps",
     r"the mean idle over ranks: the bubble is the busiest rank's idle share"),
]


@pytest.mark.parametrize("exercise,old,new,named", WRONG, ids=lambda x: x if len(x) < 8 else None)
def test_a_wrong_answer_fails_and_names_the_mistake(exercise, old, new, named):
    result = distlab.check(exercise, answer(exercise, old, new), quiet=True)
    assert result.status == "failed", (exercise, new, result)
    assert re.search(named, result.detail), result.detail


@pytest.mark.parametrize("exercise", sorted(ANSWERS))
def test_the_notebook_answer_passes(exercise):
    result = distlab.check(exercise, answer(exercise), quiet=True)
    assert result.status == "passed", result.detail

