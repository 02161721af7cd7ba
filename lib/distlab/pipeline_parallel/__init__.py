"""Pipeline parallelism from scratch: stages, schedules (GPipe, 1F1B, interleaved 1F1B,
zero-bubble ZB-H1, and the V-shaped ZB-V and DualPipeV), an executor on real ranks, and the
bubble read off their timeline.

The model's layers are cut into stages, one per rank (``v`` per rank when interleaved);
each optimizer step's batch is cut into ``m`` micro-batches that flow forward through
the stages and back. A *schedule* says, for each rank, in which order it runs which
forward, backward, send and receive. It is plain data, so this package can check it
(no deadlock, every message matched), simulate it (its bubble and its memory, exactly),
run it (:func:`run_schedule`, point-to-point ops on real ranks) and compare the
measured timeline with the simulation and with ``(p-1)/(m+p-1)``; a schedule written by hand
(Python lists, or text as :func:`parse_schedule` reads it) goes through the same steps.

* :mod:`~distlab.pipeline_parallel.partition` — even and cost-balanced layer splits;
* :mod:`~distlab.pipeline_parallel.schedules` — the schedules, validation, simulation, theory;
* :mod:`~distlab.pipeline_parallel.executor` — stage modules, channels, the executor;
* :mod:`~distlab.pipeline_parallel.measure` — the measured bubble and the Gantt chart;
* :mod:`~distlab.pipeline_parallel.train` — the worker, its reference, PyTorch's pipelining, torchrun.

Under torchrun::

    torchrun --nproc-per-node=4 -m distlab.torchrun distlab.pipeline_parallel:train \
        steps=20 schedule=1f1b microbatches=8
"""

from distlab.pipeline_parallel.executor import (
    RECEIVE_AHEAD,
    Channels,
    SavedActivations,
    SplitBackward,
    StageModule,
    StepStats,
    build_stages,
    channels,
    lm_loss,
    neighbour_pairs,
    run_schedule,
    split_microbatches,
    sync_tied_gradients,
)
from distlab.pipeline_parallel.measure import (
    PHASE_COLORS,
    STAGE_WORK,
    Bubble,
    StepsBubble,
    compute_spans,
    measured_bubble,
    measured_stage_times,
    plot_pipeline,
    replay,
    step_spans,
    steps_bubble,
    trace_bubble,
)
from distlab.pipeline_parallel.partition import (
    LayerCosts,
    balanced_partition,
    check_partition,
    even_partition,
    measure_layer_costs,
    stage_costs,
)
from distlab.pipeline_parallel.schedules import (
    COMMUNICATION,
    COMPUTE,
    SCHEDULES,
    V_SCHEDULES,
    Action,
    ScheduleError,
    Simulation,
    bubble_fraction,
    compute_order,
    dualpipe_v,
    dualpipe_v_bubble,
    format_schedule,
    gpipe,
    interleaved_1f1b,
    interleaved_bubble_fraction,
    interleaved_warmup,
    make_schedule,
    messages_per_rank,
    num_stages_of,
    one_f_one_b,
    parse_schedule,
    peak_in_flight,
    placement_of,
    placement_style,
    schedule_csv,
    simulate,
    stage_placement,
    validate,
    with_p2p,
    zero_bubble_h1,
    zero_bubble_h1_bubble,
    zero_bubble_v,
)
from distlab.pipeline_parallel.train import (
    TORCH_SCHEDULES,
    check_setup,
    keep_freed_memory,
    pipeline_worker,
    reference_states,
    torch_pipelining_worker,
    train,
)

__all__ = [
    "Action", "COMPUTE", "COMMUNICATION", "ScheduleError", "bubble_fraction", "interleaved_bubble_fraction",
    "zero_bubble_h1_bubble", "dualpipe_v_bubble", "peak_in_flight", "interleaved_warmup",
    "gpipe", "one_f_one_b", "interleaved_1f1b", "zero_bubble_h1", "zero_bubble_v", "dualpipe_v", "SCHEDULES",
    "V_SCHEDULES", "make_schedule", "placement_style", "stage_placement", "placement_of", "with_p2p",
    "compute_order", "num_stages_of", "messages_per_rank", "validate", "Simulation", "simulate", "format_schedule",
    "parse_schedule", "schedule_csv",
    "even_partition", "balanced_partition", "stage_costs", "check_partition", "LayerCosts", "measure_layer_costs",
    "StageModule", "build_stages", "lm_loss", "Channels", "channels", "neighbour_pairs", "SavedActivations",
    "SplitBackward", "StepStats", "RECEIVE_AHEAD", "run_schedule", "sync_tied_gradients", "split_microbatches",
    "PHASE_COLORS", "compute_spans", "step_spans", "Bubble", "measured_bubble", "StepsBubble", "steps_bubble",
    "plot_pipeline", "STAGE_WORK", "trace_bubble", "measured_stage_times", "replay",
    "check_setup", "keep_freed_memory", "pipeline_worker", "reference_states", "TORCH_SCHEDULES",
    "torch_pipelining_worker", "train",
]
