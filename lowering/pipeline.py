"""The lowering pipeline: one route of passes per workload, each pass a pure function
(Kernel, context) -> Kernel.

Every workload takes the same route; the steps marked [workload] are the workload plug-in's own
(`wsched/workloads/<name>/`), the others are shared and read only the IR and the channels:

    build_loops [workload]   the partition's two loop nests, single-buffered, unsynchronised
    circular_buffer          stages and the shared linear counter (needs the k loops)
    insert_barriers          full/empty barriers, indexed by the stage variable
    lower_tma                the producer's issue loop under elect_one; 128-byte swizzles
    lower_mma                wgmma fence/commit/wait; the release moves behind its wait
    <extra passes> [workload] reorderings of the complete wgmma protocol
    epilogue [workload]      after the k loop is final: normalisation, fused ops, stores
    <late passes> [workload] rewrites of a tile's whole work (which warpgroup runs it)
    cluster                  a cluster's shared stages: freed by every CTA's consumers, and the
                             producer's tail
    reg_realloc              last: it must see every role's final body (register budget)

The routes, step by step (`route(workload, schedule)`; a test keeps this list true):

    matmul:    build_loops, circular_buffer, insert_barriers, lower_tma, lower_mma, epilogue,
               pingpong (if mode="pingpong"), cluster (if a cluster of more than one CTA),
               reg_realloc
    attention: build_loops, circular_buffer, insert_barriers, lower_tma, lower_mma,
               overlap_softmax (if mma_inflight=1), pingpong (if mode="pingpong"), epilogue,
               defer_row_loads, dynamic_tiles (if split_kv=1), cluster (if a cluster of more than one
               CTA), reg_realloc

The IR after each step is kept by name (`kernel.ir_after["insert_barriers"]`); the verifier
runs after every step when `WSCHED_DEBUG` is on (always in tests), with the load/compute
contract checked once the release point is right (after lower_mma). `WSCHED_PRINT_IR=
insert_barriers,epilogue` (or `all`) prints the IR after the named steps to stderr.
"""

from __future__ import annotations

import sys
import warnings
from dataclasses import replace

from wsched import knobs
from wsched.workloads import WORKLOADS

from . import ir
from .context import LoweringContext, Step
from .passes import circular_buffer, cluster, insert_barriers, lower_mma, lower_tma, reg_realloc
from .verify import verify

CIRCULAR_BUFFER = Step("circular_buffer", circular_buffer.run, False)
INSERT_BARRIERS = Step("insert_barriers", insert_barriers.run, False)
LOWER_TMA = Step("lower_tma", lower_tma.run, False)
LOWER_MMA = Step("lower_mma", lower_mma.run, True)
CLUSTER = Step("cluster", cluster.run, True, lambda s: s.cluster_size > 1, "a cluster of more than one CTA")
REG_REALLOC = Step("reg_realloc", reg_realloc.run, True)


def route(workload, schedule=None) -> tuple[Step, ...]:
    """The steps a kernel of `workload` takes (with `schedule`: only those that apply to it)."""
    steps = (
        Step("build_loops", workload.build_loops, False),
        CIRCULAR_BUFFER,
        INSERT_BARRIERS,
        LOWER_TMA,
        LOWER_MMA,
        *workload.extra_passes,
        Step("epilogue", workload.epilogue, True),
        *workload.late_passes,
        CLUSTER,
        REG_REALLOC,
    )
    return steps if schedule is None else tuple(s for s in steps if s.when(schedule))


def pass_names(workload, schedule=None) -> tuple[str, ...]:
    return tuple(step.name for step in route(workload, schedule))


def all_pass_names() -> tuple[str, ...]:
    """Every step name of every workload's route, in route order."""
    return tuple(dict.fromkeys(name for w in WORKLOADS for name in pass_names(w)))


def lower_partition(partition, name: str | None = None, *, debug: bool | None = None) -> ir.Kernel:
    ctx = LoweringContext(partition, name or partition.fusion.name)
    debug = knobs.debug() if debug is None else debug
    print_after = knobs.print_ir_after()
    unknown = print_after - {"all"} - set(all_pass_names())
    if unknown:
        warnings.warn(f"WSCHED_PRINT_IR names no pass: {', '.join(sorted(unknown))}; the passes are "
                      f"{', '.join(all_pass_names())} (or all)", stacklevel=2)
    kernel = None
    snapshots: dict[str, ir.Kernel] = {}
    for step in route(ctx.workload, ctx.schedule):
        kernel = step.run(kernel, ctx)
        if debug:
            verify(kernel, contract=step.contract)
        snapshots[step.name] = kernel
        if step.name in print_after or "all" in print_after:
            # a `#` comment, so that a saved dump parses back (k.with_ir)
            print(f"# ----- IR after {step.name} -----\n{kernel}", file=sys.stderr)
    if not debug:
        verify(kernel, contract=True)
    final = replace(kernel)
    final.ir_after.update(snapshots)
    return final
