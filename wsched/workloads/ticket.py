"""What the workloads share about split work (matmul's split-K, attention's split-KV): the ticket
a unit takes once its partial is stored, so that the unit of a tile that arrives last, and only
it, combines the partials. No unit waits for another (it cannot hang), and the counter wraps back
to 0 after the last arrival (the workspace is never cleared).

    bar.sync <sync>                         every thread's partial before the release
    elect_one { fence.acq_rel.gpu ; atomic.inc slot <- tickets[counter] wrap(last) ; fence.acq_rel.gpu }
    bar.sync <sync>                         the ticket (and what it acquired) to the warpgroup
    ld.shared ticket = slot
    set last_split = ticket == last
"""

from __future__ import annotations

from wsched.lowering import ir
from wsched.names import TICKETS


def take_ticket(slot: ir.SmemRef, counter: ir.Expr, last: ir.Expr, sync: ir.Stmt,
                name: str = "ticket", release: bool = True, acquire: bool = True) -> tuple[ir.Stmt, ...]:
    """The ticket of `counter` (a tile, or a tile's warpgroup) through the i32 smem `slot`, read
    into `name`: `last_split` (a `var`) becomes 1 for the unit whose ticket is `last` (splits - 1).
    `release=False` for a unit that stored nothing to hand over (the acquire fence alone),
    `acquire=False` for one that reads no partial on this ticket alone (the release fence alone)."""
    before = (ir.FenceGpu(),) if release else ()
    after = (ir.FenceGpu(),) if acquire else ()
    return (
        sync,
        ir.ElectOne(before + (ir.AtomicInc(slot, TICKETS, (counter,), last),) + after),
        sync,
        ir.LoadShared(name, slot),
        ir.Assign("last_split", ir.eq(name, last)),
    )
