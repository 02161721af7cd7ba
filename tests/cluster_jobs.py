"""The driver the multi-node tests start under torchrun: every topic's ``train`` in turn, in one process group.

One launch instead of one per topic: starting torchrun agents and their ranks is most of the cost
on two cores, and what is tested — the workers across a node boundary — is the same. Sizes are
tiny; ``SIZES`` is imported by the tests to build the single-process references.
"""

from distlab import context_parallel, data_parallel, fp8, moe, pipeline_parallel, tensor_parallel, zero
from distlab.parallel3d import grid

SMALL = dict(n_layer=4, d_model=32, n_head=4, vocab_size=64, seq_len=16)
SIZES = {
    "ddp": dict(SMALL, steps=2, warmup=1, batch_size=2),
    "zero3": dict(SMALL, steps=2, warmup=1, batch_size=2, stage=3),
    "pp": dict(SMALL, steps=2, warmup=1, microbatches=4, rows=1),
    "3d": dict(SMALL, dp=1, pp=2, tp=2, steps=2, batch_size=4, microbatches=2),
    "tp": dict(SMALL, steps=2, warmup=1, batch_size=2),
    "cp": dict(SMALL, steps=2, batch_size=2),
    "moe": dict(SMALL, steps=2, num_experts=4, batch_size=2, capacity_factor=None),
    "fp8": dict(SMALL, steps=2, warmup=1, batch_size=2),
}
TRAIN = {"ddp": data_parallel.train, "zero3": zero.train, "pp": pipeline_parallel.train, "3d": grid.train,
         "tp": tensor_parallel.train, "cp": context_parallel.train, "moe": moe.train, "fp8": fp8.train}


def every_topic(topics: str = ",".join(SIZES), log_every: int = 0) -> dict:
    """Each topic's worker (``topics``: names, comma-separated), one after another on the same ranks;
    this rank's summaries by topic."""
    return {name: TRAIN[name](**SIZES[name], log_every=log_every) for name in topics.split(",")}
