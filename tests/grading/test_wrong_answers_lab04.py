"""Lab 04's checkers against the wrong answers students write (issue 27): each fails with a message that names
the mistake, and the right answer passes. The distributed exercises (4.1–4.3) run on the shared warm gloo ranks;
each wrong answer fails at its checker's first case, so the table stays cheap.

Cases that a world size of 2 (N − 1 = 1) or equal tensors could hide: 4.1 dividing by N − 1 (the same as not
dividing at N = 2; its first case has 4 ranks) and 4.2 summing without dividing (its first case is a bf16 bucket
on 4 ranks whose gradients cancel, so no ratio of equal tensors hides it). 4.6's first case has 4 ranks and rows
that leave a remainder of 1 or 2, where a balanced split (``tensor_split``) and FSDP2's ⌈d₀/N⌉ rows differ (at
N = 2, or a remainder of N − 1, they coincide).
"""

import re

import pytest
import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

import distlab
from distlab.grading import lab04
from distlab.zero import (
    FlatLayout,
    alloc_storage,
    checkpoint_module,
    mixed_precision_step,
    reduce_scatter_dim0,
    reduce_scatter_grads,
)
from distlab.zero import reshard as right_reshard
from distlab.zero import unshard as right_unshard

pytestmark = [pytest.mark.timeout(240)]


# ---------------------------------------------------------------- 4.1: the sharded optimizer and its mistakes

class Sharded:
    """The solution's ZeRO-1; subclasses change one piece."""

    def __init__(self, params, optimizer_class, **defaults):
        self.world, self.rank = dist.get_world_size(), dist.get_rank()
        self.optimizer_class, self.defaults, self.optim, self.flats = optimizer_class, defaults, None, []
        groups = list(params)
        for group in groups if isinstance(groups[0], dict) else [{"params": groups}]:
            self.add_param_group(group)

    def add_param_group(self, group):
        params = [p for p in group["params"] if p.requires_grad]
        layout = FlatLayout(params, self.world)
        flat = layout.flatten([p.detach() for p in params])
        for p, view in zip(params, layout.views(flat)):
            p.data = view
        shard = self.my_shard(layout, flat)
        inner = dict({k: v for k, v in group.items() if k != "params"}, params=[shard])
        if self.optim is None:
            self.optim = self.optimizer_class([inner], **self.defaults)
        else:
            self.optim.add_param_group(inner)
        self.flats.append((layout, flat, shard))

    def my_shard(self, layout, flat):
        return layout.shard(flat, self.rank)

    def zero_grad(self, set_to_none=True):
        for layout, _, shard in self.flats:
            shard.grad = None
            for p in layout.params:
                p.grad = None

    @torch.no_grad()
    def step(self):
        for layout, flat, shard in self.flats:
            shard.grad = self.average(layout.flatten([p.grad for p in layout.params], dtype=torch.float32))
        self.optim.step()
        for layout, flat, shard in self.flats:
            self.gather(flat, shard)

    def average(self, grads):
        shard = torch.empty(grads.numel() // self.world)
        dist.reduce_scatter_tensor(shard, grads)
        return shard / self.world

    def gather(self, flat, shard):
        dist.all_gather_into_tensor(flat, shard.clone())


class Summed(Sharded):  # forgot to divide by the world size
    def average(self, grads):
        return super().average(grads) * self.world


class DividedByNMinusOne(Sharded):  # at N = 2 the same as not dividing; at N = 4 off by 4/3
    def average(self, grads):
        return super().average(grads) * self.world / (self.world - 1)


class AllReduced(Sharded):  # the full gradient everywhere, then the shard: 1.5× DDP's bytes with the gather
    def average(self, grads):
        dist.all_reduce(grads)
        n = grads.numel() // self.world
        return (grads / self.world)[self.rank * n:(self.rank + 1) * n]


class NeverReduced(Sharded):  # the shard's gradient buffer made, the reduce-scatter into it forgotten
    def average(self, grads):
        return torch.full((grads.numel() // self.world,), 1e30)  # torch.empty's garbage, made deterministic


class NeverGathers(Sharded):  # each rank updates its shard and never shares it
    def gather(self, flat, shard):
        pass


class UnshardedState(Sharded):  # every rank steps the whole buffer: DDP's memory
    def my_shard(self, layout, flat):
        return flat

    def average(self, grads):
        dist.all_reduce(grads)
        return grads / self.world

    def gather(self, flat, shard):
        pass


# ---------------------------------------------------------------- 4.2: reduce_scatter_grads and its mistakes

def _shard_of(flat, dtype=torch.float32, op=dist.ReduceOp.SUM):
    grads = flat.layout.flatten([p.grad for p in flat.params], dtype=dtype)
    shard = torch.empty(flat.layout.shard_numel, dtype=dtype)
    dist.reduce_scatter_tensor(shard, grads, op=op)
    return shard


@torch.no_grad()
def reduced_in_bf16(flat):
    flat.grad_shard = (_shard_of(flat, dtype=flat.dtype) / dist.get_world_size()).to(flat.dtype)
    for p in flat.params:
        p.grad = None


@torch.no_grad()
def keeps_full_gradients(flat):
    flat.grad_shard = (_shard_of(flat) / dist.get_world_size()).to(flat.dtype)


@torch.no_grad()
def summed_not_averaged(flat):
    flat.grad_shard = _shard_of(flat).to(flat.dtype)
    for p in flat.params:
        p.grad = None


@torch.no_grad()
def shard_kept_in_fp32(flat):
    flat.grad_shard = _shard_of(flat) / dist.get_world_size()
    for p in flat.params:
        p.grad = None


@torch.no_grad()
def all_reduce_then_slice(flat):
    grads = flat.layout.flatten([p.grad for p in flat.params], dtype=torch.float32)
    dist.all_reduce(grads)
    flat.grad_shard = flat.layout.shard(grads / dist.get_world_size(), dist.get_rank()).to(flat.dtype)
    for p in flat.params:
        p.grad = None


# ---------------------------------------------------------------- 4.3: unshard / reshard and their mistakes

def never_frees(flat):
    pass


def copies_only_its_own_shard(flat):  # no communication: the other ranks' slots stay stale
    alloc_storage(flat.full)
    flat.full.zero_()
    flat.layout.shard(flat.full, dist.get_rank()).copy_(flat.local)


# ---------------------------------------------------------------- 4.4: the mixed-precision step and its mistakes

@torch.no_grad()
def steps_the_bf16_copies(params, masters, optimizer):
    for p in params:
        p.sub_(1e-3 * p.grad)
        p.grad = None


@torch.no_grad()
def never_copies_back(params, masters, optimizer):
    for p, master in zip(params, masters):
        master.grad = p.grad.float()
    optimizer.step()
    for p, master in zip(params, masters):
        p.grad = master.grad = None


@torch.no_grad()
def copies_back_before_the_step(params, masters, optimizer):
    for p, master in zip(params, masters):
        master.grad = p.grad.float()
        p.copy_(master)
        p.grad = None
    optimizer.step()


@torch.no_grad()
def keeps_the_gradients(params, masters, optimizer):
    for p, master in zip(params, masters):
        master.grad = p.grad.float()
    optimizer.step()
    for p, master in zip(params, masters):
        p.copy_(master)


# ---------------------------------------------------------------- 4.5: checkpointing and its mistakes

def does_nothing(module):
    return module


def reentrant(module):
    forward = module.forward
    module.forward = lambda *args: checkpoint(forward, *args, use_reentrant=True)


def calls_itself(module):  # the lambda looks module.forward up when it runs: it is the lambda itself
    module.forward = lambda *args: checkpoint(module.forward, *args, use_reentrant=False)


# ---------------------------------------------------------------- 4.6: FSDP2's reduce-scatter and its mistakes

def _chunk(rows, world):
    return -(-rows // world)


def _rank_major(grads, world, dtype=torch.float32):
    """The solution's send buffer: row r holds chunk r of every gradient, each padded to N·c rows."""
    blocks = []
    for g in grads:
        padded = g.new_zeros((world * _chunk(g.shape[0], world), *g.shape[1:]), dtype=dtype)
        padded[:g.shape[0]] = g
        blocks.append(padded.view(world, -1))
    return torch.cat(blocks, dim=1)


def _split(mine, grads, world, rank, keep_padding=False):
    out, offset = [], 0
    for g in grads:
        chunk = _chunk(g.shape[0], world)
        length = max(0, min(chunk, g.shape[0] - rank * chunk))
        piece = mine[offset:offset + chunk * g[0].numel()].view(chunk, *g.shape[1:])
        out.append(piece if keep_padding else piece[:length])
        offset += chunk * g[0].numel()
    return out


def _reduce(send, world):
    mine = torch.empty(send.numel() // world, dtype=send.dtype)
    dist.reduce_scatter_tensor(mine, send.reshape(-1))
    return mine


@torch.no_grad()
def flattens_before_padding(grads):  # pads the flattened gradient: shards that cut rows apart
    world = dist.get_world_size()
    out = []
    for g in grads:
        flat = g.float().reshape(-1)
        padded = torch.cat([flat, flat.new_zeros(-flat.numel() % world)])
        out.append(_reduce(padded, world) / world)
    return out


@torch.no_grad()
def splits_rows_evenly(grads):  # tensor_split's balanced pieces instead of torch.chunk's ⌈d₀/N⌉ rows
    world, rank = dist.get_world_size(), dist.get_rank()
    blocks, lengths = [], []
    for g in grads:
        chunk = _chunk(g.shape[0], world)
        pieces = g.float().tensor_split(world)
        padded = torch.zeros(world, chunk, *g.shape[1:])
        for r, piece in enumerate(pieces):
            padded[r, :len(piece)] = piece
        blocks.append(padded.view(world, -1))
        lengths.append(len(pieces[rank]))
    mine, out, offset = _reduce(torch.cat(blocks, dim=1), world) / world, [], 0
    for g, length in zip(grads, lengths):
        size = _chunk(g.shape[0], world) * g[0].numel()
        out.append(mine[offset:offset + size].view(-1, *g.shape[1:])[:length])
        offset += size
    return out


@torch.no_grad()
def keeps_the_padding_rows(grads):
    world, rank = dist.get_world_size(), dist.get_rank()
    return _split(_reduce(_rank_major(grads, world), world) / world, grads, world, rank, keep_padding=True)


@torch.no_grad()
def sums_without_dividing(grads):
    world, rank = dist.get_world_size(), dist.get_rank()
    return _split(_reduce(_rank_major(grads, world), world), grads, world, rank)


@torch.no_grad()
def reduces_in_the_compute_dtype(grads):  # sums bf16 gradients in bf16, casts the result
    world, rank = dist.get_world_size(), dist.get_rank()
    mine = _reduce(_rank_major(grads, world, dtype=grads[0].dtype), world).float() / world
    return _split(mine, grads, world, rank)


@torch.no_grad()
def returns_the_compute_dtype(grads):  # reduces in fp32, then rounds the shards back to bf16
    world, rank = dist.get_world_size(), dist.get_rank()
    shards = _split(_reduce(_rank_major(grads, world), world) / world, grads, world, rank)
    return [s.to(g.dtype) for s, g in zip(shards, grads)]


@torch.no_grad()
def lays_out_parameter_by_parameter(grads):  # each padded gradient whole after the other
    world, rank = dist.get_world_size(), dist.get_rank()
    send = torch.cat([_rank_major([g], world).reshape(-1) for g in grads])
    return _split(_reduce(send, world) / world, grads, world, rank)


@torch.no_grad()
def one_reduce_scatter_per_gradient(grads):  # right values, N collectives where FSDP2 makes one
    world, rank = dist.get_world_size(), dist.get_rank()
    return [_split(_reduce(_rank_major([g], world), world) / world, [g], world, rank)[0] for g in grads]


@torch.no_grad()
def all_reduces_then_slices(grads):
    world, rank = dist.get_world_size(), dist.get_rank()
    send = _rank_major(grads, world)
    dist.all_reduce(send)
    return _split(send[rank] / world, grads, world, rank)


WRONG = [  # (exercise, the wrong answer, what the message must say)
    ("4.1", (Summed,), r"by a factor of 4\.00: gradients summed but not divided by world size"),
    ("4.1", (DividedByNMinusOne,), r"rank \d's .* differs from the reference .*by a factor of 1\.33"),
    ("4.1", (AllReduced,), r"1\.50× what DDP's all-reduce sends .*reduce-scatter the gradients"),
    ("4.1", (NeverReduced,), r"far beyond any update: look for a gradient read from memory nothing wrote"),
    ("4.1", (NeverGathers,), r"rank [123]'s .* differs from rank 0's .*all-gather the updated shards"),
    ("4.1", (UnshardedState,), r"optimizer holds momentum for 100% of the parameters; with 4 ranks it should be 1/4"),
    ("4.2", (reduced_in_bf16,), r"carried 2 bytes per element, so the gradients were summed in bf16"),
    ("4.2", (keeps_full_gradients,), r"still holds 5 full gradient\(s\) .*set p\.grad = None"),
    ("4.2", (summed_not_averaged,), r"off by \d+ bf16 ulps: average \(sum, then divide by the world size\)"),
    ("4.2", (shard_kept_in_fp32,), r"grad_shard is float32; store it in the parameters' dtype"),
    ("4.2", (all_reduce_then_slice,), r"sent 1\.50× what DDP's all-reduce sends .*one reduce-scatter per bucket"),
    ("4.3", (right_unshard, never_frees), r"still holds .* bytes of gathered parameters .*reshard must free"),
    ("4.3", (copies_only_its_own_shard, right_reshard), r"rank \d's .* differs from the reference"),
    ("4.4", (steps_the_bf16_copies,), r"the master never moved: copy each p\.grad"),
    ("4.4", (never_copies_back,), r"compute copy is not the master rounded to bf16 .*copy the masters back"),
    ("4.4", (copies_back_before_the_step,), r"compute copy is not the master rounded to bf16"),
    ("4.4", (keeps_the_gradients,), r"still holds its gradient after the step; clear it \(p\.grad = None\)"),
    ("4.5", (does_nothing,), r"as many as without checkpointing"),
    ("4.5", (reentrant,), r"does not require grad any more: reentrant checkpointing"),
    ("4.5", (calls_itself,), r"raised RecursionError"),
    ("4.6", (flattens_before_padding,), r"you sharded the flattened gradient; FSDP2 keeps whole rows"),
    ("4.6", (splits_rows_evenly,), r"you split the \d+ rows evenly \(tensor_split"),
    ("4.6", (keeps_the_padding_rows,), r"that is the padded chunk: .* cut the padding rows off"),
    ("4.6", (sums_without_dividing,), r"it is 4× the mean: divide the reduce-scatter's sum by the world size"),
    ("4.6", (reduces_in_the_compute_dtype,), r"carried 2 bytes per element: the gradients were reduced in the "
                                             r"compute dtype"),
    ("4.6", (returns_the_compute_dtype,), r"is bfloat16: reduce and return fp32"),
    ("4.6", (lays_out_parameter_by_parameter,), r"you laid the padded gradients one after the other"),
    ("4.6", (one_reduce_scatter_per_gradient,), r"[34] reduce-scatters for [34] gradients; FSDP2 makes one per group"),
    ("4.6", (all_reduces_then_slices,), r"you used all_reduce: every rank received what it then throws away"),
]

RIGHT = {"4.1": (Sharded,), "4.2": (reduce_scatter_grads,), "4.3": (right_unshard, right_reshard),
         "4.4": (mixed_precision_step,), "4.5": (checkpoint_module,), "4.6": (reduce_scatter_dim0,)}
RIGHT_SAYS = {"4.1": "1/N of the state", "4.2": "fp32", "4.3": "1.5× DDP's bytes", "4.6": "one reduce-scatter"}


@pytest.mark.parametrize("exercise, wrong, message", WRONG, ids=[f"{e}-{w[-1].__name__}" for e, w, _ in WRONG])
def test_wrong_answer_fails_naming_the_mistake(exercise, wrong, message):
    result = distlab.check(exercise, *wrong, quiet=True)
    assert result.status == "failed", f"{exercise} accepted {wrong[-1].__name__}: {result.detail}"
    assert re.search(message, result.detail), result.detail


@pytest.mark.parametrize("exercise", sorted(RIGHT))
def test_the_right_answer_passes(exercise):
    result = distlab.check(exercise, *RIGHT[exercise], quiet=True)
    assert result.status == "passed" and result.points == result.max_points, result.detail
    assert RIGHT_SAYS.get(exercise, "") in result.detail, result.detail  # the line says what was verified


QUIZ_WRONG = [("Q4.1", 4 + 12 / 8), ("Q4.2", 2.0), ("Q4.3", "b"), ("Q4.4", 1120), ("Q4.5", "a"), ("Q4.6", "b"),
              ("Q4.7", 4 / 3), ("Q4.8", 3)]


@pytest.mark.parametrize("question, answer", QUIZ_WRONG)
def test_quiz_wrong_answer_gets_a_hint_to_a_section_not_the_computation(question, answer):
    """Q4.3's old key (one micro-batch per step) and Q4.7's (the 4/3 ceiling) fail now; every hint names the section
    that answers it and holds no arithmetic that would give the answer away (issue 27 item 8)."""
    result = distlab.check(question, answer, quiet=True)
    assert result.status == "failed", result
    hint = result.detail.split(": ", 1)[1]
    assert re.search(r"'[^']+'", hint), f"{question}: the hint names no section: {hint}"
    assert not re.search(r"\d\s*[×*/+−-]\s*\d|\d+e\d", hint), f"{question}: the hint computes: {hint}"


def test_every_question_is_in_the_table():
    assert sorted(q for q, _ in QUIZ_WRONG) == sorted(q.id for q in lab04.QUESTIONS)
