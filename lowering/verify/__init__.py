"""The loop-IR verifier: structural rules, Hopper limits, and the load/compute contract.

`verify(kernel)` raises a `VerifyError` that lists every problem; `verify_all(kernel)` returns
them as `Diagnostic`s. IR nodes carry no source positions, so a statement is named by its
traversal path (child indices from the kernel body down; an `if`'s children are its `then`
statements followed by its `else` statements) and every message points at the line that
statement has in the printed IR (`print_kernel`: header on line 1, one line per smem and barrier
declaration, one line per statement, a closing `}` or `} else {` on a line of its own):

    IR line 23 (role consumer > for k > mbarrier.wait): <what is wrong>; <what would be right>

Two layers, so that `verify(kernel, contract=False)` can check a partially lowered kernel:

* structural checks: names and scopes, references to declarations, shapes and dtypes of every
  copy, MMA and tile op, the order of barrier initialisation, warpgroup-collective statements
  kept out of elect_one, and the hardware limits of `wsched/target.py` (registers, threads,
  shared memory, named barriers, setmaxnreg, TMA boxes);
* the contract between the load and compute nests (docs/architecture.md): expect_tx bytes,
  stage and barrier slot agreement, barrier arrival counts, the same (tile, k) traversal with
  the same stage and phase on both sides, no stage released (and no smem overwritten) while a wgmma
  reading it may be pending, and generic smem writes fenced before TMA or wgmma read them.
  The dynamic half runs each role's control flow on the host for a few sample problem sizes
  and CTAs and checks the recorded barrier operations, wgmma groups and smem accesses.

This package's entry is `verify`; the work is done in

* `lines`: IR line numbers, traversal paths and the location text of every message;
* `structure`: the structural walk (names, scopes, barriers, limits);
* `types`: well-typedness, run first: every field of the type `ir` declares (so a kernel built
  in Python with a None, str or float where an int or an expression belongs is reported, not
  crashed on), nesting within the limits the parser also enforces;
* `tiles`: its shape checks of TMA copies, wgmma operands and tile ops;
* `global_sync`: its checks of `fence.acq_rel.gpu`, `atomic.inc` and `ld.shared` (split-K's tickets)
  and of `ld.global` (a paged cache's page table and lengths);
* `contract`: the load/compute contract, static and on host-run traces;
* `errors`: `VerifyError`.

The simulator runs the structural layer before every simulation and trusts what it checks.
"""

from __future__ import annotations

from .. import ir
from .contract import ContractCheck
from .errors import VerifyError
from .lines import Diagnostic, Report, children, statement_at, statement_lines
from .structure import StructureCheck
from .types import type_problems

__all__ = [
    "Diagnostic", "VerifyError", "verify", "verify_all", "children", "statement_at", "statement_lines",
]


def verify(kernel: ir.Kernel, *, contract: bool = True) -> None:
    """Raise VerifyError if `kernel` has any problem (`contract=False`: structural checks only,
    for kernels whose barriers and pipeline are not complete yet)."""
    problems = verify_all(kernel, contract=contract)
    if problems:
        raise VerifyError(problems)


def verify_all(kernel: ir.Kernel, *, contract: bool = True) -> list[Diagnostic]:
    """Every problem of `kernel`, ordered by IR line. A kernel whose fields are not of their
    declared types gets only those problems: the other checks rely on the types."""
    problems = type_problems(kernel)
    if problems:
        return sorted(problems, key=lambda d: d.line)
    report = Report(kernel)
    StructureCheck(kernel, report, require_init=contract).run()
    if contract:
        ContractCheck(kernel, report).run()
    return sorted(report.diagnostics, key=lambda d: d.line)
