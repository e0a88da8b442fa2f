"""Mutation operators over the printed loop IR, for tests/test_mutations.py.

The IR text is read as blocks of sibling statements by indentation and braces (`Text.blocks`);
each operator edits that text at one statement (drop, duplicate, move, or rewrite one field)
and yields `Edit`s. An operator is either harmful (each mutant it makes misbehaves on a GPU:
hangs, races, computes a wrong result, or does what PTX leaves undefined; it must be caught
before the GPU) or benign (each mutant is equivalent to the kernel on a GPU and must pass every
layer); each operator's docstring says why, and tests/test_mutations.py lists the few mutants of
a harmful operator that one kernel makes equivalent. Mutants come out in text order, so the set
is deterministic.

    for op in OPERATORS:
        for edit in op.apply(Text(ir_text)):
            edit.line, edit.before, edit.text      # IR line, the statement it changed, new text
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property
from typing import Callable, Iterator

from wsched.lowering import ir
from wsched.lowering.evaluate import evaluate
from wsched.lowering.parser import parse_kernel
from wsched.lowering.verify.lines import sites, statement_lines
from wsched.target import SETMAXNREG_MAX, SETMAXNREG_MIN, WARPGROUP_THREADS, launch_registers, register_pool


@dataclass(frozen=True)
class Stmt:
    """One statement of the printed IR: lines [start, end) (a block statement spans to its
    closing brace), its first line stripped, and its indentation."""

    start: int
    end: int
    head: str
    indent: str


@dataclass(frozen=True)
class Edit:
    line: int              # 1-based IR line of the statement the edit is about
    before: str            # that statement's first line, stripped
    after: str             # what the edit did, in words or the new line
    text: str              # the whole mutated IR


class Text:
    """The printed IR as lines and as blocks of sibling statements."""

    def __init__(self, text: str):
        self.lines = text.splitlines()

    @cached_property
    def blocks(self) -> list[list[Stmt]]:
        """Every block's statements, in order (the kernel body's first)."""
        blocks: list[list[Stmt]] = []

        def block(i: int) -> int:                 # from line i to the line that closes the block
            siblings: list[Stmt] = []
            blocks.append(siblings)
            while i < len(self.lines) and not self.lines[i].strip().startswith("}"):
                line = self.lines[i]
                head, j = line.strip(), i + 1
                if head.endswith("{"):
                    j = block(i + 1)
                    while self.lines[j].strip() == "} else {":
                        j = block(j + 1)
                    j += 1
                siblings.append(Stmt(i, j, head, line[:len(line) - len(line.lstrip())]))
                i = j
            return i

        block(1)                                  # line 0 is the kernel header
        return blocks

    @cached_property
    def all(self) -> list[Stmt]:
        return sorted((s for b in self.blocks for s in b), key=lambda s: s.start)

    def body(self, s: Stmt) -> str:
        return "\n".join(self.lines[s.start:s.end])

    def joined(self, lines: list[str]) -> str:
        return "\n".join(lines) + "\n"

    def replace(self, s: Stmt, new_lines: list[str], after: str) -> Edit:
        lines = self.lines[:s.start] + new_lines + self.lines[s.end:]
        return Edit(s.start + 1, s.head, after, self.joined(lines))

    def rewrite(self, s: Stmt, head: str) -> Edit:
        """`s` (a one-line statement) with its text replaced by `head`."""
        return self.replace(s, [s.indent + head], head)

    def drop(self, s: Stmt) -> Edit:
        return self.replace(s, [], "dropped")

    def duplicate(self, s: Stmt) -> Edit:
        return self.replace(s, self.lines[s.start:s.end] * 2, "duplicated")

    def move_after(self, s: Stmt, anchor: Stmt, after: str) -> Edit:
        """`s` moved to just after its later sibling `anchor`."""
        moved = self.lines[s.start:s.end]
        lines = self.lines[:s.start] + self.lines[s.end:anchor.end] + moved + self.lines[anchor.end:]
        return Edit(s.start + 1, s.head, after, self.joined(lines))

    def move_before(self, s: Stmt, anchor: Stmt, after: str) -> Edit:
        """`s` moved to just before its earlier sibling `anchor`."""
        moved = self.lines[s.start:s.end]
        lines = self.lines[:anchor.start] + moved + self.lines[anchor.start:s.start] + self.lines[s.end:]
        return Edit(s.start + 1, s.head, after, self.joined(lines))

    @cached_property
    def stages(self) -> dict[str, int]:
        """Slots of every declared barrier and stages of every smem buffer (its first dim)."""
        found = {}
        for line in self.lines:
            m = re.match(r"\s*barrier (\w+)\[(\d+)\]", line) or re.match(r"\s*smem (\w+): \w+\[(\d+)", line)
            if m:
                found[m.group(1)] = int(m.group(2))
        return found

    def role_of(self, s: Stmt) -> str:
        """The name of the role `s` is in ("" at kernel level)."""
        for line in reversed(self.lines[:s.start + 1]):
            m = re.match(r"  role (\w+) ", line)
            if m:
                return m.group(1)
        return ""

    def stage_lets(self) -> dict[str, int]:
        """Lets used as a barrier slot (`let s = it % 3` for `full[s]`), with their stage count."""
        used = {name for line in self.lines for bar, name in re.findall(r"(\w+)\[(\w+)\]", line)
                if bar in self.stages}
        return {m.group(1): int(m.group(2)) for s in self.all
                if (m := re.match(r"let (\w+) = .* % (\d+)$", s.head)) and m.group(1) in used}


@dataclass(frozen=True)
class Operator:
    name: str
    harmful: bool
    apply: Callable[[Text], Iterator[Edit]]
    why: str


OPERATORS: list[Operator] = []


def operator(harmful: bool):
    """Register `fn(text) -> Iterator[Edit]` as an operator; its docstring says why its mutants
    are harmful (or benign)."""
    def register(fn):
        OPERATORS.append(Operator(fn.__name__, harmful, fn, " ".join((fn.__doc__ or "").split())))
        return fn
    return register


def each(harmful: bool, pattern: str, edit: Callable[[Text, Stmt], Edit]):
    """Register an operator that applies `edit` (`Text.drop`, `Text.duplicate`) to every statement
    matching `pattern`; the decorated function only carries the name and the docstring."""
    def register(fn):
        def apply(t: Text) -> Iterator[Edit]:
            return (edit(t, s) for s in t.all if re.match(pattern, s.head))
        apply.__name__, apply.__doc__ = fn.__name__, fn.__doc__
        return operator(harmful)(apply)
    return register


def heads(t: Text, prefix: str) -> Iterator[Stmt]:
    return (s for s in t.all if s.head.startswith(prefix))


def siblings_of(t: Text, s: Stmt) -> list[Stmt]:
    return next(b for b in t.blocks if s in b)


# --- waits and arrives -----------------------------------------------------------------------------


@each(harmful=True, pattern=r"mbarrier\.wait ", edit=Text.drop)
def drop_wait():
    """No acquire: the consumer reads a stage before its TMA lands, or the producer overwrites a
    stage a consumer still reads."""


@each(harmful=False, pattern=r"mbarrier\.wait ", edit=Text.duplicate)
def duplicate_wait():
    """A second wait on the same slot and parity right after the first passes at once: that
    barrier's next phase needs, through the other role, an arrival this warpgroup has not made."""


@operator(harmful=True)
def wait_after_use(t):
    """The wait moved past the first statement that reads or refills what it guards (a wgmma,
    a TMA load, or a loop holding them): that statement runs before the acquire."""
    for s in heads(t, "mbarrier.wait "):
        later = siblings_of(t, s)
        for anchor in later[later.index(s) + 1:]:
            if re.search(r"wgmma\.mma|tma\.load", t.body(anchor)):
                yield t.move_after(s, anchor, f"moved after `{anchor.head}`")
                break


@operator(harmful=False)
def producer_waits_reordered(t):
    """A later acquire in the producer's block hoisted above an earlier one on another barrier:
    waiting for a stage earlier only delays the loads (the release it waits for comes from a
    consumer step that needs only loads issued before, with two or more stages). In a consumer
    the same move can wait for the producer's next tile before the stages this tile needs."""
    for block in t.blocks:
        waits = [s for s in block if s.head.startswith("mbarrier.wait ") and t.role_of(s) == "producer"]
        for first, later in zip(waits, waits[1:]):
            if first.head.split("[")[0] != later.head.split("[")[0]:
                yield t.move_before(later, first, f"moved before `{first.head}`")


@operator(harmful=False)
def wait_before_wgmma_fence(t):
    """`mbarrier.wait; wgmma.fence` swapped: the fence orders this warpgroup's register
    accesses before the wgmma, the wait orders the stage's bytes before it; both still precede
    the wgmma."""
    for block in t.blocks:
        for wait, fence in zip(block, block[1:]):
            if wait.head.startswith("mbarrier.wait ") and fence.head == "wgmma.fence":
                yield t.move_after(wait, fence, "moved after `wgmma.fence`")


@each(harmful=True, pattern=r"mbarrier\.arrive ", edit=Text.drop)
def drop_arrive():
    """No release: the producer waits forever for the stage (deadlock)."""


@each(harmful=True, pattern=r"mbarrier\.arrive ", edit=Text.duplicate)
def duplicate_arrive():
    """Two arrivals from one warpgroup complete the empty phase without the other warpgroup:
    the producer refills a stage that warpgroup still reads."""


@operator(harmful=True)
def release_before_wgmma_wait(t):
    """The release (with the lets it needs) moved above the `wgmma.wait` that retires the wgmma
    reading the stage: the producer refills it while the wgmma may still read it."""
    for block in t.blocks:
        for i, s in enumerate(block):
            if not re.search(r"^\s*mbarrier\.arrive ", t.body(s), re.M) or "wgmma.mma" in t.body(s):
                continue
            j = i - 1
            while j >= 0 and block[j].head.startswith("let "):
                j -= 1
            if j >= 0 and block[j].head.startswith("wgmma.wait "):
                yield t.move_after(block[j], s, f"`{block[j].head}` moved after the release")


# --- expect_tx ---------------------------------------------------------------------------------------


@each(harmful=True, pattern=r"mbarrier\.arrive_expect_tx ", edit=Text.drop)
def drop_expect_tx():
    """Nothing arrives on the full barrier and nobody announces the bytes the loads complete:
    the consumers wait forever (and the transaction count goes negative)."""


@each(harmful=True, pattern=r"mbarrier\.arrive_expect_tx ", edit=Text.duplicate)
def duplicate_expect_tx():
    """A second arrival on a one-arrival full barrier, with twice the bytes announced."""


@operator(harmful=True)
def expect_tx_bytes(t):
    """Half or twice the bytes the loads deliver: the phase completes before the data lands, or
    never."""
    for s in heads(t, "mbarrier.arrive_expect_tx "):
        n = int(re.search(r"bytes\((\d+)\)", s.head).group(1))
        for wrong in (n // 2, n * 2):
            yield t.rewrite(s, s.head.replace(f"bytes({n})", f"bytes({wrong})"))


# --- phases and stages ----------------------------------------------------------------------------


@operator(harmful=True)
def flip_parity(t):
    """The other parity: the consumer reads a stage before it is filled, or the producer
    waits for a phase that never completes."""
    for s in heads(t, "mbarrier.wait "):
        phase = re.search(r"phase\((.*)\)$", s.head).group(1)
        flipped = phase[:-4] if phase.endswith(" ^ 1") else f"{phase} ^ 1"
        yield t.rewrite(s, s.head.replace(f"phase({phase})", f"phase({flipped})"))


@operator(harmful=True)
def phase_not_from_counter(t):
    """`ph = it / S & 1` -> `it & 1`: with S > 1 stages the parity flips every step, not every
    pass through the ring."""
    for s in t.all:
        m = re.match(r"let (\w+) = (\w+) / (\d+) & 1$", s.head)
        if m and int(m.group(3)) > 1:
            yield t.rewrite(s, f"let {m.group(1)} = {m.group(2)} & 1")


@operator(harmful=True)
def phase_truncating(t):
    """`phase(ph ^ 1)` -> `phase((it - S) / S & 1)`: equal under floor division, but C
    truncates toward zero, so on the GPU the first pass through stages 1..S-1 waits for
    parity 0, which never completes (the issue's deadlock)."""
    for s in heads(t, "mbarrier.wait "):
        m = re.search(r"\[(\w+)\] phase\((\w+) \^ 1\)$", s.head)
        if not m:
            continue
        block = siblings_of(t, s)
        lets = {x.head.split()[1]: x.head for x in block if x.head.startswith("let ")}
        stage = re.match(r"let \w+ = (\w+) % (\d+)$", lets.get(m.group(1), ""))
        if stage and lets.get(m.group(2)) == f"let {m.group(2)} = {stage.group(1)} / {stage.group(2)} & 1":
            counter, n = stage.group(1), stage.group(2)
            yield t.rewrite(s, s.head.replace(f"phase({m.group(2)} ^ 1)", f"phase(({counter} - {n}) / {n} & 1)"))


@operator(harmful=True)
def stage_shift(t):
    """A slot let one stage off (`(it + 1) % S`): that role uses another stage than the other."""
    for name, n in t.stage_lets().items():
        if n < 2:
            continue
        for s in t.all:
            m = re.match(rf"let {name} = (.*) % {n}$", s.head)
            if m:
                yield t.rewrite(s, f"let {name} = ({m.group(1)} + 1) % {n}")


@operator(harmful=True)
def operand_stage(t):
    """A TMA destination or a wgmma operand one stage off: a load lands in a stage its barrier
    does not guard, or a wgmma reads a stage its warpgroup does not hold."""
    for s in t.all:
        if not s.head.startswith(("tma.load ", "wgmma.mma ")):
            continue
        for m in re.finditer(r"\b([A-Z]\w*)\[(\w+)", s.head):
            buffer, index = m.groups()
            n = t.stages.get(buffer, 1)
            if n > 1:
                head = s.head[:m.start()] + f"{buffer}[({index} + 1) % {n}" + s.head[m.end():]
                yield t.rewrite(s, head)


# --- barrier arrival counts ---------------------------------------------------------------------


@operator(harmful=True)
def init_arrivals(t):
    """One arrival more (the phase never completes) or fewer (it completes before every
    warpgroup has released the stage)."""
    for s in heads(t, "mbarrier.init "):
        n = int(re.search(r"arrivals\((\d+)\)", s.head).group(1))
        for wrong in (n + 1, n - 1):
            if wrong >= 1:
                yield t.rewrite(s, s.head.replace(f"arrivals({n})", f"arrivals({wrong})"))


# --- named barriers -------------------------------------------------------------------------------


def _named(t):
    for s in t.all:
        m = re.match(r"(bar\.(?:sync|arrive)) (.*), (\d+)$", s.head)
        if m:
            yield s, m.group(1), m.group(2), int(m.group(3))


def _barrier_ids(text: str) -> dict[tuple, tuple[int, bool]]:
    """(statement's IR line, wg) -> (barrier id, is a bar.arrive) for every named barrier use a
    warpgroup reaches, following `wg` in ids and in branch conditions."""
    kernel = parse_kernel(text)
    lines = statement_lines(kernel)
    uses = {}
    for site in sites(kernel):
        if not isinstance(site.stmt, (ir.NamedBarrierSync, ir.NamedBarrierArrive)):
            continue
        for wg in range(site.role.warpgroups) if site.role is not None else (None,):
            env = {} if wg is None else {"wg": wg}
            taken = [(bool(evaluate(a.cond, env)), site.path[d + 1] < len(a.then))
                     for d, a in enumerate(site.ancestors) if isinstance(a, ir.If) and _computable(a.cond, env)]
            if all(want == took for want, took in taken):
                uses[(lines[site.path], wg)] = (evaluate(site.stmt.id, env), isinstance(site.stmt, ir.NamedBarrierArrive))
    return uses


def _computable(e, env) -> bool:
    try:
        evaluate(e, env)
        return True
    except (KeyError, ValueError):
        return False


def _id_edits(t: Text) -> Iterator[tuple[Edit, bool]]:
    """Each named barrier's id replaced by the id without `wg`, one higher, or another statement's
    id, with whether that is harmful: ids unchanged for every warpgroup are no mutant; a token
    barrier (one a bar.arrive reaches) changed, or a warpgroup meeting other warpgroups on its
    barrier than before, is harmful; a barrier only synced on, renamed without changing who
    meets on it, is not."""
    named = list(_named(t))
    before = _barrier_ids(t.joined(t.lines))
    tokens = {bid for bid, arrive in before.values() if arrive}
    for s, verb, bid, n in named:
        candidates = [re.sub(r" [+-] wg$", "", bid), f"{bid} + 1"] + [other for _, _, other, _ in named]
        for new in dict.fromkeys(c for c in candidates if c != bid):
            edit = t.rewrite(s, f"{verb} {new}, {n}")
            after = _barrier_ids(edit.text)
            if after == before:
                continue
            mine = [key for key in before if key[0] == edit.line]
            ids = {before[key][0] for key in mine} | {after[key][0] for key in mine}
            later_tokens = {bid for bid, arrive in after.values() if arrive}
            if verb == "bar.arrive" or ids & (tokens | later_tokens):
                yield edit, True
            else:
                yield edit, any(_partners(before, key) != _partners(after, key) for key in mine)


def _partners(uses: dict, key) -> set:
    """The warpgroups that reach the barrier the use `key` reaches."""
    return {k[1] for k, (bid, _) in uses.items() if bid == uses[key][0]}


@operator(harmful=True)
def named_barrier_id(t):
    """Another id where that changes who meets on the barrier: without `wg` the warpgroups share
    one barrier counted for one of them; shifted or borrowed, two groups meet on one id or a
    token goes to the wrong barrier (deadlock)."""
    yield from (edit for edit, harmful in _id_edits(t) if harmful)


@operator(harmful=False)
def named_barrier_renamed(t):
    """A barrier only synced on, moved to an id no other group reaches: the same threads meet."""
    yield from (edit for edit, harmful in _id_edits(t) if not harmful)


@operator(harmful=True)
def named_barrier_threads(t):
    """A thread count that differs from the threads reaching the id: the barrier completes
    early (orders nothing) or never."""
    for s, verb, bid, n in _named(t):
        for wrong in (n + 128, n - 128):
            if wrong >= 128:
                yield t.rewrite(s, f"{verb} {bid}, {wrong}")


@each(harmful=True, pattern=r"bar\.(sync|arrive) ", edit=Text.drop)
def drop_named_barrier():
    """A named barrier dropped: the staging buffer is rewritten while the TMA store may read it,
    one thread stores what the others have not written, or the ping-pong token count goes odd
    (deadlock)."""


# --- setmaxnreg -----------------------------------------------------------------------------------


@operator(harmful=True)
def setmaxnreg_direction(t):
    """.inc <-> .dec: the producer cannot hand its registers over, the consumers' increase waits
    forever (or ptxas rejects a decrease above the launch count)."""
    for s in heads(t, "setmaxnreg."):
        action = "inc" if s.head.startswith("setmaxnreg.dec") else "dec"
        yield t.rewrite(s, f"setmaxnreg.{action} {s.head.split()[1]}")


def _register_use(t: Text, changed: Stmt, registers: int) -> int:
    """Σ warpgroups × 128 × registers over the roles, with the role holding `changed` at
    `registers` per thread."""
    total = 0
    for s in heads(t, "role "):
        m = re.match(r"role \w+ warpgroups\((\d+)\) registers\((\d+)\)", s.head)
        held = registers if s.start < changed.start < s.end else int(m.group(2))
        total += int(m.group(1)) * WARPGROUP_THREADS * held
    return total


def _threads(t: Text) -> int:
    return WARPGROUP_THREADS * sum(int(re.search(r"warpgroups\((\d+)\)", s.head).group(1)) for s in heads(t, "role "))


@operator(harmful=True)
def setmaxnreg_value(t):
    """8 registers more or fewer where that breaks the hardware: over the CTA's register pool (the
    consumers' increase never completes) or below setmaxnreg's minimum of 24 (ptxas rejects it).
    A change that still fits is harmless on the GPU, so it is not made here."""
    for s in heads(t, "setmaxnreg."):
        action, n = s.head.split()
        for wrong in (int(n) + 8, int(n) - 8):
            if not SETMAXNREG_MIN <= wrong <= SETMAXNREG_MAX or _register_use(t, s, wrong) > register_pool(_threads(t)):
                yield t.rewrite(s, f"{action} {wrong}")


@operator(harmful=True)
def drop_setmaxnreg(t):
    """A role left at the registers its warps start with, where the register file cannot hold
    that beside the other roles' budgets in the CTA's pool: their increase never completes. (A role whose start
    still fits only runs with other registers than it declares: not made here.)"""
    start = launch_registers(_threads(t))
    for s in heads(t, "setmaxnreg."):
        if _register_use(t, s, start) > register_pool(_threads(t)):
            yield t.drop(s)


@each(harmful=True, pattern=r"setmaxnreg\.", edit=Text.duplicate)
def duplicate_setmaxnreg():
    """Two setmaxnreg without a warpgroup barrier between them are undefined (PTX ISA)."""


# --- fences, commits, waits on async groups ----------------------------------------------------------


@each(harmful=True, pattern=r"(fence\.proxy\.async|fence\.mbarrier_init|syncthreads)$", edit=Text.drop)
def drop_fence():
    """fence.proxy.async: the TMA store (async proxy) may read smem before the generic stores
    are visible to it. fence.mbarrier_init or the syncthreads after it: the roles may use
    barriers before their initialisation is visible."""


@each(harmful=False, pattern=r"(fence\.proxy\.async|fence\.mbarrier_init|wgmma\.fence)$", edit=Text.duplicate)
def duplicate_fence():
    """A fence right after the same fence orders nothing new."""


@each(harmful=True, pattern=r"(wgmma|tma)\.commit$", edit=Text.drop)
def drop_commit():
    """wgmma.commit: the wgmmas join no group (or the next one), so `wgmma.wait` does not
    retire them before their stage is released and their accumulator read. tma.commit: the
    stores join no bulk group, so `tma.wait` does not cover them."""


@each(harmful=False, pattern=r"(wgmma|tma)\.commit$", edit=Text.duplicate)
def duplicate_commit():
    """A second commit adds an empty group: `wait N` then keeps one real group fewer in
    flight, which only waits longer."""


@operator(harmful=True)
def wait_count_more(t):
    """`wgmma.wait N` / `tma.wait[.read] N` -> N + 1: a group still reading (or writing) is
    left pending when its stage is released, its accumulator read or its staging rewritten."""
    for s in t.all:
        m = re.match(r"(wgmma\.wait|tma\.wait\.read|tma\.wait) (\d+)$", s.head)
        if m:
            yield t.rewrite(s, f"{m.group(1)} {int(m.group(2)) + 1}")


@operator(harmful=False)
def wait_count_less(t):
    """`wgmma.wait N` -> N - 1: waits for one more group, which only waits longer."""
    for s in t.all:
        m = re.match(r"(wgmma\.wait) (\d+)$", s.head)
        if m and int(m.group(2)) > 0:
            yield t.rewrite(s, f"{m.group(1)} {int(m.group(2)) - 1}")


@each(harmful=True, pattern=r"tma\.wait(\.read)? \d+$", edit=Text.drop)
def drop_tma_wait():
    """The staging buffer is rewritten while an earlier TMA store may still read it, or the
    CTA exits with stores in flight."""


# --- register tiles ---------------------------------------------------------------------------------


@each(harmful=True, pattern=r"tile\.fill ", edit=Text.drop)
def drop_tile_fill():
    """A register tile read before any write (uninitialised registers on the GPU)."""


@operator(harmful=True)
def tile_fill_value(t):
    """An initial value the first update does not wash out: inf (a running max of inf turns
    every exponent into -inf, a running sum or output of inf times a zero correction into NaN).
    A finite change would not do: the first correction factor is exp2(-inf) = 0."""
    for s in heads(t, "tile.fill "):
        name, value = s.head[len("tile.fill "):].split(", ")
        yield t.rewrite(s, f"tile.fill {name}, inf")


@each(harmful=False, pattern=r"tile\.fill ", edit=Text.duplicate)
def duplicate_tile_fill():
    """Writing the same value twice."""


# --- split-K: the ticket of an output tile and the ordering of its partials -------------------------


@each(harmful=True, pattern=r"fence\.acq_rel\.gpu$", edit=Text.drop)
def drop_gpu_fence():
    """The release before the ticket (the other CTAs may read this unit's partial before it is
    visible) or the acquire after it (this unit may read the others' partials before they are)."""


@each(harmful=False, pattern=r"fence\.acq_rel\.gpu$", edit=Text.duplicate)
def duplicate_gpu_fence():
    """A GPU fence right after the same fence orders nothing new."""


@operator(harmful=True)
def ticket_wrap(t):
    """The ticket wraps one arrival late: the last unit of a tile still finds itself last, but
    the counter is left non-zero and the next call's units of that tile miscount (a wrong sum)."""
    for s in heads(t, "atomic.inc "):
        m = re.search(r"wrap\((.*)\)$", s.head)
        yield t.rewrite(s, s.head[:m.start()] + f"wrap({m.group(1)} + 1)")


@operator(harmful=True)
def ignore_ticket(t):
    """Every unit takes itself for the last one and sums the partials: it reads partials the
    other units may not have stored yet (and several units store the output)."""
    read = {s.head.split()[1] for s in heads(t, "ld.shared ")}
    for s in heads(t, "set "):
        if read & _words(s.head.split("=", 1)[1]):
            yield t.rewrite(s, f"{s.head.split('=')[0].strip()} = 1")


# --- paged caches: page reads and the rows a box lands in ---------------------------------------------


@operator(harmful=True)
def page_row_shifted(t):
    """A box loaded into rows of its sub-array lands 8 rows further down (a page of a kv block, a
    cluster rank's piece of a shared tile): it overlaps the next box's rows (or runs past the
    sub-array), and the 8 rows it should have filled keep the stage's previous data."""
    for s in heads(t, "tma.load "):
        m = re.search(r" row\(([^<]*?)\) <-", s.head)
        if m:
            row = m.group(1)
            shifted = str(int(row) + 8) if row.isdigit() else f"{row} + 8"
            yield t.rewrite(s, s.head[:m.start()] + f" row({shifted}) <-" + s.head[m.end():])


@operator(harmful=True)
def page_read_of_next_slice(t):
    """A slice's page index read one table entry later: the block gathers the next page's keys
    in its place (a wrong result), or reads past a sequence's pages."""
    for s in heads(t, "ld.global page"):
        m = re.search(r"\[b0, (.*)\]$", s.head)
        if m:
            yield t.rewrite(s, s.head[:m.start()] + f"[b0, min({m.group(1)} + 1, MP - 1)]")


# --- independent statements swapped -----------------------------------------------------------------


def _words(text: str) -> set[str]:
    return set(re.findall(r"[A-Za-z_]\w*", text))


@operator(harmful=False)
def swap_independent(t):
    """Two adjacent lets where neither reads the other, two TMA loads announced by the same
    expect_tx, or two tile.fill of different tiles: the order between them is unobservable."""
    for block in t.blocks:
        for a, b in zip(block, block[1:]):
            if a.head.startswith("let ") and b.head.startswith("let "):
                if a.head.split()[1] in _words(b.head) or b.head.split()[1] in _words(a.head):
                    continue
            elif a.head.startswith("tma.load ") and b.head.startswith("tma.load "):
                if a.head.split(" bar(")[1] != b.head.split(" bar(")[1]:
                    continue
            elif not (a.head.startswith("tile.fill ") and b.head.startswith("tile.fill ")):
                continue
            yield t.move_after(a, b, f"swapped with `{b.head}`")


def operator_named(name: str) -> Operator:
    return next(op for op in OPERATORS if op.name == name)
