"""reg_realloc: hand the producer's registers to the consumers with setmaxnreg.

The producer only issues copies and lives on few registers; the consumers hold accumulators.
Every role starts with its setmaxnreg. That the CTA's register pool holds them all (Σ warpgroups
x 128 threads x registers <= the launch share x threads, `target.register_pool`) is the
verifier's check, run on the kernel this pass returns.

    after:  role producer warpgroups(1) registers(40) { setmaxnreg.dec 40  ... }
            role consumer warpgroups(2) registers(232) { setmaxnreg.inc 232  ... }
"""

from __future__ import annotations

from dataclasses import replace

from wsched.names import CONSUMER, PRODUCER

from .. import ir
from ..context import LoweringContext
from ..rewrite import map_role


def run(kernel: ir.Kernel, ctx: LoweringContext) -> ir.Kernel:
    s = ctx.schedule
    budget = {PRODUCER: ("dec", s.producer_registers), CONSUMER: ("inc", s.consumer_registers)}
    for name, (action, regs) in budget.items():
        kernel = map_role(kernel, name, lambda r, a=action, n=regs: replace(
            r, registers=n, body=(ir.Setmaxnreg(a, n),) + r.body))
    return kernel
