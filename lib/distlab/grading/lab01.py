"""Lab 01 — memory math. Checkers compare the student's formulas with :mod:`distlab.memory`.

Cases are drawn from the lab's seed (fixed in self-study, so notebook output is reproducible) over
ranges a student cannot special-case: random world sizes, ZeRO stages, shapes, and
random model shapes next to the 7B/70B/405B presets. A ``NotImplementedError`` from an
untouched stub propagates, and the framework reports "not attempted".
"""

from __future__ import annotations

import numbers
import random

from distlab.grading import quiz
from distlab.grading.contract import CheckFailed
from distlab.grading.harness import Edge, case_drawn, lab_seed, tolerance
from distlab.grading.registry import Exercise
from distlab.memory import PRESETS, GiB, Preset, activation_bytes_per_layer, bytes_per_param


def _seed() -> int:
    """This lab's seed for its hidden cases, read as each check runs (:func:`~distlab.grading.harness.lab_seed`)."""
    return lab_seed(1)


def _number(value, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise CheckFailed(f"{where}: expected a number, got {value!r}")
    return float(value)


def _close(got: float, expected: float, terms: int = 8) -> bool:
    """The one tolerance rule (:func:`~distlab.grading.harness.tolerance`) on two float64 results of a formula."""
    return tolerance(expected, terms=terms).holds(got, expected)


def _compare(expected: float, got, where: str, unit: str, advice=None) -> None:
    """Fail unless ``got`` equals ``expected``; ``advice(value)`` says where to look (the term or the flag)."""
    value = _number(got, where)
    if not _close(value, expected):
        hint = advice(value) if advice else ""
        raise CheckFailed(f"{where}: expected {expected:.6g} {unit}, got {value:.6g}" + (f": {hint}" if hint else ""))


def _world_sizes(rng: random.Random, k: int) -> list[int]:
    return [1, 2, 8, 64, 1024] + [rng.randint(3, 4096) for _ in range(k)]


# What each ZeRO stage shards, and its per-rank count of the 2 + 2 + 12 bytes.
_SHARDS = {0: "stage 0 (DDP) shards nothing: every rank keeps all 16 bytes of each parameter",
           1: "stage 1 shards the 12 bytes of optimizer state over the N ranks",
           2: "stage 2 shards the optimizer state and the 2 bytes of gradients over the N ranks",
           3: "stage 3 shards all 16 bytes over the N ranks, the parameters too"}
_FORMULA = {0: "2 + 2 + 12", 1: "2 + 2 + 12/N", 2: "2 + (2 + 12)/N", 3: "(2 + 2 + 12)/N"}


def _stage_advice(stage: int, n: int):
    """Where a wrong count for ``stage`` on ``n`` ranks goes astray: another stage's count, shares divided with
    ``//``, or else the stage's formula and what it shards."""
    def advice(value: float) -> str:
        right = bytes_per_param(stage, n).total
        for other in range(4):
            count = bytes_per_param(other, n).total
            if other != stage and not _close(count, right) and _close(value, count):
                return f"that is stage {other}'s count ({_FORMULA[other]}); {_SHARDS[stage]}"
        if n > 1 and _close(value, _floor_divided(stage, n)):
            return "// rounds each share down to whole bytes: divide with /"
        return f"stage {stage} is {_FORMULA[stage]}: {_SHARDS[stage]}"
    return advice


def _floor_divided(stage: int, n: int) -> float:
    """Stage ``stage``'s count with each sharded share divided by ``//``."""
    sharded = {0: (), 1: (12,), 2: (2, 12), 3: (2, 2, 12)}[stage]
    return sum(b // n for b in sharded) + 16 - sum(sharded)


def check_bytes_per_param(student_bytes_per_param) -> str:
    """1.1: ``bytes_per_param(zero_stage, world_size)`` → per-rank bytes/param, Adam mixed precision."""
    rng = random.Random(_seed())
    cases = [(stage, n) for n in _world_sizes(rng, 6) for stage in (0, 1, 2, 3)]
    for stage, n in cases:
        case_drawn("1.1", stage=stage, world=n)
        expected = bytes_per_param(stage, n, "mixed").total
        _compare(expected, student_bytes_per_param(stage, n), f"for zero_stage={stage}, world_size={n}", "bytes/param",
                 _stage_advice(stage, n))
    return f"{len(cases)} cases: stages 0-3, world sizes 1-4096"


def _shapes(rng: random.Random, k: int) -> list[tuple[int, int, int, int]]:
    """(seq_len, batch, d_model, n_head): the presets' shapes and random ones."""
    shapes = [(p.seq_len, 1, p.d_model, p.n_head) for p in PRESETS.values()]
    for _ in range(k):
        n_head = rng.choice([4, 8, 12, 16, 32, 40, 64, 96])
        shapes.append((rng.choice([128, 512, 1000, 2048, 4096, 8192]), rng.randint(2, 16),
                       n_head * rng.choice([32, 64, 80, 128]), n_head))
    return shapes


def _layer_advice(student_fn, s: int, b: int, h: int, a: int):
    """Which of the two terms of s·b·h·(34 + 5·a·s/h) the student's function gets wrong, read by calling it again
    with twice the heads: the part that changes is its attention-scores term (5·a·s²·b), the rest its 34·s·b·h."""
    def advice(value: float) -> str:
        linear, scores = 34 * s * b * h, 5 * a * s * s * b
        try:
            theirs = _number(student_fn(s, b, h, 2 * a), "") - value
        except Exception:  # noqa: BLE001  only a hint: the failure itself is already certain
            theirs = None
        if theirs is not None and _close(theirs, scores) and not _close(value - theirs, linear):
            return (f"your part that does not grow with n_head is {value - theirs:.6g}, expected 34·s·b·h = "
                    f"{linear:.6g}: the 34 bytes per s·b·h element (fp16 inputs, masks, MLP activations)")
        if theirs is not None and _close(value - theirs, linear) and not _close(theirs, scores):
            return (f"your part that grows with n_head is {theirs:.6g}, expected 5·a·s²·b = {scores:.6g}: the "
                    f"attention scores, softmax and dropout mask, a·s² values per sequence")
        return "the formula is s·b·h·(34 + 5·a·s/h): check both terms, the second grows with n_head"
    return advice


def check_activation_bytes_per_layer(student_fn) -> str:
    """1.2: ``activation_bytes_per_layer(seq_len, batch, d_model, n_head)`` → bytes, 16-bit, no recomputation."""
    shapes = _shapes(random.Random(_seed() + 2), 12)
    for s, b, h, a in shapes:
        case_drawn("1.2", seq_len=s, batch=b, d_model=h, n_head=a)
        expected = activation_bytes_per_layer(s, b, h, a)
        _compare(expected, student_fn(s, b, h, a), f"for seq_len={s}, batch={b}, d_model={h}, n_head={a}", "bytes",
                 _layer_advice(student_fn, s, b, h, a))
    return f"{len(shapes)} shapes, seq_len 128-8192"


def _stack_advice(s: int, b: int, h: int, a: int, n_layer: int, ckpt: bool):
    def advice(value: float) -> str:
        per_layer = activation_bytes_per_layer(s, b, h, a, checkpointing=ckpt)
        other = n_layer * activation_bytes_per_layer(s, b, h, a, checkpointing=not ckpt)
        if _close(value, per_layer):
            return f"that is one layer's: multiply by n_layer = {n_layer}"
        if _close(value, other):
            return (f"that is the count {'without' if ckpt else 'with'} checkpointing: with checkpointing each "
                    f"layer keeps only its input (2·s·b·h bytes), without it all of s·b·h·(34 + 5·a·s/h)")
        if ckpt:
            return "with checkpointing each layer keeps only its 16-bit input, 2·s·b·h bytes, times n_layer"
        return "without checkpointing each layer keeps s·b·h·(34 + 5·a·s/h) bytes (exercise 1.2), times n_layer"
    return advice


def check_activation_bytes(student_fn) -> str:
    """1.3: ``activation_bytes(seq_len, batch, d_model, n_head, n_layer, checkpointing)`` → bytes for all layers."""
    rng = random.Random(_seed() + 3)
    cases = 0
    for k, (s, b, h, a) in enumerate(_shapes(rng, 8)):
        n_layer = 1 if k == 0 else rng.randint(2, 128)
        for ckpt in (False, True):
            case_drawn("1.3", n_layer=n_layer, checkpointing=ckpt, batch=b)
            expected = n_layer * activation_bytes_per_layer(s, b, h, a, checkpointing=ckpt)
            got = student_fn(s, b, h, a, n_layer, ckpt)
            _compare(expected, got, f"for seq_len={s}, batch={b}, d_model={h}, n_head={a}, n_layer={n_layer}, "
                                    f"checkpointing={ckpt}", "bytes", _stack_advice(s, b, h, a, n_layer, ckpt))
            cases += 1
    return f"{cases} cases, with and without checkpointing"


def _memory_advice(preset, n: int, stage: int, micro: int, ckpt: bool):
    def advice(value: float) -> str:
        memory = preset.memory(n, stage, micro_batch=micro, checkpointing=ckpt)
        states, acts = memory.states / GiB, memory.activations / GiB
        flipped = preset.memory(n, stage, micro_batch=micro, checkpointing=not ckpt).activations / GiB
        one = preset.memory(n, stage, micro_batch=1, checkpointing=ckpt).activations / GiB
        if _close(value, states):
            return "that is the model states only: add the activations of all layers (exercise 1.3)"
        if _close(value, acts):
            return "that is the activations only: add the model states, n_params × bytes per parameter (1.1)"
        if _close(value, (memory.states + memory.activations) / 1e9):
            return "that is in GB (10⁹ bytes): a GiB is 2³⁰ bytes"
        if _close(value, states + flipped):
            return "the activations are counted with checkpointing the other way round"
        if micro > 1 and _close(value, states + one):
            return f"the activations are for one sequence: they scale with micro_batch = {micro}"
        return (f"expected {states:.6g} GiB of model states + {acts:.6g} GiB of activations: compare each with your "
                f"terms")
    return advice


def check_training_memory_gib(student_fn) -> str:
    """1.4: ``training_memory_gib(preset, world_size, zero_stage, micro_batch, checkpointing)`` → GiB per rank."""
    rng = random.Random(_seed() + 4)
    presets = list(PRESETS.values()) + [
        Preset("random", n_layer=rng.randint(8, 96), d_model=128 * rng.randint(8, 96), n_head=32, n_kv_head=8,
               ffn_dim=256 * rng.randint(20, 200), vocab_size=rng.randint(32000, 160000), seq_len=2048)]
    cases = 0
    for preset in presets:
        for k in range(6):
            n = rng.choice([1, 8, 16, 64, 512, rng.randint(2, 2048)]) if k else 1  # one rank: nothing sharded
            stage = k if k < 4 else rng.randint(0, 3)  # every stage on every model
            micro, ckpt = rng.randint(1, 4), k % 2 == 0 if k < 4 else rng.random() < 0.5
            case_drawn("1.4", world=n, stage=stage, micro_batch=micro, checkpointing=ckpt)
            expected = preset.memory(n, stage, micro_batch=micro, checkpointing=ckpt).total / GiB
            got = student_fn(preset, n, stage, micro, ckpt)
            _compare(expected, got, f"for the {preset.name} model, world_size={n}, zero_stage={stage}, "
                                    f"micro_batch={micro}, checkpointing={ckpt}", "GiB",
                     _memory_advice(preset, n, stage, micro, ckpt))
            cases += 1
    return f"{cases} cases over the 7B/70B/405B presets and a random model"


QUIZ = [
    quiz.number("Q1.1", "bytes per parameter of Adam mixed precision under DDP", answer=16, rel_tol=0,
                hint="section 1: bf16 weights and gradients, fp32 master weights and two moments",
                fixed="the question has no number: 16 bytes per parameter is the lesson"),
    quiz.number("Q1.2", "ZeRO-3 bytes per parameter per rank on {ranks} ranks", rel_tol=0.001,
                given=dict(ranks=64), vary=dict(ranks=(8, 16, 24, 32, 48, 96, 128, 256, 512, 1024)),
                solve=lambda ranks: bytes_per_param(3, ranks).total,
                hint="exercise 1.1: stage 3 shards all 16 bytes over the N ranks"),
    quiz.number("Q1.3", "ZeRO-1 bytes per parameter per rank as N grows without bound", answer=4, rel_tol=0.001,
                hint="exercise 1.1: what is not sharded in stage 1?",
                fixed="a limit as N grows: the question has no number to change"),
    quiz.number("Q1.4", "GiB of model states per rank for the {preset} preset, {ranks} ranks, ZeRO-{stage}",
                rel_tol=0.005, abs_tol=0.006, given=dict(preset="70B", ranks=64, stage=3),
                vary=dict(preset=("7B", "405B"), ranks=(8, 16, 32, 128), stage=(1, 2)),
                solve=lambda preset, ranks, stage: PRESETS[preset].memory(ranks, stage).states / GiB,
                hint="section 3: n_params x the stage's bytes per parameter on N ranks, in GiB (2^30 bytes)"),
    quiz.number("Q1.5", "bytes per s*b*h a checkpointed layer keeps at {bits}-bit", rel_tol=0,
                given=dict(bits=16), vary=dict(bits=(8, 32)),
                solve=lambda bits: activation_bytes_per_layer(1, 1, 1, 1, checkpointing=True,
                                                              bytes_per_value=bits // 8),
                hint="section 2: with full checkpointing a layer keeps only its input"),
    quiz.choice("Q1.6", "what FSDP shards and DDP does not", answer="c", options="abc",
                hint="section 3, DDP against FSDP: which tensors does each rank keep whole under DDP?"),
]

# The boundaries each exercise's text names (harness.Edge; tests/grading/test_reference_seeds.py checks every seed's
# cases hold each): the table's four stages, N = 1 (nothing to shard away) and N that 12 bytes do not divide; the
# formula's batch and its two terms (s and h kept apart); checkpointing on and off, one layer and many; GiB.
_CHECKPOINTING = [Edge("checkpointing", lambda c: c["checkpointing"]),
                  Edge("no checkpointing", lambda c: not c["checkpointing"])]
EDGES = {
    "1.1": [*(Edge(f"ZeRO stage {k}", lambda c, k=k: c["stage"] == k) for k in range(4)),
            Edge("N = 1", lambda c: c["world"] == 1),
            Edge("N that does not divide 12 bytes", lambda c: c["world"] > 1 and 12 % c["world"] != 0)],
    "1.2": [Edge("batch 1", lambda c: c["batch"] == 1), Edge("batch > 1", lambda c: c["batch"] > 1),
            Edge("seq_len ≠ d_model", lambda c: c["seq_len"] != c["d_model"]),
            Edge("d_model not a power of two", lambda c: c["d_model"] & (c["d_model"] - 1) != 0)],
    "1.3": [*_CHECKPOINTING, Edge("one layer", lambda c: c["n_layer"] == 1),
            Edge("many layers", lambda c: c["n_layer"] > 1), Edge("batch > 1", lambda c: c["batch"] > 1)],
    "1.4": [*(Edge(f"ZeRO stage {k}", lambda c, k=k: c["stage"] == k) for k in range(4)),
            *_CHECKPOINTING, Edge("world size 1", lambda c: c["world"] == 1),
            Edge("micro_batch > 1", lambda c: c["micro_batch"] > 1)],
}

# Mutants of the reference that compute the same thing (distlab notebooks mutants), each with why.
EQUIVALENT_MUTANTS = {
    "1.4 statements-swapped: `states = preset.n_params * bytes_per_param(zero_stage, world_size) ac…` → "
    "`acts = activation_bytes(preset.seq_len, micro_batch, preset.d_model, …`":
        "two independent assignments in the other order",
    "1.1 statements-swapped: `params = 2 / n if zero_stage >= 3 else 2 grads = 2 / n if zero_stage …` → "
    "`grads = 2 / n if zero_stage >= 2 else 2 params = 2 / n if zero_stage …`":
        "two independent assignments in the other order",
    "1.1 statements-swapped: `grads = 2 / n if zero_stage >= 2 else 2 optimizer = 12 / n if zero_st…` → "
    "`optimizer = 12 / n if zero_stage >= 1 else 12 grads = 2 / n if zero_s…`":
        "two independent assignments in the other order",
}

EXERCISES = [
    Exercise("1.1", "bytes per parameter under DDP and ZeRO-1/2/3", 2, check_bytes_per_param,
             references=("distlab.memory.bytes_per_param",)),
    Exercise("1.2", "activation bytes of one transformer layer", 2, check_activation_bytes_per_layer,
             references=("distlab.memory.activation_bytes_per_layer",)),
    Exercise("1.3", "activation bytes with and without checkpointing", 2, check_activation_bytes),
    Exercise("1.4", "per-rank training memory in GiB", 3, check_training_memory_gib),
    *QUIZ,
]
