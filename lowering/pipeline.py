"""The lowering pipeline: one tuple of passes, each a pure function (Kernel, context) -> Kernel.

The IR after each pass is kept by name (`kernel.ir_after["insert_barriers"]`); the verifier
runs after every pass when `WSCHED_DEBUG` is on (always in tests), with the load/compute
contract checked once the barriers exist. `WSCHED_PRINT_IR=insert_barriers,epilogue` (or
`all`) prints the IR after the named passes to stderr.
"""

from __future__ import annotations

import sys
from dataclasses import replace

from wsched import knobs

from . import ir
from .context import LoweringContext
from .passes import (build_loops, circular_buffer, epilogue, insert_barriers, lower_mma, lower_tma,
                     overlap_softmax, pingpong, reg_realloc)
from .verify import verify

# (name, pass, whether the load/compute contract holds after it: the release point is only
# right once lower_mma has put it behind the wgmma wait)
PIPELINE = (
    # The partition's two loop nests, single-buffered, no synchronisation yet.
    ("build_loops", build_loops.run, False),
    # Stages and the shared linear counter; needs the k loops that build_loops made.
    ("circular_buffer", circular_buffer.run, False),
    # full/empty barriers index by the stage variable circular_buffer introduced.
    ("insert_barriers", insert_barriers.run, False),
    # Wrap the producer's (now complete) issue loop in elect_one; choose swizzles.
    ("lower_tma", lower_tma.run, False),
    # wgmma fence/commit/wait, and move the consumer release behind the wait that frees it.
    ("lower_mma", lower_mma.run, True),
    # Attention with mma_inflight=1: delay P V by one block so the softmax overlaps it; it
    # reorders the complete wgmma protocol lower_mma wrote.
    ("overlap_softmax", overlap_softmax.run, True),
    # Attention with mode="pingpong": token passing around the GEMM issue that overlap_softmax
    # grouped together.
    ("pingpong", pingpong.run, True),
    # After the k loop is final: the fused epilogue and the output stores.
    ("epilogue", epilogue.run, True),
    # Last: it must see every role's final body to check the register budget.
    ("reg_realloc", reg_realloc.run, True),
)

PASS_NAMES = tuple(name for name, _, _ in PIPELINE)


def lower_partition(partition, name: str | None = None, *, debug: bool | None = None) -> ir.Kernel:
    ctx = LoweringContext(partition, name or partition.fusion.name)
    debug = knobs.debug() if debug is None else debug
    print_after = knobs.print_ir_after()
    kernel = None
    snapshots: dict[str, ir.Kernel] = {}
    for pass_name, run, contract in PIPELINE:
        kernel = run(kernel, ctx)
        if debug:
            verify(kernel, contract=contract)
        snapshots[pass_name] = kernel
        if pass_name in print_after or "all" in print_after:
            print(f"// ----- IR after {pass_name} -----\n{kernel}", file=sys.stderr)
    if not debug:
        verify(kernel, contract=True)
    final = replace(kernel)
    final.ir_after.update(snapshots)
    return final
