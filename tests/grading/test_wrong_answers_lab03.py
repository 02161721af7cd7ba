"""Lab 03: answers students plausibly write, each run through its checker: every one fails, naming the mistake.
Each wrong answer is paired with the library's reference for the other function of its exercise, so only the
mistake is on trial (the references pass in tests/test_ddp.py::test_checkers_pass_the_reference)."""

import contextlib
import re
import sys

import cloudpickle
import pytest
import torch
import torch.distributed as dist

import distlab
from distlab import data_parallel as D

pytestmark = [pytest.mark.timeout(180)]

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the ranks need not import this file


# ---------------------------------------------------------------- 3.1 naive DDP

def broadcast_trainable_only(model):
    """Skips the frozen parameters: they stay at each rank's own initial values."""
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                dist.broadcast(p.data, src=0)


def allreduce_sum(model):
    """Sums the gradients and forgets to divide by the world size."""
    for p in model.parameters():
        if p.requires_grad:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad)


def broadcast_parameters_only(model):
    """Broadcasts every parameter, frozen ones too, but no buffer."""
    with torch.no_grad():
        for p in model.parameters():
            dist.broadcast(p.data, src=0)


def allreduce_zeros_for_frozen_too(model):
    """Gives every parameter without a gradient zeros, the frozen ones too, then reduces the trainable ones."""
    for p in model.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        if p.requires_grad:
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()


# ---------------------------------------------------------------- 3.2 buckets

def buckets_closed_past_the_cap(params, cap):
    """Closes a bucket only once it holds more than the cap (> instead of >=)."""
    buckets, current, size = [], [], 0
    for p in reversed([p for p in params if p.requires_grad]):
        current.append(p)
        size += p.numel() * p.element_size()
        if size > cap:
            buckets.append(current)
            current, size = [], 0
    return buckets + ([current] if current else [])


def buckets_in_forward_order(params, cap):
    """Walks the parameters in registration order: the first bucket fills last in backward."""
    return D.assign_buckets(list(params)[::-1], cap)


def buckets_with_frozen(params, cap):
    """Keeps requires_grad=False parameters in the last bucket."""
    params = list(params)
    buckets = D.assign_buckets(params, cap)
    return buckets[:-1] + [buckets[-1] + [p for p in params if not p.requires_grad]]


def buckets_closed_before_the_cap(params, cap):
    """Closes a bucket before adding the parameter that would reach the cap (an off-by-one of the rule)."""
    buckets, current, size = [], [], 0
    for p in reversed([p for p in params if p.requires_grad]):
        nbytes = p.numel() * p.element_size()
        if current and size + nbytes >= cap:
            buckets.append(current)
            current, size = [], 0
        current.append(p)
        size += nbytes
    return buckets + ([current] if current else [])


def allreduce_buckets_sum(buckets):
    """One flat all-reduce per bucket, but no division by the world size."""
    for bucket in buckets:
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in bucket])
        dist.all_reduce(flat)
        offset = 0
        for p in bucket:
            p.grad = flat[offset:offset + p.numel()].view_as(p).clone()
            offset += p.numel()


# ---------------------------------------------------------------- 3.3 overlap

class SynchronousInTheHook(D.OverlappedDDP):
    """Issue 46 item 23: all-reduces each full bucket from the hook, synchronously: right gradients, no overlap.
    (The library's launch, with its all_reduce called without async_op and a finished handle kept.)"""

    @torch.no_grad()
    def _launch_ready(self, flush=False):
        launch = dist.all_reduce

        def synchronous(tensor, *args, async_op=False, **kwargs):
            launch(tensor, *args, **kwargs)
            return _Done()

        dist.all_reduce = synchronous
        try:
            super()._launch_ready(flush)
        finally:
            dist.all_reduce = launch


class _Done:
    def wait(self):
        return True


class WaitsInTheHook(D.OverlappedDDP):
    """Launches each full bucket asynchronously from the hook, then waits for it at once."""

    @torch.no_grad()
    def _launch_ready(self, flush=False):
        launched = len(self._works)
        super()._launch_ready(flush)
        for work in self._works[launched:]:
            work.wait()


# ---------------------------------------------------------------- 3.4 accumulation

@contextlib.contextmanager
def no_sync_does_nothing(ddp):
    yield


@contextlib.contextmanager
def no_sync_not_restored_on_error(ddp):
    ddp.require_backward_grad_sync = False
    yield
    ddp.require_backward_grad_sync = True


def every_micro_step_under_no_sync(ddp, optimizer, micro_batches):
    """Runs all micro-steps inside no_sync: finish_gradient_sync's flush still reduces everything, but nothing
    overlaps the last backward."""
    total = 0.0
    for x, y in micro_batches:
        with D.OverlappedDDP.no_sync(ddp):
            _, loss = ddp(x, y)
            (loss / len(micro_batches)).backward()
        total += loss.item()
    ddp.finish_gradient_sync()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total / len(micro_batches)


def returns_the_summed_loss(ddp, optimizer, micro_batches):
    return D.train_step(ddp, optimizer, micro_batches) * len(micro_batches)


def never_zeroes_the_gradients(ddp, optimizer, micro_batches):
    total = 0.0
    for k, (x, y) in enumerate(micro_batches):
        with D.OverlappedDDP.no_sync(ddp) if k < len(micro_batches) - 1 else contextlib.nullcontext():
            _, loss = ddp(x, y)
            (loss / len(micro_batches)).backward()
        total += loss.item()
    ddp.finish_gradient_sync()
    optimizer.step()
    return total / len(micro_batches)


def accumulate_without_scaling(ddp, optimizer, micro_batches):
    """Sums the micro-steps' gradients without dividing the loss by their number."""
    for k, (x, y) in enumerate(micro_batches):
        with D.OverlappedDDP.no_sync(ddp) if k < len(micro_batches) - 1 else contextlib.nullcontext():
            ddp(x, y)[1].backward()
    ddp.finish_gradient_sync()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


WRONG = [
    ("3.1", (D.broadcast_parameters, allreduce_sum), r"factor of [234]\.00: gradients summed but not divided by "
                                                      r"world size"),
    ("3.1", (broadcast_trainable_only, D.allreduce_gradients), r"\(requires_grad=False\) differs from rank 0's "
                                                                r"initial weights .*\(frozen ones too\)"),
    ("3.2", (buckets_in_forward_order, D.allreduce_buckets), r"walk the parameters in reverse registration order"),
    ("3.2", (buckets_with_frozen, D.allreduce_buckets), r"\(requires_grad=False\) is in a bucket"),
    ("3.2", (buckets_closed_before_the_cap, D.allreduce_buckets), r"close it as soon as it holds bucket_cap_bytes "
                                                                   r"or more"),
    ("3.2", (D.assign_buckets, allreduce_buckets_sum), r"factor of [234]\.00: gradients summed but not divided"),
    ("3.1", (broadcast_parameters_only, D.allreduce_gradients), r"rank 1's buffer probe_buffer holds \[2.0, 2.0, "
                                                                  r"2.0\], rank 0's was \[1.0, 1.0, 1.0\]: broadcast "
                                                                  r"the buffers too"),
    ("3.1", (D.broadcast_parameters, allreduce_zeros_for_frozen_too), r"pos_emb.weight \(requires_grad=False\) has "
                                                                      r"a gradient: skip the parameters that do not "
                                                                      r"require grad"),
    ("3.2", (buckets_closed_past_the_cap, D.allreduce_buckets), r"close it as soon as it holds bucket_cap_bytes or "
                                                                r"more"),
    ("3.3", (D.BucketedDDP,), r"no all-reduce overlapped backward: no bucket's all_reduce was launched before "
                              r"finish_gradient_sync\(\)"),
    ("3.3", (SynchronousInTheHook,), r"no all-reduce overlapped backward: the all_reduce calls made during backward "
                                     r"are synchronous \(no async_op=True\)"),
    ("3.3", (WaitsInTheHook,), r"each handle is waited on before backward ends \(in the hook\?\)"),
    ("3.4", (D.OverlappedDDP.no_sync, every_micro_step_under_no_sync), r"no all-reduce overlapped backward: no "
                                                                       r"bucket's all_reduce was launched before"),
    ("3.4", (D.OverlappedDDP.no_sync, returns_the_summed_loss), r"train_accumulated returned [\d.]+; the mean of its "
                                                                r"[234] micro-batch losses is"),
    ("3.4", (D.OverlappedDDP.no_sync, never_zeroes_the_gradients), r"still holds a gradient: call "
                                                                   r"optimizer.zero_grad\(\) after optimizer.step"),
    ("3.4", (no_sync_does_nothing, D.train_step), r"inside no_sync\(ddp\), ddp.require_backward_grad_sync should "
                                                   r"be False"),
    ("3.4", (no_sync_not_restored_on_error, D.train_step), r"after an exception inside no_sync\(ddp\)"),
    ("3.4", (D.OverlappedDDP.no_sync, accumulate_without_scaling), r"factor of [234]\.00: gradients of the [234] "
                                                                    r"micro-steps summed"),
]


@pytest.mark.parametrize("exercise, code, message", WRONG, ids=[w[1][0].__name__ + "+" + w[1][-1].__name__
                                                                for w in WRONG])
def test_a_wrong_answer_fails_naming_the_mistake(exercise, code, message):
    result = distlab.check(exercise, *code, quiet=True)
    assert result.status == "failed" and result.points == 0, result
    assert re.search(message, result.detail), result.detail
