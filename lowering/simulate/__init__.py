"""CPU simulator of the loop IR: the reference semantics of every node, and the tool that catches
protocol bugs (deadlocks, slot races, expect_tx mismatches, broken named barriers, reads of
unwritten registers) before they hang a GPU.

    report = simulate(kernel, {"M": 256, "a": a, "b": b, "c": c}, num_sms=4, seed=0)

Execution model (`ir`'s module docstring is the contract; this package is its executable
form):

* Every CTA of the grid (`kernel.grid` evaluated with `num_sms` and the scalar arguments) runs
  as one coroutine per warpgroup (Python generators). At most `num_sms` CTAs are resident at a
  time; the next one starts when a CTA exits (waves, as on a GPU with one CTA per SM).
* Clusters (`cluster(n, 1, 1)`): CTAs c*n .. c*n + n - 1 form cluster c, a CTA's rank is
  `cta_id % n` (the grid must be a multiple of n), and a cluster becomes resident as a whole,
  once n SMs are free. `cluster.sync` is syncthreads over the running warpgroups of every CTA of
  the cluster. `mbarrier.arrive b[i] cta(r)` arrives on b[i] of the CTA of rank r;
  `tma.load ... bar(b[i]) multicast(mask)` writes its box into the same sub-array of every CTA
  whose rank bit is set and completes its bytes on that CTA's b[i] (each copy lands on its own).
  A peer's bytes may land before the CTA's own arrive_expect_tx: tx goes below zero until then.
* Kernel-level statements are executed by every warpgroup for control flow and bindings, but
  their side effects (mbarrier.*, fences, TMA, global/smem stores) happen once per CTA, by its
  first warpgroup ("thread 0"). `syncthreads` is the CTA barrier over the warpgroups still
  running. A `Role` runs its body in the warpgroups it owns, with `wg` bound.
* Scheduling: at every step a seeded `random.Random` picks one runnable coroutine (which runs
  one statement) or one pending asynchronous operation (which progresses: a TMA load lands, a
  TMA store reads smem or writes global). A coroutine blocked on a wait is parked until the
  state it waits on changes, then retries. No runnable coroutine and nothing asynchronous in
  flight is a deadlock.
* mbarriers count arrivals, transaction bytes and phases like the hardware: a phase completes
  when all arrivals are in and tx is zero; `mbarrier.wait b phase(p)` passes once the phase of
  parity p has completed (current parity != p). More bytes than announced, once every arrival
  of the phase is in, is an error.
* Named barriers count warps like the hardware: `bar.sync id, n` completes a round once n / 32
  warps have arrived at `id`, whichever warpgroups they belong to (a warpgroup arrives with its
  4 warps). Rounds of one id reached by different warpgroups must be ordered by happens-before
  (below): otherwise the GPU may complete a round with warps of several groups, and that is
  reported, as is a round that would take only part of a warpgroup's warps.
* Expressions are the emitted CUDA's (`lowering/evaluate.py`): 32-bit `int` arithmetic with C's
  truncating `/` and `%` (an overflow is an error), fp32 floats.
* Register tiles start undefined (NaN, not written): reading one before a write is an error.
* wgmma results land at the `wgmma.wait` that covers their commit group; the math is
  acc = (accumulate ? acc : 0) + A @ B in fp32 with one torch matmul per `wgmma.mma`.

Race detection is happens-before, not timing, so a protocol bug is reported on every seed:
every agent carries a vector clock (own epochs plus, per mbarrier, the number of completed
phases it has observed). The agents are the warpgroups (what all of a warpgroup's threads did
or learned) and their elected threads (what `elect_one` did: TMA issue and waits, its mbarrier
waits and arrivals); the elected thread knows what its warpgroup learned, but what one of them
did reaches the other only through a barrier of the whole warpgroup (bar.sync, syncthreads).
Releases (mbarrier.arrive, bar.sync / bar.arrive, syncthreads) publish the clock, acquires (a
passing mbarrier.wait, bar.sync, syncthreads) merge it. Each smem region remembers its last
write and the reads since then:

* an async read (wgmma, TMA store) needs the last write to be known complete: a TMA load whose
  barrier phase the reader has observed, or a `tile.store_smem` followed by
  `fence.proxy.async` (by the writer) that the reader is ordered after;
* a write (TMA load at issue, `tile.store_smem`) needs every read since the previous write to
  have ended (wgmma.wait / tma.wait.read) and that end to be known to the writer — a consumer
  that releases a stage before its `wgmma.wait` is caught even when the timing was lucky, and
  so is a warpgroup that rewrites its TMA-store staging tile after `elect_one { tma.wait.read }`
  without the bar.sync that tells its other threads the read has ended.

Between the CTAs of a cluster the same clocks apply (cluster.sync releases and acquires like
syncthreads): a peer's barrier must be initialised with its init known to the agent that
arrives on it or multicasts to it (`fence.mbarrier_init` then `cluster.sync`), a multicast is
race-checked in every CTA it writes into, and its target must still be running. A CTA exits
knowing the completion of the phase of every arrival a peer made on its barriers and of every
multicast a peer landed in its smem (its warpgroups' and elected threads' clocks merged; knowing
a peer's last arrival is not enough, its arrivals on different barriers are not ordered for
this CTA): otherwise a peer may still reach it after it exits, so a missing or short producer
tail is reported on every seed, not only when the timing shows it.

TMA box <-> smem sub-array: a box whose 2-D [rows, cols] shape (leading extent-1 dims dropped)
equals the tile a sub-array holds (`ir.tile_shape_of_subarray`) is written as that tile (column
chunks for a (chunks, R, W) sub-array); any other box of the same volume is written in memory
order (a [128, 64] box into a (2, 64, 64) sub-array fills [0] with rows 0-63 and [1] with rows
64-127, as `A[s]` / `A[s, wg]` use it). A `tma.load ... row(r)` writes its box, flattened to
[rows, W], into rows r .. r + rows - 1 of a 2-D [R, W] sub-array only, and its race checks cover
exactly those rows (such a buffer is tracked in row groups); a row outside the sub-array or off
the TMA / swizzle alignment is an error, as is an `ld.global` outside its tensor.

The simulator trusts the structure of what it runs: `simulate` first runs the verifier's
structural checks (`verify(kernel, contract=False)`: names, scopes, shapes, dtypes, limits), and
raises its `VerifyError` for a kernel that breaks one. What it checks itself is what only a run
can show: deadlocks, races, expect_tx bytes, barrier phases and indices, named-barrier rounds,
reads of unwritten register tiles, values of expressions (overflow, division by zero). Every
message names the CTA, role, warpgroup, statement (with its IR line) and loop variables.
Where it relies on a verified rule it keeps a cheap internal assert
(`errors.SimulatorInternalError`), not a second user message.

Layout: this package's entry is `simulate`; `errors` holds the error classes, `report` the
`SimReport`; `text` spells statements for messages (expressions are compiled by
`lowering/evaluate.py`, the IR's one definition of its arithmetic); `state` holds the run-time
state (coroutines, mbarriers, smem cells, TMA operations, register tiles); `machine` is the
scheduler, assembled from one mixin per concern: `prepare` (arguments, statements compiled to
nodes), `sync` (mbarriers, a peer's barriers, named barriers, syncthreads, cluster.sync),
`async_proxy` (smem race checks, TMA and its multicast, wgmma), `tiles` (register tile ops) and
`global_sync` (global memory between CTAs: tile stores and loads, GPU fences, atomics,
`ld.shared`, `ld.global`). `trace` is the timeline's vocabulary (which statements are
stamped, the events, the builder the GPU trace shares) and `traced_machine` the machine that
stamps them.
"""

from __future__ import annotations

import torch

from .. import ir
from ..verify import VerifyError, verify
from .errors import (
    DeadlockError, ProtocolError, RaceError, SimulationError, SimulatorInternalError,
)
from .machine import Machine
from .report import SimReport
from .trace import Trace, TraceEvent
from .traced_machine import TracingMachine

__all__ = ["simulate", "SimReport", "Trace", "TraceEvent", "SimulationError", "DeadlockError", "RaceError",
           "ProtocolError", "SimulatorInternalError", "VerifyError"]


def simulate(kernel: ir.Kernel, args: dict[str, "torch.Tensor | int | float"], *, num_sms: int = 4,
             seed: int = 0, max_steps: int = 5_000_000, trace: bool = False) -> SimReport:
    """Run `kernel` on the CPU over every CTA of its grid; outputs are written into `args`' tensors.

    `args` maps every parameter name to a Python number (i32 / f32 params) or a CPU torch tensor
    of the declared shape (tensormap / global params; any dtype: reads see values rounded to
    the declared dtype, writes are rounded to it, then stored in the tensor's dtype). A host
    param left out is computed as the host would (from the scalars and `num_sms`), a workspace
    left out is allocated (zeros if `zeroed`, else NaN); a zeroed workspace must be zero again
    when the run ends.
    `seed` picks the interleaving; `max_steps` bounds the run (a DeadlockError past it).
    `trace=True` records a timeline of every warpgroup on the scheduler's step clock into
    `report.trace` (`trace.Trace`; a SimulationError then carries the run so far as `.trace`);
    the interleaving is the same either way, and tracing off costs nothing.
    Raises VerifyError if the kernel breaks a structural rule of the IR (nothing runs), else
    DeadlockError, RaceError or ProtocolError (all SimulationError) naming the CTA, role,
    warpgroup, statement and loop variables involved.
    """
    if num_sms < 1:
        raise SimulationError(f"num_sms must be >= 1, got {num_sms}")
    verify(kernel, contract=False)
    machine = (TracingMachine if trace else Machine)(kernel, args, num_sms, seed, max_steps)
    # One matmul per wgmma is tiny ([64, K] @ [K, N]): intra-op threads only add contention
    # (10x slower on a busy 2-core machine), so run single-threaded and restore the caller's setting.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return machine.run()
    finally:
        torch.set_num_threads(threads)
