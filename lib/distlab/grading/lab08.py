"""Lab 08 — Mixture of Experts. Checkers compare the student's code with :mod:`distlab.moe`.

Exercises 8.1–8.5 run in this process on hidden random cases (token counts, widths,
expert counts, k, capacity factors, skewed routers that force drops); 8.6 runs the
student's expert-parallel layer on 2 and 4 real gloo ranks, with uneven token counts, a
capacity limit, a rank that receives no token and one expert that receives them all, and
compares every rank's output and gradients (tokens, router, every expert on its owner)
with the single-device layer to 1e-5. Where a wrong answer matches a known mistake (gates
not renormalised, second choices before first choices, the bias in the gates, the combine
sent with the dispatch's splits, split sizes per expert instead of per rank…) the failure names it, also
when torch raises it on a rank. The one-device layer (8.5) runs on distlab's router and capacity
(:func:`~distlab.grading.harness.with_reference`), so a mistake in 8.1 or 8.2 fails only its own check.
Cases come from the lab's seed, fixed in self-study, so notebook output is reproducible; an untouched stub's
``NotImplementedError`` propagates and is reported as "not attempted".
"""

from __future__ import annotations

import math
import numbers
import random
import types
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from distlab.grading import quiz
from distlab.grading.contract import CheckFailed, first_line
from distlab.grading.harness import (
    ATOL,
    Edge,
    case_drawn,
    is_close,
    lab_seed,
    max_difference,
    run_isolated,
    run_on_ranks,
    with_reference,
)
from distlab.grading.registry import Exercise
from distlab.moe import (
    DEEPSEEK_V3,
    all_to_all_bytes,
    assign_capacity,
    dispatch_plan,
    expert_capacity,
    imbalance,
    load_balancing_loss,
    local_expert_ids,
    make_experts,
    moe_forward,
    route,
    router_z_loss,
    run_experts,
    skewed_tokens,
    update_expert_bias,
)
from distlab.runtime.errors import RankFailed


def _seed() -> int:
    """This lab's seed for its hidden cases, read as each check runs (:func:`~distlab.grading.harness.lab_seed`)."""
    return lab_seed(8)


_SMALL = 1024  # bytes of bookkeeping (split sizes) a rank may exchange besides the tokens

__all__ = ["EXERCISES", "EPCase", "check_router", "check_capacity", "check_balancing_losses", "check_bias_update",
           "check_moe_layer", "check_expert_parallel"]


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------- 8.1 router

def _as_routing(got, where: str):
    for name in ("probs", "experts", "gates"):
        if not hasattr(got, name):
            kind = got if isinstance(got, str) else type(got).__name__  # the type run_isolated saw
            raise CheckFailed(f"{where}: return a distlab.moe.Routing(logits, probs, experts, gates), got {kind}")
    return got


def _route_job(route_fn, x, weight, k, bias, cotangent):
    """8.1 where the student's code runs: its routing, whether its gates carry a gradient, and the router weight's
    gradient through them for ``cotangent`` (the checker compares all of it with its own reference)."""
    w = weight.detach().clone().requires_grad_(True)
    got = route_fn(x, w, k, bias) if bias is not None else route_fn(x, w, k)
    fields = {name: getattr(got, name) for name in ("probs", "experts", "gates") if hasattr(got, name)}
    if len(fields) < 3:
        return type(got).__name__, None, None
    differentiable = isinstance(got.gates, torch.Tensor) and got.gates.grad_fn is not None
    if differentiable:
        (got.gates * cotangent).sum().backward()
    return fields, differentiable, w.grad


def _probs_mistake(probs, expected) -> str:
    """Where wrong router probabilities come from: another field returned as probs, the logits unnormalised, or a
    softmax over the tokens."""
    if isinstance(probs, torch.Tensor) and probs.dtype != torch.float32:
        return (f"probs came out {probs.dtype}: take the softmax in fp32, softmax(logits.float(), dim=-1) (bf16 "
                f"rounds the probabilities of close experts together)")
    if tuple(probs.shape) != tuple(expected.probs.shape):
        return ("check what you return as probs, [T, E]: Routing's fields are (logits, probs, experts, gates), in "
                "that order")
    if is_close(probs, expected.logits, atol=1e-5, rtol=1e-5):
        return ("these are the logits: take softmax(logits, dim=-1) for probs (Routing's fields are logits, probs, "
                "experts, gates, in that order)")
    if is_close(probs.float().sum(0), torch.ones(probs.shape[1]), atol=1e-4, rtol=1e-4):
        return "each expert's column sums to 1, a softmax over the tokens: take it over the experts, dim=-1"
    return "check the logits (x @ weight.t()) and the softmax over the experts (dim=-1), in fp32"


def check_router(route_fn) -> str:
    """8.1: ``route(x, weight, k, bias=None)`` → ``Routing`` (probs, top-k experts, gates)."""
    rng = random.Random(_seed() + 1)
    cases = [(1, False), (2, False), (rng.randint(3, 4), False), (2, True), (1, True)]
    for i, (k, with_bias) in enumerate(cases):
        T, d, E = rng.randint(12, 40), rng.choice([8, 12, 16]), rng.choice([4, 6, 8, 12])
        g = _generator(_seed() + 10 + i)
        dtype = torch.bfloat16 if i == len(cases) - 1 else torch.float32  # a bf16 model: the softmax stays fp32
        x = torch.randn(T, d, generator=g).to(dtype)
        w_ref = (torch.randn(E, d, generator=g) / math.sqrt(d)).to(dtype).requires_grad_(True)
        bias = torch.randn(E, generator=g) * 0.2 if with_bias else None
        where = (f"T={T} tokens, E={E} experts, k={k}" + (", with a selection bias" if with_bias else "")
                 + (", bf16 x and weight" if dtype == torch.bfloat16 else ""))
        case_drawn("8.1", k=k, bias=with_bias, experts=E, bf16=dtype == torch.bfloat16)
        expected = route(x, w_ref, k, bias)
        cotangent = torch.randn(T, k, generator=g)
        try:
            fields, differentiable, w_grad = run_isolated(_route_job, route_fn, x, w_ref, k, bias, cotangent)
        except Exception as error:
            if "ValueError" not in (type(error).__name__, getattr(error, "exc_type", "")):
                raise
            raise CheckFailed(f"{where}: route(x, weight, k={k}) raised ValueError ({first_line(error)[:80]}), but "
                              f"k={k} of {E} experts is valid: check the condition before your raise "
                              f"(1 <= k <= weight.shape[0])") from None
        got = _as_routing(types.SimpleNamespace(**fields) if isinstance(fields, dict) else fields, where)
        if tuple(got.probs.shape) != (T, E) or not is_close(got.probs, expected.probs, atol=1e-6, rtol=1e-6):
            by = max_difference(got.probs, expected.probs)[0] if got.probs.shape == expected.probs.shape else "shape"
            raise CheckFailed(f"{where}: probs differ from softmax(x @ weight.T) over the experts (dim=-1) by "
                              f"{by}; expected shape {(T, E)}, got {tuple(got.probs.shape)}: "
                              f"{_probs_mistake(got.probs, expected)}")
        if tuple(got.experts.shape) != (T, k):
            raise CheckFailed(f"{where}: experts should have shape [T, k] = {(T, k)}, got {tuple(got.experts.shape)}")
        if not torch.equal(got.experts.long(), expected.experts):
            same_sets = torch.equal(got.experts.long().sort(-1).values, expected.experts.sort(-1).values)
            unbiased = expected.probs.topk(k, dim=-1).indices
            if same_sets:
                raise CheckFailed(f"{where}: the right experts in the wrong order: list each token's k experts "
                                  f"best first (as torch.topk returns them), so gates[:, 0] is the top choice")
            if with_bias and torch.equal(got.experts.long(), unbiased):
                raise CheckFailed(f"{where}: the bias did not change the choice: select the top-k of probs + bias")
            t = int((got.experts.long() != expected.experts).any(-1).nonzero()[0])
            raise CheckFailed(f"{where}: token {t} went to experts {got.experts[t].tolist()}, expected "
                              f"{expected.experts[t].tolist()}: take the k largest "
                              f"{'probs + bias' if with_bias else 'probs'} over the experts (topk, dim=-1)")
        if not is_close(got.gates, expected.gates, atol=1e-6, rtol=1e-6):
            raw = expected.probs.gather(-1, expected.experts)
            if k == 1 and torch.allclose(got.gates.detach(), torch.ones_like(raw)):
                raise CheckFailed(f"{where}: with k=1 every gate came out 1.0: keep the raw probability (Switch). "
                                  f"Renormalising a single gate gives 1 and the router gets no gradient")
            if k > 1 and is_close(got.gates, raw, atol=1e-6, rtol=1e-6):
                raise CheckFailed(f"{where}: gates are the raw probabilities: divide them by their sum over the k "
                                  f"choices so they sum to 1 (renormalised, as in Mixtral)")
            if with_bias:
                biased = (expected.probs + bias).gather(-1, expected.experts)
                if k > 1:
                    biased = biased / biased.sum(-1, keepdim=True)
                if is_close(got.gates, biased, atol=1e-6, rtol=1e-6):
                    raise CheckFailed(f"{where}: the bias leaked into the gates: use probs + bias only to choose "
                                      f"experts, and gather the gates from probs")
            raise CheckFailed(f"{where}: gates differ by up to {max_difference(got.gates, expected.gates)[0]:.3g}: "
                              f"a gate is probs gathered at the chosen experts"
                              + (", renormalised over the k choices" if k > 1 else " (kept raw for k = 1)"))
        if not differentiable:
            raise CheckFailed(f"{where}: the gates carry no gradient: gather them from probs (differentiable), "
                              f"never from detached values, or the router never learns")
        (expected.gates * cotangent).sum().backward()
        if w_grad is None or not is_close(w_grad, w_ref.grad, rtol=ATOL):
            raise CheckFailed(f"{where}: the router weight's gradient through the gates differs by "
                              f"{max_difference(w_grad, w_ref.grad)[0] if w_grad is not None else 'everything (None)'}"
                              f": the gates must come from softmax(x @ weight.T) by differentiable ops (gather, "
                              f"division), with the same softmax the probs use")
    # k's range at both ends: E experts of width 6 < E (the experts are the weight's rows, not its columns)
    E = 8
    x, w = torch.randn(4, 6, generator=_generator(1)), torch.randn(E, 6, generator=_generator(2))
    case_drawn("8.1", k=E, bias=False, experts=E, limits=True)
    try:
        route_fn(x, w, E)
    except ValueError as error:
        raise CheckFailed(f"route(x, weight, k={E}) with {E} experts (the weight's {E} rows) raised ValueError "
                          f"({first_line(error)[:80]}): k may be anything from 1 to the number of experts, "
                          f"weight.shape[0], inclusive: check the bounds of your test on k") from None
    for k in (E + 1, 0):
        try:
            route_fn(x, w, k)
        except ValueError:
            continue
        except NotImplementedError:
            raise
        except Exception as error:
            raise CheckFailed(f"route(x, weight, k={k}) with {E} experts raised {type(error).__name__}; raise a "
                              f"ValueError naming k and the number of experts before routing") from None
        raise CheckFailed(f"route(x, weight, k={k}) with {E} experts returned: "
                          + ("k > experts must raise ValueError" if k else
                             "k = 0 must raise ValueError (k runs from 1 to the number of experts)"))
    return (f"{len(cases)} cases, k = 1 to {max(k for k, _ in cases)}, with and without a bias; k = E accepted, "
            f"k = 0 and k > E rejected")


# ---------------------------------------------------------------- 8.2 capacity

def _token_major_keep(experts: torch.Tensor, num_experts: int, capacity: int) -> torch.Tensor:
    """The usual mistake: a token's second choice queued before the next token's first."""
    flat = experts.reshape(-1)
    one_hot = torch.nn.functional.one_hot(flat, num_experts)
    position = (one_hot.cumsum(0) * one_hot).sum(-1) - 1
    return (position < capacity).view_as(experts)


def check_capacity(capacity_fn, assign_fn) -> str:
    """8.2: ``expert_capacity(tokens, E, k, capacity_factor)`` and ``assign_capacity(experts, E, capacity)``."""
    rng = random.Random(_seed() + 2)
    formula_cases = [(64, 8, 2, 1.25), (10, 8, 1, 1.25), (4096, 64, 2, 1.25), (100, 6, 2, 1.0), (37, 5, 3, 1.5),
                     (rng.randint(10, 500), rng.choice([4, 8, 16]), rng.randint(1, 4), rng.choice([1.0, 1.5, 2.0]))]
    for tokens, E, k, cf in formula_cases:
        case_drawn("8.2", tokens=tokens, experts=E, k=k, cf=cf)
        expected = expert_capacity(tokens, E, k, cf)
        got = capacity_fn(tokens, E, k, cf)
        if isinstance(got, bool) or not isinstance(got, numbers.Integral) and not (
                isinstance(got, float) and got.is_integer()):
            raise CheckFailed(f"expert_capacity({tokens}, {E}, {k}, {cf}) should be a whole number of slots, "
                              f"got {got!r}")
        if int(got) != expected:
            exact = cf * tokens * k / E
            hint = ""
            if int(got) == math.floor(exact):
                hint = ": round up (ceil), or the last tokens of a balanced batch are dropped"
            elif int(got) == math.ceil(cf * tokens / E):
                hint = ": each token makes k assignments, multiply by k"
            else:
                hint = (": multiply capacity_factor × tokens × k, divide by num_experts, then round up (math.ceil): "
                        "check each factor and which side of the division it is on")
            raise CheckFailed(f"expert_capacity(tokens={tokens}, num_experts={E}, k={k}, capacity_factor={cf}) = "
                              f"{got}, expected ⌈{cf}·{tokens}·{k}/{E}⌉ = {expected}{hint}")
    assign_cases = 0
    for i in range(5):
        T, E, k = rng.randint(20, 60), rng.choice([4, 6, 8]), rng.choice([1, 2, 2, 3])
        x, w = skewed_tokens(T, rng.choice([8, 16]), E, skew=0.75, seed=_seed() + 20 + i)
        experts = route(x, w, k).experts
        capacity = expert_capacity(T, E, k, rng.choice([1.0, 1.25]))
        expected = assign_capacity(experts, E, capacity)
        got = assign_fn(experts.clone(), E, capacity)
        where = f"T={T}, E={E}, k={k}, capacity={capacity} (skewed routing, {int((~expected).sum())} over capacity)"
        if not isinstance(got, torch.Tensor) or tuple(got.shape) != (T, k):
            raise CheckFailed(f"{where}: return a bool tensor of shape [T, k] = {(T, k)}, got "
                              f"{tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__}")
        got = got.bool()
        if torch.equal(got, expected):
            assign_cases += 1
            continue
        load = torch.bincount(experts[got], minlength=E)
        if (load > capacity).any():
            e = int((load > capacity).nonzero()[0])
            raise CheckFailed(f"{where}: expert {e} keeps {int(load[e])} assignments, more than its capacity")
        if capacity > 0 and torch.equal(got, assign_capacity(experts, E, capacity - 1)):
            raise CheckFailed(f"{where}: every expert kept one assignment fewer than its capacity: count arrivals "
                              f"from 0 (the first assignment at an expert is position 0, kept while position < "
                              f"capacity)")
        if k > 1 and torch.equal(got, _token_major_keep(experts, E, capacity)):
            raise CheckFailed(f"{where}: slots went in token order over all choices, so a token's second choice took "
                              f"a slot another token's first choice needed: hand out all first choices (token "
                              f"order), then all second choices, …")
        t, c = (got != expected).nonzero()[0].tolist()
        raise CheckFailed(f"{where}: token {t}'s choice {c} (expert {int(experts[t, c])}) should be "
                          f"{'kept' if expected[t, c] else 'dropped'}: priority is choice first, then token order")
    experts = torch.zeros(12, 2, dtype=torch.long)
    experts[:, 1] = 1
    got = assign_fn(experts, 4, None)
    if not isinstance(got, torch.Tensor) or not bool(got.bool().all()):
        raise CheckFailed("assign_capacity(..., capacity=None) must keep every assignment (no limit)")
    return (f"{len(formula_cases)} capacities, {assign_cases} skewed routings with drops: the same assignments kept, "
            f"first choices before second choices")


# ---------------------------------------------------------------- 8.3 losses

def _ratio(got: torch.Tensor, expected: torch.Tensor) -> float | None:
    return float(got.detach()) / float(expected.detach()) if float(expected.detach()) != 0 else None


def _losses_job(balance_fn, z_loss_fn, logits, experts, num_experts):
    """8.3 where the student's code runs: each loss, and the logits' gradient through it (None: it has none)."""
    logits = logits.detach().clone().requires_grad_(True)
    got = balance_fn(torch.softmax(logits, -1), experts, num_experts)
    differentiable = isinstance(got, torch.Tensor) and got.grad_fn is not None
    if differentiable and got.numel() == 1:
        got.backward()
    z_in = logits.detach().clone().requires_grad_(True)
    z = z_loss_fn(z_in)
    if isinstance(z, torch.Tensor) and z.numel() == 1 and z.grad_fn is not None:
        z.backward()
    return got, differentiable, logits.grad, z, z_in.grad


def check_balancing_losses(balance_fn, z_loss_fn) -> str:
    """8.3: ``load_balancing_loss(probs, experts, E)`` and ``router_z_loss(logits)``."""
    rng = random.Random(_seed() + 3)
    for i in range(4):
        T, E, k = rng.randint(16, 64), rng.choice([4, 8, 16]), [1, rng.choice([2, 3])][i] if i < 2 else rng.choice(
            [1, 2, 3])  # top-1, then top-2 or 3, then any
        g = _generator(_seed() + 30 + i)
        logits_ref = (torch.randn(T, E, generator=g) * 2).requires_grad_(True)
        logits = logits_ref.detach().clone().requires_grad_(True)
        experts = logits_ref.detach().topk(k, dim=-1).indices
        where = f"T={T}, E={E}, k={k}"
        case_drawn("8.3", k=k, experts=E)
        expected = load_balancing_loss(torch.softmax(logits_ref, -1), experts, E)
        got, got_differentiable, logits_grad, z, z_in_grad = run_isolated(_losses_job, balance_fn, z_loss_fn,
                                                                            logits, experts, E)
        if not isinstance(got, torch.Tensor) or got.numel() != 1:
            raise CheckFailed(f"{where}: load_balancing_loss should return a scalar tensor, got {got!r}")
        if not math.isclose(float(got.detach()), float(expected.detach()), rel_tol=1e-5):
            ratio = _ratio(got, expected)
            hints = {k: "f_i is the share of all T·k choices: divide the counts by T·k, not by T",
                     1 / E: "multiply by the number of experts E (so a balanced router scores 1)",
                     E: "multiply by E once, not twice"}
            hint = next((h for r, h in hints.items() if ratio is not None and math.isclose(ratio, r, rel_tol=1e-4)
                         and r != 1), "E · Σ_i f_i · P_i, f_i = share of choices, P_i = mean probability")
            raise CheckFailed(f"{where}: load_balancing_loss = {float(got.detach()):.6g}, expected "
                              f"{float(expected.detach()):.6g}: {hint}")
        expected.backward()
        if not got_differentiable:
            raise CheckFailed(f"{where}: the loss has no gradient: P_i, the mean router probability, must stay "
                              f"differentiable")
        if logits_grad is None or not is_close(logits_grad, logits_ref.grad, atol=1e-6, rtol=1e-6):
            raise CheckFailed(f"{where}: right value, wrong gradient: f_i are counts (no gradient); the gradient "
                              f"flows only through P_i = probs.mean(0)")
        z_ref = router_z_loss(logits_ref.detach().requires_grad_(True))
        if (not isinstance(z, torch.Tensor) or z.numel() != 1
                or not math.isclose(float(z.detach()), float(z_ref.detach()), rel_tol=1e-5)):
            ratio = _ratio(z, z_ref) if isinstance(z, torch.Tensor) and z.numel() == 1 else None
            hint = ("mean over tokens, not the sum" if ratio is not None and math.isclose(ratio, T, rel_tol=1e-4)
                    else "take logsumexp(logits, dim=-1) over each token's experts, square it, then the mean over "
                         "tokens: check the dim and the power")
            shown = f"{float(z.detach()):.6g}" if isinstance(z, torch.Tensor) and z.numel() == 1 else repr(z)
            raise CheckFailed(f"{where}: router_z_loss = {shown}, expected {float(z_ref.detach()):.6g}: {hint}")
        if z_in_grad is None:
            raise CheckFailed(f"{where}: router_z_loss has no gradient with respect to the logits")
    balanced = torch.full((8, 4), 0.25)
    balanced_experts = torch.arange(8).remainder(4).unsqueeze(1)
    collapsed = torch.zeros(8, 4)
    collapsed[:, 0] = 1
    for probs, experts, expected, what in ((balanced, balanced_experts, 1.0, "perfectly balanced"),
                                           (collapsed, torch.zeros(8, 1, dtype=torch.long), 4.0, "collapsed")):
        value = float(balance_fn(probs, experts, 4).detach())
        if not math.isclose(value, expected, rel_tol=1e-6):
            raise CheckFailed(f"a {what} router over 4 experts should score {expected:g}, got {value:.6g}")
    return "4 random routers (value and gradient), balanced = 1, collapsed = E; z-loss value and gradient"


# ---------------------------------------------------------------- 8.4 bias

def _simulate_bias(update_fn, steps: int = 150) -> tuple[float, float]:
    """Route the same skewed tokens again and again, nudging the bias: (imbalance before, after)."""
    x, w = skewed_tokens(256, 16, 8, skew=0.75, seed=_seed() + 40)
    bias = torch.zeros(8)
    first = None
    for _ in range(steps):
        load = torch.bincount(route(x, w, 2, bias).experts.reshape(-1), minlength=8)
        first = imbalance(load) if first is None else first
        bias = update_fn(bias.clone(), load.clone(), 2e-3)
    return first, imbalance(torch.bincount(route(x, w, 2, bias).experts.reshape(-1), minlength=8))


def check_bias_update(update_fn) -> str:
    """8.4: ``update_expert_bias(bias, load, rate)`` → the new bias."""
    rng = random.Random(_seed() + 4)
    for i in range(4):
        E = rng.choice([4, 8, 16])
        g = _generator(_seed() + 50 + i)
        bias = torch.randn(E, generator=g) * 0.01
        load = torch.randint(0, 40, (E,), generator=g)
        load[1] += (E - 1 - int(load[1:].sum()) % (E - 1)) % (E - 1)
        load[0] = int(load[1:].sum()) // (E - 1)  # exactly the mean load: sign 0, no step
        rate = rng.choice([1e-3, 2e-3, 1e-2])
        case_drawn("8.4", at_mean=int(load[0]) * len(load) == int(load.sum()), experts=E)
        expected = update_expert_bias(bias, load, rate)
        got = update_fn(bias.clone(), load.clone(), rate)
        if not isinstance(got, torch.Tensor) or got.shape != bias.shape:
            raise CheckFailed(f"return the new bias, a tensor of shape [{E}], got {got!r}")
        if is_close(got, expected, atol=1e-7, rtol=1e-7):
            continue
        mean = load.float().mean()
        where = f"E={E}, loads {load.tolist()} (mean {float(mean):g}), rate={rate}"
        if is_close(got, bias - rate * torch.sign(mean - load.float()), atol=1e-7, rtol=1e-7):
            raise CheckFailed(f"{where}: the step has the wrong sign: an overloaded expert (load > mean) must get a "
                              f"*lower* bias, so fewer tokens choose it")
        if is_close(got, bias + rate * torch.sign(load.float().sum() - load.float()), atol=1e-7, rtol=1e-7):
            raise CheckFailed(f"{where}: every bias rose, as if each expert were compared with the total load: "
                              f"compare each load with the mean load")
        if is_close(got, bias + rate * (mean - load.float()), atol=1e-7, rtol=1e-7):
            raise CheckFailed(f"{where}: the step is proportional to the error; DeepSeek-V3 moves every bias by a "
                              f"fixed rate in the direction of sign(mean load - load)")
        e = int((got - expected).abs().argmax())
        raise CheckFailed(f"{where}: expert {e} (load {int(load[e])}) got bias {float(got[e]):.6g}, expected "
                          f"{float(expected[e]):.6g}")
    before, after = _simulate_bias(update_fn)
    _, reference = _simulate_bias(update_expert_bias)  # how far 150 steps even these tokens out (seed-dependent)
    if not after < before or after > reference * 1.05:
        raise CheckFailed(f"routing the same skewed tokens 150 times with your update left the busiest expert at "
                          f"{after:.2f}x the mean load (it started at {before:.2f}x, the reference update brings it "
                          f"to {reference:.2f}x): the bias should even it out")
    return f"4 updates exact; 150 simulated steps bring the busiest expert from {before:.2f}x to {after:.2f}x the mean"


# ---------------------------------------------------------------- 8.5 the layer on one device

def _layer_case(i: int, T: int, d: int, E: int, shared: bool):
    x, w = skewed_tokens(T, d, E, skew=0.5, seed=_seed() + 60 + i)
    experts = make_experts(d, 2, range(E), seed=_seed() + i, std=0.3)
    shared_expert = make_experts(d, 2, [-1], seed=_seed() + i, std=0.3)[0] if shared else None
    return x, w, experts, shared_expert


def _grads(*modules_or_tensors) -> list[torch.Tensor]:
    out = []
    for item in modules_or_tensors:
        if item is None:
            continue
        tensors = list(item.parameters()) if isinstance(item, torch.nn.Module) else [item]
        out += [t.grad if t.grad is not None else torch.zeros_like(t) for t in tensors]
    return out


def _layer_job(moe_fn, x, w, experts, k, cf, shared_expert, cotangent):
    """8.5 where the student's code runs: the layer's output, and every gradient through it for ``cotangent`` (x,
    the router weight, the experts', the shared expert's; None when the output carries none)."""
    x_in, w_in = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    got = moe_fn(x_in, w_in, experts, k, cf, shared_expert)
    if not (isinstance(got, torch.Tensor) and got.grad_fn is not None and tuple(got.shape) == tuple(cotangent.shape)):
        return got, None
    (got * cotangent).sum().backward()
    return got, _grads(x_in, w_in, experts, shared_expert)


def check_moe_layer(moe_fn) -> str:
    """8.5: ``moe_layer(x, router_weight, experts, k, capacity_factor=None, shared=None)`` → [T, d].

    The layer calls the notebook's ``route``, ``expert_capacity`` and ``assign_capacity``: it runs on distlab's
    versions of them, so a mistake in 8.1 or 8.2 fails only those checks."""
    moe_fn = with_reference(moe_fn, route=route, expert_capacity=expert_capacity, assign_capacity=assign_capacity)
    cases = [(24, 8, 4, 1, None, False), (40, 12, 6, 2, 1.0, True), (48, 16, 8, 2, 1.25, False),
             (30, 8, 6, 3, None, True)]
    for i, (T, d, E, k, cf, shared) in enumerate(cases):
        x, w, experts, shared_expert = _layer_case(i, T, d, E, shared)
        where = (f"T={T}, d={d}, E={E}, k={k}, capacity_factor={cf}" + (", shared expert" if shared else ""))
        case_drawn("8.5", k=k, cf=cf, shared=shared)
        x_ref, w_ref = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        ref_experts, ref_shared = _layer_case(i, T, d, E, shared)[2:]
        expected, result = moe_forward(x_ref, w_ref, ref_experts, k, cf, ref_shared)
        cotangent = torch.randn(T, d, generator=_generator(_seed() + 70 + i))
        got, grads = run_isolated(_layer_job, moe_fn, x, w, experts, k, cf, shared_expert, cotangent)
        if not isinstance(got, torch.Tensor) or tuple(got.shape) != (T, d):
            raise CheckFailed(f"{where}: return the layer output, shape [T, d] = {(T, d)}, got "
                              f"{tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__}")
        if not is_close(got, expected, rtol=ATOL):
            raise CheckFailed(f"{where}: {_diagnose_layer(got, expected, x, w, k, cf, shared, i, result)}")
        (expected * cotangent).sum().backward()
        if grads is None or not grads[1].any():
            raise CheckFailed(f"{where}: the output matches, but the router weight got no gradient: keep the gates in "
                              f"the autograd graph (index routing.gates, never .detach() or .item() them)")
        names = ["x", "router weight"] + [f"experts.{name}" for name, _ in experts.named_parameters()]
        names += [f"shared.{name}" for name, _ in shared_expert.named_parameters()] if shared else []
        for name, a, b in zip(names, grads, _grads(x_ref, w_ref, ref_experts, ref_shared)):
            if not is_close(a, b, rtol=ATOL):
                raise CheckFailed(f"{where}: the gradient of {name} differs by up to {max_difference(a, b)[0]:.3g}: "
                                  f"the output matches, so something is detached (the gates? the expert outputs?)")
    return (f"{len(cases)} cases: k = 1-3, capacity limits with drops, shared expert; output and every gradient "
            f"(run on distlab's route and capacity, so 8.1 and 8.2 do not count here)")


def _diagnose_layer(got, expected, x, w, k, cf, shared, i, result) -> str:
    _, _, experts, shared_expert = _layer_case(i, *x.shape, w.shape[0], shared)
    with torch.no_grad():
        variants = {"no capacity limit": moe_forward(x, w, experts, k, None, shared_expert)[0],
                    "no shared expert": moe_forward(x, w, experts, k, cf, None)[0]}
    got = got.detach()
    if cf is not None and is_close(got, variants["no capacity limit"], rtol=ATOL):
        return (f"every assignment was computed, but capacity is {result.capacity} per expert and "
                f"{result.dropped} assignments are over it: drop them (their tokens keep only the residual)")
    if shared and is_close(got, variants["no shared expert"], rtol=ATOL):
        return "the output lacks the shared expert: add shared(x) for every token"
    rows = (got - expected).abs().amax(-1)
    t = int(rows.argmax())
    dropped = (~result.keep[t]).any().item()
    return (f"token {t} (experts {result.routing.experts[t].tolist()}, gates "
            f"{[round(v, 3) for v in result.routing.gates[t].tolist()]}"
            f"{', some choices over capacity' if dropped else ''}) differs by {float(rows[t]):.3g}: its output is "
            f"Σ gate · expert(x) over its kept choices" + (" + shared(x)" if shared else ""))


# ---------------------------------------------------------------- 8.6 expert parallelism on ranks

@dataclass
class EPCase:
    world_size: int
    num_experts: int
    k: int
    tokens: list[int]  # tokens on each rank
    d_model: int = 12
    capacity_factor: float | None = None
    all_to_one: bool = False  # every token prefers expert 0: ranks 1.. receive nothing
    seed: int = 0
    # The lab's seed, drawn where the case is made: a rank reads its environment from the process it was forked
    # from, not the grader's seed the kernel was given, so it takes the seed with the case.
    lab_seed: int = field(default_factory=_seed)

    def __str__(self) -> str:
        bits = [f"world_size={self.world_size}", f"E={self.num_experts}", f"k={self.k}",
                f"tokens per rank {self.tokens}"]
        if self.capacity_factor is not None:
            bits.append(f"capacity_factor={self.capacity_factor}")
        if self.all_to_one:
            bits.append("every token routed to expert 0")
        return ", ".join(bits)

    def inputs(self, rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(x, router weight, output cotangent) of ``rank``; the same on every process."""
        x, w = skewed_tokens(self.tokens[rank], self.d_model, self.num_experts, skew=0.25, seed=self.seed, rank=rank)
        if self.all_to_one:
            x, w[0] = x.abs(), 5.0 / math.sqrt(self.d_model)  # positive features: expert 0 is everyone's choice
        cotangent = torch.randn(x.shape, generator=_generator(self.lab_seed + 100 * self.seed + rank))
        return x, w, cotangent

    def experts(self, ids) -> torch.nn.ModuleList:
        return make_experts(self.d_model, 2, ids, seed=self.seed, std=0.3)


def _ep_worker(ep_fn, case: EPCase) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    x, w, cotangent = case.inputs(rank)
    x, w = x.requires_grad_(True), w.requires_grad_(True)
    ids = local_expert_ids(case.num_experts, rank, world)
    local = case.experts(ids)
    routing = route(x, w, case.k)
    capacity = None if case.capacity_factor is None else expert_capacity(x.shape[0], case.num_experts, case.k,
                                                                         case.capacity_factor)
    keep = assign_capacity(routing.experts, case.num_experts, capacity)
    y = ep_fn(x, routing, keep, local)
    if not isinstance(y, torch.Tensor) or y.shape != x.shape:
        raise TypeError(f"expert_parallel returned {tuple(y.shape) if isinstance(y, torch.Tensor) else type(y)}, "
                        f"expected a tensor shaped like x, {tuple(x.shape)}")
    (y * cotangent).sum().backward()
    return {"y": y.detach(), "x_grad": x.grad, "w_grad": w.grad,
            "expert_grads": {i: [p.grad for p in local[j].parameters()] for j, i in enumerate(ids)},
            "kept_per_expert": torch.bincount(routing.experts[keep], minlength=case.num_experts)}


def _reference(case: EPCase) -> tuple[list[dict], torch.Tensor, torch.nn.ModuleList]:
    experts = case.experts(range(case.num_experts))
    w = case.inputs(0)[1].clone().requires_grad_(True)
    out = []
    for r in range(case.world_size):
        x, _, cotangent = case.inputs(r)
        x = x.clone().requires_grad_(True)
        y, result = moe_forward(x, w, experts, case.k, case.capacity_factor)
        (y * cotangent).sum().backward()
        with torch.no_grad():  # the same rows added without their gates: the usual combine mistake
            plan = dispatch_plan(result.routing, result.keep)
            ungated = torch.zeros_like(x).index_add(0, plan.token, run_experts(experts, x[plan.token],
                                                                               plan.counts.tolist()))
        out.append({"y": y.detach(), "x_grad": x.grad, "result": result, "ungated": ungated})
    return out, w.grad, experts


def _compare_ep(run, case: EPCase) -> None:
    reference, w_grad, experts = _reference(case)
    for rank, (got, ref) in enumerate(zip(run, reference)):
        if not is_close(got["y"], ref["y"], rtol=ATOL) and is_close(got["y"], ref["ungated"], rtol=ATOL):
            raise CheckFailed(f"{case}: rank {rank}'s output is the sum of its tokens' expert outputs without the "
                              f"gates: weight them by their gates (routing.gates[token, choice]) before index_add")
        if not is_close(got["y"], ref["y"], rtol=ATOL):
            rows = (got["y"] - ref["y"]).abs().amax(-1)
            t = int(rows.argmax())
            chosen = ref["result"].routing.experts[t].tolist()
            owners = [e // (case.num_experts // case.world_size) for e in chosen]
            remote = any(o != rank for o in owners)
            hint = (" — it went to experts on other ranks: check the dispatch order (sorted by expert, so by "
                    "destination rank) and that the combine uses the dispatch's splits swapped" if remote else
                    ": its experts live on this rank, so check the regrouping by local expert and the gates")
            raise CheckFailed(f"{case}: rank {rank}'s output for token {t} (experts {chosen}, on ranks {owners}) "
                              f"differs from the single-device layer by {float(rows[t]):.3g}{hint}")
        if got["x_grad"] is None or not is_close(got["x_grad"], ref["x_grad"], rtol=ATOL):
            by = max_difference(got["x_grad"], ref["x_grad"])[0] if got["x_grad"] is not None else "all"
            raise CheckFailed(f"{case}: rank {rank}'s gradient of x differs from the single-device layer by {by}: "
                              f"send the tokens with distlab.moe.all_to_all (differentiable) so gradients travel "
                              f"back to the rank each token came from")
    router_grad = sum(r["w_grad"] for r in run)
    if not is_close(router_grad, w_grad, rtol=ATOL):
        raise CheckFailed(f"{case}: the router's gradient (summed over ranks) differs by "
                          f"{max_difference(router_grad, w_grad)[0]:.3g}: keep the gates in the autograd graph")
    for rank, got in enumerate(run):
        for i, grads in got["expert_grads"].items():
            for (name, p), g in zip(experts[i].named_parameters(), grads):
                if g is None or not is_close(g, p.grad, rtol=ATOL):
                    raise CheckFailed(
                        f"{case}: expert {i}'s {name} gradient on rank {rank} (its owner) differs from the single-"
                        f"device layer by {max_difference(g, p.grad)[0] if g is not None else 'all (None)'}: it must "
                        f"collect the gradients of every rank's tokens, which come back through the combine's "
                        f"backward all-to-all")


def _check_traffic(run, case: EPCase) -> None:
    """Each kept (token, expert) pair crosses once each way: dispatch and combine, forward and backward."""
    per_rank = case.num_experts // case.world_size
    arriving = sum(r["kept_per_expert"] for r in run).view(case.world_size, per_rank).sum(1)
    for rank, (log, got) in enumerate(zip(run.comm, run)):
        kept, received = int(got["kept_per_expert"].sum()), int(arriving[rank])
        expected = 2 * (kept + received) * case.d_model * 4
        a2a = log.ops.get("all_to_all_single")
        payload = a2a.payload_bytes if a2a else 0
        if not expected <= payload <= expected + _SMALL:
            raise CheckFailed(
                f"{case}: rank {rank} moved {payload:,} bytes through all_to_all_single (forward and backward); "
                f"its {kept} kept assignments out, the {received} that arrive for its experts back, both ways, "
                f"are {expected:,} bytes: send each kept (token, expert) pair once, only to the expert's rank")
        for op, stats in log.ops.items():
            if op not in ("all_to_all_single", "barrier") and stats.payload_bytes > _SMALL:
                raise CheckFailed(f"{case}: rank {rank} moved {stats.payload_bytes:,} bytes with {op}: tokens travel "
                                  f"by all-to-all only (expert parallelism never gathers every token everywhere)")


def _named_split_error(error: RankFailed, case: EPCase) -> str | None:
    """torch's error for split sizes that do not fit the tensor, said in the lab's terms (or None)."""
    text = str(error)
    if "Number of tensor splits not equal to group size" in text:
        return (f"{case}: rank {error.rank}'s all-to-all got one split size per expert ({case.num_experts}) where it "
                f"needs one split per destination rank ({case.world_size}), not per expert: input_splits[j] is the "
                f"sum of your counts over rank j's experts (torch: {first_line(error).split(': ', 1)[-1]})")
    if "Split sizes doesn't match total dim 0 size" in text or "split sizes" in text.lower():
        return (f"{case}: rank {error.rank}'s all-to-all got split sizes that do not add up to the rows it was "
                f"given (torch: {first_line(error).split(': ', 1)[-1]}). all_to_all(rows, output_splits, "
                f"input_splits): input_splits[j] = the rows you send to rank j (one split per destination rank "
                f"({case.world_size}), not per expert: sum your counts over j's experts), output_splits[j] = the "
                f"rows rank j sends you (from the exchanged counts); the combine uses the same two lists with "
                f"input and output splits swapped")
    return None


def check_expert_parallel(ep_fn) -> str:
    """8.6: ``expert_parallel(x, routing, keep, local_experts)`` on real ranks → this rank's routed output."""
    cases = [EPCase(2, 4, 2, [20, 13], seed=_seed() + 81),
             EPCase(4, 8, 2, [18, 24, 9, 30], capacity_factor=1.0, seed=_seed() + 82),
             EPCase(4, 4, 1, [16, 12, 20, 8], all_to_one=True, seed=_seed() + 83),
             EPCase(4, 8, 3, [14, 1, 22, 17], capacity_factor=1.25, seed=_seed() + 84)]
    for case in cases:
        case_drawn("8.6", world=case.world_size, k=case.k, cf=case.capacity_factor, all_to_one=case.all_to_one,
                   tokens=case.tokens)
        try:
            run = run_on_ranks(_ep_worker, case.world_size, ep_fn, case, what=f"your expert-parallel layer ({case})",
                               advice="Every rank must make the same all-to-all calls in the same order — also a "
                                      "rank with no token to send or receive.")
        except RankFailed as error:
            named = _named_split_error(error, case)
            if named is None:
                raise
            raise CheckFailed(named) from None
        _compare_ep(run, case)
        _check_traffic(run, case)
    return (f"{len(cases)} cases on 2/4 ranks (uneven tokens, capacity drops, a rank that receives nothing): "
            f"outputs and gradients equal the single-device layer, each token sent once")


# ---------------------------------------------------------------- quiz

# Why a question whose numbers could change keeps them: a student is shown their numbers through the title.
_NUMBERS_NOT_IN_TITLE = "its title names none of its numbers (the chapter's text does), so it could not show a " \
    "student other ones"
_DSV3_DISPATCH_MB = all_to_all_bytes(4096, DEEPSEEK_V3.k, DEEPSEEK_V3.d_model, 64)["payload_per_all_to_all"] / 1e6

# The boundaries each exercise's text names (harness.Edge; tests/grading/test_reference_seeds.py checks every seed's
# cases hold each): top-1 (gate 1) and top-k, with and without a selection bias; capacities exact and rounded up,
# capacity factors 1 and above; a load exactly at the mean (sign 0: no step); no capacity limit, a limit, a shared
# expert; expert parallelism on 2 and 4 ranks, uneven tokens, drops, a rank that receives nothing.
EDGES = {
    "8.1": [Edge("top-1", lambda c: c["k"] == 1), Edge("top-k, k > 1", lambda c: c["k"] > 1),
            Edge("a selection bias", lambda c: c["bias"]), Edge("no bias", lambda c: not c["bias"]),
            Edge("k = the number of experts", lambda c: c["k"] == c["experts"]),
            Edge("bf16 x and weight (the softmax in fp32)", lambda c: c.get("bf16", False))],
    "8.2": [Edge("capacity rounded up", lambda c: c["cf"] * c["tokens"] * c["k"] % c["experts"] != 0),
            Edge("capacity exact", lambda c: c["cf"] * c["tokens"] * c["k"] % c["experts"] == 0),
            Edge("capacity factor 1.0", lambda c: c["cf"] == 1.0), Edge("k = 1", lambda c: c["k"] == 1)],
    "8.3": [Edge("top-1", lambda c: c["k"] == 1), Edge("top-k, k > 1", lambda c: c["k"] > 1)],
    "8.4": [Edge("a load exactly at the mean", lambda c: c["at_mean"])],
    "8.5": [Edge("no capacity limit", lambda c: c["cf"] is None), Edge("a capacity limit", lambda c: c["cf"]),
            Edge("a shared expert", lambda c: c["shared"]), Edge("top-1", lambda c: c["k"] == 1)],
    "8.6": [Edge("2 ranks", lambda c: c["world"] == 2), Edge("4 ranks", lambda c: c["world"] == 4),
            Edge("a rank that receives nothing", lambda c: c["all_to_one"]),
            Edge("capacity drops", lambda c: c["cf"] is not None),
            Edge("uneven tokens per rank", lambda c: len(set(c["tokens"])) > 1)],
}

# Surviving mutants of the solution cells that change nothing the exercises ask for (distlab notebooks
# mutants): key, as benchmarks/results/mutants.txt names it → why it is equivalent.
EQUIVALENT_MUTANTS = {
    '8.1 arithmetic: `-1` → `(1)`':
        'the tensor is 2-D ([tokens, experts] or [tokens, k]), so dim 1 is dim -1',
    '8.1 arithmetic: `-1` → `(1)` #2':
        'the tensor is 2-D ([tokens, experts] or [tokens, k]), so dim 1 is dim -1',
    '8.1 arithmetic: `-1` → `(1)` #3':
        'the tensor is 2-D ([tokens, experts] or [tokens, k]), so dim 1 is dim -1',
    '8.1 arithmetic: `-1` → `(1)` #4':
        'the tensor is 2-D ([tokens, experts] or [tokens, k]), so dim 1 is dim -1',
    '8.1 statements-swapped: `if not 1 <= k <= num_experts: raise ValueError(f"k={k} experts per to…` → `logits = x '
    '@ weight.t() if not 1 <= k <= num_experts: raise ValueErro…`':
        'the logits are computed before the check on k instead of after: the same ValueError for a bad k, the same '
        'result otherwise',
    '8.2 arithmetic: `-1` → `(1)` #2':
        'one_hot is 2-D [T·k, experts], so dim 1 is dim -1',
    '8.2 statements-swapped: `if capacity is None: return torch.ones_like(experts, dtype=torch.bool…` → '
    '`choice_major = experts.t().reshape(-1) if capacity is None: return to…`':
        "two statements that do not read each other's names, in the other order",
    '8.3 call-removed: `logits.float()` → `logits`':
        "the lab's router logits are fp32 (all tensors fp32, the notebook says), where .float() is the identity; the "
        "exercise asks for the z-loss's formula and names no precision for it (unlike 8.1's softmax, whose fp32 a "
        "bf16 case checks)",
    '8.3 arithmetic: `-1` → `(1)` #2':
        'the logits are 2-D [tokens, experts], so dim 1 is dim -1',
    '8.5 arguments-swapped: `expert_capacity(x.shape[0], num_experts, k, capacity_factor)` → '
    '`expert_capacity(x.shape[0], num_experts, capacity_factor, k)`':
        'the capacity ⌈capacity_factor · tokens · k / experts⌉ is symmetric in k and capacity_factor',
    '8.5 arithmetic: `-1` → `(1)`':
        'the gates picked are 1-D, so unsqueeze(1) is unsqueeze(-1)',
    '8.5 off-by-one: `order` → `(order) - 1` #3':
        'after this line expert is only counted (bincount): a rotated order of the same experts gives the same counts',
    '8.5 statements-swapped: `num_experts = len(experts) routing = route(x, router_weight, k)` → `routing = route(x, '
    'router_weight, k) num_experts = len(experts)`':
        "two statements that do not read each other's names, in the other order",
    '8.5 statements-swapped: `routing = route(x, router_weight, k) capacity = None if capacity_fact…` → `capacity = '
    'None if capacity_factor is None else expert_capacity(x.sha…`':
        "two statements that do not read each other's names, in the other order",
    '8.6 arithmetic: `-1` → `(1)` #2':
        'the gates picked are 1-D, so unsqueeze(1) is unsqueeze(-1)',
    '8.6 statements-swapped: `input_splits = send_counts.view(world, per_rank).sum(1).tolist() outp…` → '
    '`output_splits = recv_counts.sum(1).tolist() input_splits = send_count…`':
        "two statements that do not read each other's names, in the other order",
    '8.6 statements-swapped: `per_rank = num_experts // world token, choice = keep.nonzero(as_tuple…` → `token, '
    'choice = keep.nonzero(as_tuple=True) per_rank = num_experts //…`':
        "two statements that do not read each other's names, in the other order",
    '8.6 statements-swapped: `received = all_to_all(x[token], output_splits, input_splits) local_ex…` → '
    '`local_expert = torch.repeat_interleave(torch.arange(per_rank, device=…`':
        "two statements that do not read each other's names, in the other order",
}

EXERCISES = [
    Exercise("8.1", "router: softmax, top-k, gates", 2, check_router,
             references=("distlab.moe.routing.route",)),
    Exercise("8.2", "expert capacity and dropped tokens", 2, check_capacity,
             references=("distlab.moe.routing.assign_capacity", "distlab.moe.routing.expert_capacity")),
    Exercise("8.3", "Switch load-balancing loss and router z-loss", 2, check_balancing_losses,
             references=("distlab.moe.routing.load_balancing_loss", "distlab.moe.routing.router_z_loss")),
    Exercise("8.4", "auxiliary-loss-free bias balancing", 2, check_bias_update,
             references=("distlab.moe.routing.update_expert_bias",)),
    Exercise("8.5", "one-device MoE layer with a shared expert", 3, check_moe_layer,
             references=("distlab.moe.layer.moe_forward",)),
    Exercise("8.6", "expert parallelism with all-to-all", 4, check_expert_parallel,
             references=("distlab.moe.layer.expert_parallel_forward",)),
    quiz.number("Q8.1", "capacity of one expert", answer=expert_capacity(4096, 64, 2, 1.25), rel_tol=0, abs_tol=0.01,
                wrong={"top-k left out (k = 1)": expert_capacity(4096, 64, 1, 1.25),
                       "the capacity factor left out": expert_capacity(4096, 64, 2, 1.0)},
                hint="see 'Capacity and dropped tokens' (the chapter's section 3)",
                fixed=_NUMBERS_NOT_IN_TITLE),
    quiz.number("Q8.2", "Switch loss of a collapsed router", answer=16.0, rel_tol=0, abs_tol=0.01,
                wrong={"uniform routing's value": 1.0, "E²: the factor E counted twice": 256.0},
                hint="see 'Balancing the load' (the chapter's section 4): what f and P are when one expert gets "
                     "everything",
                fixed=_NUMBERS_NOT_IN_TITLE),
    quiz.choice("Q8.3", "what the bias of an overloaded expert does", answer="b", options="abcd",
                hint="see 'Auxiliary-loss-free balancing' (the chapter's section 5): the update rule for b_i"),
    # rel_tol 0.005: the bytes that leave the GPU, 63/64 of the payload, are 1.6% below it
    quiz.number("Q8.4", "DeepSeek-V3 dispatch MB per GPU", answer=_DSV3_DISPATCH_MB, rel_tol=0.005,
                wrong={"the bytes that leave the GPU (x 63/64), not the payload": _DSV3_DISPATCH_MB * 63 / 64,
                       "MiB, not MB": _DSV3_DISPATCH_MB * 1e6 / 2**20,
                       "FP8 dispatch (1 byte per value), not bf16": _DSV3_DISPATCH_MB / 2,
                       "k left out: one copy per token": _DSV3_DISPATCH_MB / DEEPSEEK_V3.k,
                       "the four all-to-alls of a step": 4 * _DSV3_DISPATCH_MB},
                hint="see 'All-to-all bytes per layer, counted' and 'DeepSeek-V3 at scale' (the chapter's sections 8 "
                     "and 9)",
                fixed=_NUMBERS_NOT_IN_TITLE),
    quiz.choice("Q8.5", "why MoE routing is expensive at scale", answer="c", options="abcd",
                hint="see 'All-to-all bytes per layer, counted' and 'DeepSeek-V3 at scale' (the chapter's sections 8 "
                     "and 9)"),
    # whole numbers, so no tolerance; no EP = 32, where the answer is k = 8
    quiz.number("Q8.6", "routed experts per GPU, DeepSeek-V3 at EP = {ep}", rel_tol=0, given=dict(ep=64),
                vary=dict(ep=(8, 16, 128, 256)), solve=lambda ep: DEEPSEEK_V3.routed_experts / ep,
                wrong={"the shared expert counted too": lambda ep: (DEEPSEEK_V3.routed_experts + 1) / ep,
                       "the experts a token uses, k": lambda ep: DEEPSEEK_V3.k},
                hint="see 'Edge cases that are errors' and 'DeepSeek-V3 at scale' (the chapter's section 9)"),
]
