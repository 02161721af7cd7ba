"""Lab 01 — memory math. Checkers compare the student's formulas with :mod:`distlab.memory`.

Cases are drawn from the lab's seed (fixed in self-study, so notebook output is reproducible) over
ranges a student cannot special-case: random world sizes, ZeRO stages, shapes, and
random model shapes next to the 7B/70B/405B presets. A ``NotImplementedError`` from an
untouched stub propagates, and the framework reports "not attempted".
"""

from __future__ import annotations

import math
import numbers
import random

from distlab.grading import quiz
from distlab.grading.contract import CheckFailed
from distlab.grading.harness import lab_seed
from distlab.grading.registry import Exercise
from distlab.memory import PRESETS, GiB, Preset, activation_bytes_per_layer, bytes_per_param


def _seed() -> int:
    """This lab's seed for its hidden cases, read as each check runs (:func:`~distlab.grading.harness.lab_seed`)."""
    return lab_seed(1)


def _number(value, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise CheckFailed(f"{where}: expected a number, got {value!r}")
    return float(value)


def _compare(expected: float, got, where: str, unit: str) -> None:
    value = _number(got, where)
    if not math.isclose(value, expected, rel_tol=1e-9, abs_tol=1e-9):
        raise CheckFailed(f"{where}: expected {expected:.6g} {unit}, got {value:.6g}")


def _world_sizes(rng: random.Random, k: int) -> list[int]:
    return [1, 2, 8, 64, 1024] + [rng.randint(3, 4096) for _ in range(k)]


def check_bytes_per_param(student_bytes_per_param) -> str:
    """1.1: ``bytes_per_param(zero_stage, world_size)`` → per-rank bytes/param, Adam mixed precision."""
    rng = random.Random(_seed())
    cases = [(stage, n) for n in _world_sizes(rng, 6) for stage in (0, 1, 2, 3)]
    for stage, n in cases:
        expected = bytes_per_param(stage, n, "mixed").total
        _compare(expected, student_bytes_per_param(stage, n), f"for zero_stage={stage}, world_size={n}", "bytes/param")
    return f"{len(cases)} cases: stages 0-3, world sizes 1-4096"


def _shapes(rng: random.Random, k: int) -> list[tuple[int, int, int, int]]:
    """(seq_len, batch, d_model, n_head): the presets' shapes and random ones."""
    shapes = [(p.seq_len, 1, p.d_model, p.n_head) for p in PRESETS.values()]
    for _ in range(k):
        n_head = rng.choice([4, 8, 12, 16, 32, 40, 64, 96])
        shapes.append((rng.choice([128, 512, 1000, 2048, 4096, 8192]), rng.randint(1, 16),
                       n_head * rng.choice([32, 64, 80, 128]), n_head))
    return shapes


def check_activation_bytes_per_layer(student_fn) -> str:
    """1.2: ``activation_bytes_per_layer(seq_len, batch, d_model, n_head)`` → bytes, 16-bit, no recomputation."""
    shapes = _shapes(random.Random(_seed() + 2), 12)
    for s, b, h, a in shapes:
        expected = activation_bytes_per_layer(s, b, h, a)
        _compare(expected, student_fn(s, b, h, a), f"for seq_len={s}, batch={b}, d_model={h}, n_head={a}", "bytes")
    return f"{len(shapes)} shapes, seq_len 128-8192"


def check_activation_bytes(student_fn) -> str:
    """1.3: ``activation_bytes(seq_len, batch, d_model, n_head, n_layer, checkpointing)`` → bytes for all layers."""
    rng = random.Random(_seed() + 3)
    cases = 0
    for s, b, h, a in _shapes(rng, 8):
        n_layer = rng.randint(1, 128)
        for ckpt in (False, True):
            expected = n_layer * activation_bytes_per_layer(s, b, h, a, checkpointing=ckpt)
            got = student_fn(s, b, h, a, n_layer, ckpt)
            _compare(expected, got, f"for seq_len={s}, batch={b}, d_model={h}, n_head={a}, n_layer={n_layer}, "
                                    f"checkpointing={ckpt}", "bytes")
            cases += 1
    return f"{cases} cases, with and without checkpointing"


def check_training_memory_gib(student_fn) -> str:
    """1.4: ``training_memory_gib(preset, world_size, zero_stage, micro_batch, checkpointing)`` → GiB per rank."""
    rng = random.Random(_seed() + 4)
    presets = list(PRESETS.values()) + [
        Preset("random", n_layer=rng.randint(8, 96), d_model=128 * rng.randint(8, 96), n_head=32, n_kv_head=8,
               ffn_dim=256 * rng.randint(20, 200), vocab_size=rng.randint(32000, 160000), seq_len=2048)]
    cases = 0
    for preset in presets:
        for _ in range(6):
            n, stage = rng.choice([1, 8, 16, 64, 512, rng.randint(2, 2048)]), rng.randint(0, 3)
            micro, ckpt = rng.randint(1, 4), rng.random() < 0.5
            expected = preset.memory(n, stage, micro_batch=micro, checkpointing=ckpt).total / GiB
            got = student_fn(preset, n, stage, micro, ckpt)
            _compare(expected, got, f"for the {preset.name} model, world_size={n}, zero_stage={stage}, "
                                    f"micro_batch={micro}, checkpointing={ckpt}", "GiB")
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

EXERCISES = [
    Exercise("1.1", "bytes per parameter under DDP and ZeRO-1/2/3", 2, check_bytes_per_param,
             references=("distlab.memory.bytes_per_param",)),
    Exercise("1.2", "activation bytes of one transformer layer", 2, check_activation_bytes_per_layer,
             references=("distlab.memory.activation_bytes_per_layer",)),
    Exercise("1.3", "activation bytes with and without checkpointing", 2, check_activation_bytes),
    Exercise("1.4", "per-rank training memory in GiB", 3, check_training_memory_gib),
    *QUIZ,
]
