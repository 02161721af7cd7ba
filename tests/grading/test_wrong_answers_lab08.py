"""Lab 08: answers students plausibly write, each run through its checker: every one fails, naming the mistake.

The right answers are the solution notebook's own code, executed into one namespace as in a kernel, so the
one-device layer (8.5) calls the student's router and capacity (8.1, 8.2) by their notebook names. A wrong
answer replaces one name there; the layer must still pass (its checker runs on distlab's router and capacity).
"""

import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import distlab
from distlab.moe import Routing, all_to_all, assign_capacity, exchange_counts, expert_capacity, route, run_experts
from wrong_answers import checker_tests, solution_namespace

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_thread")]

NOTEBOOK = Path(__file__).resolve().parents[2] / "solutions" / "08_moe.ipynb"


SOLUTION = solution_namespace("08_moe.ipynb", 8)
ANSWERS = {"8.1": ("route",), "8.2": ("expert_capacity", "assign_capacity"),
           "8.3": ("load_balancing_loss", "router_z_loss"), "8.4": ("update_expert_bias",), "8.5": ("moe_layer",),
           "8.6": ("expert_parallel",)}


def answer(exercise: str, namespace: dict) -> list:
    return [namespace[name] for name in ANSWERS[exercise]]


# ---------------------------------------------------------------- wrong answers, one small function each

def route_raw_gates(x, weight, k, bias=None):
    """8.1: the k chosen probabilities, not renormalised (k > 1)."""
    probs = torch.softmax((x @ weight.t()).float(), dim=-1)
    experts = (probs if bias is None else probs + bias).topk(k, dim=-1).indices
    return Routing(x @ weight.t(), probs, experts, probs.gather(-1, experts))


def route_always_renormalised(x, weight, k, bias=None):
    """8.1: gates renormalised for k = 1 too (every gate 1.0: the router gets no gradient)."""
    r = route_raw_gates(x, weight, k, bias)
    return Routing(r.logits, r.probs, r.experts, r.gates / r.gates.sum(-1, keepdim=True))


def route_bias_in_gates(x, weight, k, bias=None):
    """8.1: the gates gathered from probs + bias."""
    r = SOLUTION["route"](x, weight, k, bias)
    if bias is None:
        return r
    scores = r.probs + bias
    gates = scores.gather(-1, r.experts)
    return Routing(r.logits, r.probs, r.experts, gates / gates.sum(-1, keepdim=True) if k > 1 else gates)


def route_softmax_over_tokens(x, weight, k, bias=None):
    """8.1: softmax over the tokens (dim=0) instead of the experts."""
    logits = x @ weight.t()
    probs = torch.softmax(logits.float(), dim=0)
    experts = (probs if bias is None else probs + bias).topk(k, dim=-1).indices
    gates = probs.gather(-1, experts)
    return Routing(logits, probs, experts, gates / gates.sum(-1, keepdim=True) if k > 1 else gates)


def route_softmax_in_input_dtype(x, weight, k, bias=None):
    """8.1: the softmax of bf16 logits in bf16, not fp32."""
    logits = x @ weight.t()
    probs = torch.softmax(logits, dim=-1)
    experts = (probs if bias is None else probs + bias).topk(k, dim=-1).indices
    gates = probs.gather(-1, experts)
    return Routing(logits, probs, experts, gates / gates.sum(-1, keepdim=True) if k > 1 else gates)


def route_k_one_rejected(x, weight, k, bias=None):
    """8.1: the check on k written 1 < k: a valid top-1 router raises."""
    if not 1 < k <= weight.shape[0]:
        raise ValueError(f"k={k} experts per token, but the router has {weight.shape[0]} experts")
    return route(x, weight, k, bias)


def route_no_k_check(x, weight, k, bias=None):
    """8.1: k larger than the number of experts is not rejected (topk raises its own RuntimeError)."""
    probs = torch.softmax((x @ weight.t()).float(), dim=-1)
    experts = (probs if bias is None else probs + bias).topk(min(k, weight.shape[0]), dim=-1).indices
    gates = probs.gather(-1, experts)
    return Routing(x @ weight.t(), probs, experts, gates / gates.sum(-1, keepdim=True) if k > 1 else gates)


def route_k_below_experts(x, weight, k, bias=None):
    """8.1: `1 <= k < num_experts`: routing every token to all experts is refused."""
    if not 1 <= k < weight.shape[0]:
        raise ValueError(f"k={k} experts per token, but the router has {weight.shape[0]} experts")
    return SOLUTION["route"](x, weight, k, bias)


def route_k_zero_accepted(x, weight, k, bias=None):
    """8.1: only k > experts is checked: k = 0 routes every token nowhere."""
    if k > weight.shape[0]:
        raise ValueError(f"k={k} experts per token, but the router has {weight.shape[0]} experts")
    return SOLUTION["route"](x, weight, max(k, 1), bias)


def capacity_floor(tokens, num_experts, k, capacity_factor):
    """8.2: rounded down."""
    return math.floor(capacity_factor * tokens * k / num_experts)


def capacity_without_k(tokens, num_experts, k, capacity_factor):
    """8.2: forgot that each token makes k assignments."""
    return math.ceil(capacity_factor * tokens / num_experts)


def assign_token_major(experts, num_experts, capacity):
    """8.2: slots in token order over all choices (a token's second choice before the next token's first)."""
    if capacity is None:
        return torch.ones_like(experts, dtype=torch.bool)
    one_hot = torch.nn.functional.one_hot(experts.reshape(-1), num_experts)
    return ((one_hot.cumsum(0) * one_hot).sum(-1) - 1 < capacity).view_as(experts)


def assign_off_by_one(experts, num_experts, capacity):
    """8.2: arrival positions counted from 1, compared with <, so each expert keeps one assignment too few."""
    if capacity is None:
        return torch.ones_like(experts, dtype=torch.bool)
    one_hot = torch.nn.functional.one_hot(experts.t().reshape(-1), num_experts)
    position = (one_hot.cumsum(0) * one_hot).sum(-1)
    return (position < capacity).view(experts.shape[1], experts.shape[0]).t()


def balance_divided_by_tokens(probs, experts, num_experts):
    """8.3: f_i divided by T instead of T·k."""
    counts = torch.bincount(experts.reshape(-1), minlength=num_experts).to(probs.dtype)
    return num_experts * (counts / experts.shape[0] * probs.mean(0)).sum()


def balance_without_e(probs, experts, num_experts):
    """8.3: forgot the factor E."""
    return SOLUTION["load_balancing_loss"](probs, experts, num_experts) / num_experts


def z_loss_summed(logits):
    """8.3: the sum over tokens instead of the mean."""
    return torch.logsumexp(logits.float(), dim=-1).pow(2).sum()


def balance_detached_probs(probs, experts, num_experts):
    """8.3: P_i taken from detached probabilities (the loss then has no gradient)."""
    counts = torch.bincount(experts.reshape(-1), minlength=num_experts).to(probs.dtype)
    return num_experts * (counts / experts.numel() * probs.detach().mean(0)).sum()


def bias_wrong_sign(bias, load, rate):
    """8.4: an overloaded expert's bias goes up."""
    return bias + rate * torch.sign(load.to(bias.dtype) - load.to(bias.dtype).mean())


def bias_proportional(bias, load, rate):
    """8.4: a step proportional to the error instead of its sign."""
    load = load.to(bias.dtype)
    return bias + rate * (load.mean() - load)


def bias_against_total(bias, load, rate):
    """8.4: compares each load with the total instead of the mean (every expert is 'underloaded')."""
    load = load.to(bias.dtype)
    return bias + rate * torch.sign(load.sum() - load)


def moe_layer_no_capacity(x, router_weight, experts, k, capacity_factor=None, shared=None):
    """8.5: the capacity is never applied."""
    return SOLUTION["moe_layer"](x, router_weight, experts, k, None, shared)


def moe_layer_no_shared(x, router_weight, experts, k, capacity_factor=None, shared=None):
    """8.5: the shared expert is left out."""
    return SOLUTION["moe_layer"](x, router_weight, experts, k, capacity_factor, None)


def moe_layer_detached_gates(x, router_weight, experts, k, capacity_factor=None, shared=None):
    """8.5: the gates detached (as if read with .item()): the output is right, the router never learns."""
    routing = route(x, router_weight, k)
    capacity = None if capacity_factor is None else expert_capacity(x.shape[0], len(experts), k, capacity_factor)
    keep = assign_capacity(routing.experts, len(experts), capacity)
    token, choice = keep.nonzero(as_tuple=True)
    expert = routing.experts[token, choice]
    order = torch.argsort(expert, stable=True)
    token, choice, expert = token[order], choice[order], expert[order]
    out = run_experts(experts, x[token], torch.bincount(expert, minlength=len(experts)).tolist())
    y = torch.zeros_like(x).index_add(0, token, out * routing.gates[token, choice].detach().unsqueeze(-1))
    return y + shared(x) if shared is not None else y


def _plan(x, routing, keep):
    world, num_experts = dist.get_world_size(), routing.probs.shape[1]
    token, choice = keep.nonzero(as_tuple=True)
    expert = routing.experts[token, choice]
    order = torch.argsort(expert, stable=True)
    token, choice, expert = token[order], choice[order], expert[order]
    send_counts = torch.bincount(expert, minlength=num_experts)
    recv_counts = exchange_counts(send_counts)
    return world, num_experts // world, token, choice, send_counts, recv_counts


def ep_swapped_splits(x, routing, keep, local_experts):
    """8.6: the dispatch with input and output splits swapped."""
    world, per_rank, token, choice, send_counts, recv_counts = _plan(x, routing, keep)
    input_splits = send_counts.view(world, per_rank).sum(1).tolist()
    output_splits = recv_counts.sum(1).tolist()
    received = all_to_all(x[token], input_splits, output_splits)
    out = run_experts(local_experts, received, recv_counts.sum(0).tolist())
    returned = all_to_all(out, output_splits, input_splits)
    return torch.zeros_like(x).index_add(0, token, returned * routing.gates[token, choice].unsqueeze(-1))


def ep_per_expert_splits(x, routing, keep, local_experts):
    """8.6: split sizes per expert (E of them) instead of per destination rank (N)."""
    world, per_rank, token, choice, send_counts, recv_counts = _plan(x, routing, keep)
    received = all_to_all(x[token], recv_counts.reshape(-1).tolist(), send_counts.tolist())
    out = run_experts(local_experts, received, recv_counts.sum(0).tolist())
    returned = all_to_all(out, send_counts.tolist(), recv_counts.reshape(-1).tolist())
    return torch.zeros_like(x).index_add(0, token, returned * routing.gates[token, choice].unsqueeze(-1))


def ep_unsorted(x, routing, keep, local_experts):
    """8.6: dispatch in token order, not sorted by expert (so rows go to the wrong ranks)."""
    world, num_experts = dist.get_world_size(), routing.probs.shape[1]
    per_rank = num_experts // world
    token, choice = keep.nonzero(as_tuple=True)
    expert = routing.experts[token, choice]
    send_counts = torch.bincount(expert, minlength=num_experts)
    recv_counts = exchange_counts(send_counts)
    input_splits, output_splits = send_counts.view(world, per_rank).sum(1).tolist(), recv_counts.sum(1).tolist()
    received = all_to_all(x[token], output_splits, input_splits)
    local_expert = torch.repeat_interleave(torch.arange(per_rank).repeat(world), recv_counts.reshape(-1))
    by_expert = torch.argsort(local_expert, stable=True)
    out = run_experts(local_experts, received[by_expert], recv_counts.sum(0).tolist())
    back = torch.empty_like(out).index_copy(0, by_expert, out)
    returned = all_to_all(back, input_splits, output_splits)
    return torch.zeros_like(x).index_add(0, token, returned * routing.gates[token, choice].unsqueeze(-1))


def ep_no_gates(x, routing, keep, local_experts):
    """8.6: the returned rows added without their gates."""
    world, per_rank, token, choice, send_counts, recv_counts = _plan(x, routing, keep)
    input_splits, output_splits = send_counts.view(world, per_rank).sum(1).tolist(), recv_counts.sum(1).tolist()
    received = all_to_all(x[token], output_splits, input_splits)
    local_expert = torch.repeat_interleave(torch.arange(per_rank).repeat(world), recv_counts.reshape(-1))
    by_expert = torch.argsort(local_expert, stable=True)
    out = run_experts(local_experts, received[by_expert], recv_counts.sum(0).tolist())
    back = torch.empty_like(out).index_copy(0, by_expert, out)
    return torch.zeros_like(x).index_add(0, token, all_to_all(back, input_splits, output_splits))


WRONG = [
    # (exercise, name in the notebook, wrong answer, what the failure must say)
    ("8.1", "route", route_raw_gates, r"gates are the raw probabilities: divide them by their sum over the k choices"),
    ("8.1", "route", route_always_renormalised, r"with k=1 every gate came out 1.0"),
    ("8.1", "route", route_bias_in_gates, r"the bias leaked into the gates"),
    ("8.1", "route", route_softmax_over_tokens, r"softmax\(x @ weight.T\) over the experts \(dim=-1\).*a softmax "
                                                r"over the tokens: take it over the experts, dim=-1"),
    ("8.1", "route", route_softmax_in_input_dtype, r"bf16 x and weight: .*probs came out torch.bfloat16: take the "
                                                   r"softmax in fp32"),
    ("8.1", "route", route_k_one_rejected, r"k=1\) raised ValueError .*but k=1 of \d+ experts is valid: check the "
                                           r"condition before your raise"),
    ("8.1", "route", route_no_k_check, r"k > experts must raise ValueError"),
    ("8.1", "route", route_k_below_experts, r"k=8\) with 8 experts .*raised ValueError .*from 1 to the number of "
                                            r"experts, weight.shape\[0\], inclusive"),
    ("8.1", "route", route_k_zero_accepted, r"k=0\) with 8 experts returned: k = 0 must raise ValueError"),
    ("8.2", "expert_capacity", capacity_floor, r"round up \(ceil\)"),
    ("8.2", "expert_capacity", capacity_without_k, r"multiply by k"),
    ("8.2", "assign_capacity", assign_token_major, r"hand out all first choices \(token order\), then all second"),
    ("8.2", "assign_capacity", assign_off_by_one, r"one assignment fewer than its capacity.*count arrivals from 0"),
    ("8.3", "load_balancing_loss", balance_divided_by_tokens, r"divide the counts by T·k, not by T"),
    ("8.3", "load_balancing_loss", balance_without_e, r"multiply by the number of experts E"),
    ("8.3", "router_z_loss", z_loss_summed, r"mean over tokens, not the sum"),
    ("8.3", "load_balancing_loss", balance_detached_probs, r"the loss has no gradient: P_i.*differentiable"),
    ("8.4", "update_expert_bias", bias_wrong_sign, r"the step has the wrong sign"),
    ("8.4", "update_expert_bias", bias_proportional, r"proportional to the error"),
    ("8.4", "update_expert_bias", bias_against_total, r"compare each load with the mean load"),
    ("8.5", "moe_layer", moe_layer_no_capacity, r"every assignment was computed.*drop them"),
    ("8.5", "moe_layer", moe_layer_no_shared, r"lacks the shared expert"),
    ("8.5", "moe_layer", moe_layer_detached_gates, r"router weight got no gradient: keep the gates"),
    ("8.6", "expert_parallel", ep_unsorted, r"check the dispatch order \(sorted by expert"),
    ("8.6", "expert_parallel", ep_no_gates, r"weight them by their gates"),
    # last: torch raises these inside the all-to-all, and the warm ranks restart after them
    ("8.6", "expert_parallel", ep_swapped_splits, r"input and output splits swapped"),
    ("8.6", "expert_parallel", ep_per_expert_splits, r"one split per destination rank \(\d\), not per expert"),
]


test_wrong_answer_fails_naming_the_mistake, test_right_answer_passes = checker_tests(
    [(exercise, wrong.__name__, answer(exercise, {**SOLUTION, name: wrong}), message)
     for exercise, name, wrong, message in WRONG],
    {exercise: answer(exercise, SOLUTION) for exercise in ANSWERS})


def route_stub(x, weight, k, bias=None):
    """8.1 untouched: the stub a generated lab carries."""
    raise NotImplementedError("Exercise 8.1: replace this line with your solution")


@pytest.mark.parametrize("name, wrong", [("route", route_raw_gates), ("route", route_stub),
                                         ("assign_capacity", assign_token_major), ("expert_capacity", capacity_floor)])
def test_a_wrong_router_or_capacity_does_not_fail_the_layer(name, wrong):
    """The notebook's 8.5, calling a wrong or unfinished 8.1 or 8.2 by its notebook name (as in a kernel), passes."""
    right = SOLUTION[name]
    SOLUTION[name] = wrong
    try:
        result = distlab.check("8.5", SOLUTION["moe_layer"], quiet=True)
    finally:
        SOLUTION[name] = right
    assert result.status == "passed", result
