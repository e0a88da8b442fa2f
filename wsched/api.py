"""The public pipeline: fusion -> schedule -> partition -> loop IR -> CUDA -> cubin -> launch.

    k = ws.compile(fusion)            # lowers, emits CUDA, builds with nvcc (cached)
    out = k(a, b, bias)               # runs on the GPU on torch tensors
    print(k.ir)                       # final loop IR; k.ir_after["insert_barriers"], k.cuda_source
    out = k.simulate(a, b, bias)      # the same IR on the CPU simulator (no GPU needed)
    k = ws.compile(fusion, autotune=True, autotune_for={"M": 4096, "N": 4096, "K": 4096})

One schedule is compiled by `wsched/kernel.py`; the autotuner (`wsched/autotune.py`) searches a
workload's schedules with it; `compile` here chooses between the two.
"""

from __future__ import annotations

from .errors import check_argument
from .fusion import check_fusion
from .kernel import CompiledKernel, NoGPUError, build_kernel, build_without_spills, lower, schedule_for
from .schedule import Schedule, ScheduleError

__all__ = ["compile", "lower", "schedule_for", "CompiledKernel", "NoGPUError"]


def compile(fusion, schedule: Schedule | None = None, *, build: bool | None = None,  # noqa: A001
            autotune: bool = False, autotune_for=None, **overrides):
    """Lower and emit a fusion; build the cubin with nvcc now if nvcc is on PATH (or `build`).

    `autotune=True` searches the workload's schedule space on the GPU (wsched/autotune.py) for
    the shapes `autotune_for` ({symbol: size}, tensors or shapes) and compiles the winner; without
    `autotune_for` it returns an `AutotunedKernel` that tunes (or reads the on-disk result) at the
    first call of each shape bucket.

    Without a schedule or overrides, a workload whose best schedule depends on the shape (matmul:
    split-K where the output tiles cannot fill the SMs) gives a `ShapeDispatchKernel` that picks
    per call among its default and those variants (`wsched/dispatch.py`). The schedules the
    compiler picks build without register spills: where ptxas spills, the workload's lighter
    schedules are built in turn (`Workload.lighter`, `kernel.build_without_spills`); a schedule
    the caller gives is built as given."""
    check_fusion(fusion, "ws.compile")
    check_argument("autotune", autotune, bool, "True or False")
    if autotune or autotune_for is not None:
        from . import autotune as tuner

        if schedule is not None or overrides:
            raise ScheduleError("autotune=True picks the schedule: pass no schedule or schedule fields with it")
        if autotune_for is None:
            return tuner.AutotunedKernel(fusion)
        schedule = tuner.tune(fusion, autotune_for).schedule
    if schedule is not None or overrides:
        return build_kernel(fusion, schedule, build=build, **overrides)
    from .dispatch import ShapeDispatchKernel
    from .workloads import workload_for

    default = schedule_for(fusion)
    kernel = build_without_spills(fusion, default, build=build)   # a lighter schedule where it spills
    variants = workload_for(fusion).variants(fusion, default)
    return ShapeDispatchKernel(kernel, variants, build=build) if variants else kernel
