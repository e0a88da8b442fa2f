"""The emitter's state while one kernel is spelled: text, scopes, names, expressions, references.

Every emit function (`emit.py`, `emit_async.py`, `emit_tiles.py`, `emit_tile_memory.py`) takes
an `Emitter` and appends lines to it:

    em.line("wsp::fence_proxy_async();")                  # one statement at the current depth
    em.guarded(em.one_thread(), "wsp::mbar_arrive(...);")  # run by one thread of the group
    with em.block("for (...) {"): ...                      # nested block and name scope
    em.expr(ir.BinOp("+", Var("k"), IntConst(1)))          # "k + 1" in C++ precedence

It also knows where the emitter stands in the execution model (`level`: kernel, role or
elect_one) so that an emit function can say why a statement is misplaced, and the C++ spelling
of every IR name (`c`): IR names that clash with C++ keywords or the emitter's own locals take a
trailing underscore.

The emitter spells verified IR: the verifier runs at the end of every lowering. A rule the
verifier already checks is only asserted here, with a comment naming the verifier's check
(`verifier _Wgmma`: the `_Wgmma` method of its structural walk). `EmitError` is for what only the
emitter knows: IR that is valid but has no CUDA spelling (yet), and statements placed where
their CUDA spelling cannot run.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

from wsched.lowering import ir
from wsched.target import BARRIER_BYTES, DTYPE_BYTES, TMA_MAX_RANK, WARPGROUP_THREADS, smem_round

from .fragment import Tile


class EmitError(ValueError):
    """The IR cannot be spelled in CUDA as it stands (names the statement and what is wrong)."""


# C++ names an IR name must not take: the emitter's own locals and helpers, CUDA builtins and
# C++ keywords. An IR name that would is spelled with a trailing underscore (`_cpp_names`).
_RESERVED = frozenset("""
    smem wsp_smem_raw wg_index fi fj fr row col row0 col0 row_ok row_addr v ptr i J chunk period
    st_base st_half fj2 st_v st_m st_j
    desc_a desc_b ceil_div bit_length min max fminf fmaxf expf exp2f logf tanhf erff make_float2 memcpy
    wsp threadIdx blockIdx gridDim blockDim warpSize INFINITY NAN uint8_t uint16_t uint32_t
    uint64_t uintptr_t float2 uint2 CUtensorMap
    alignas alignof and asm auto bool break case catch char class const constexpr continue
    default delete do double else enum explicit extern false float for friend goto if inline
    int long namespace new not operator or private protected public register return short
    signed sizeof static struct switch template this throw true try typedef typename union
    unsigned using virtual void volatile while xor
""".split())

# Where a statement executes (see `emit.py`): all threads, one role's warpgroups, one elected thread.
KERNEL, ROLE, ELECT = "kernel", "role", "elect_one"

# C++ precedence (higher binds tighter); the IR's own table differs (`&` binds tighter than
# `==` there), so parentheses are decided on the tree with these.
_CPP_PREC = {"||": 4, "&&": 5, "|": 6, "^": 7, "&": 8, "==": 9, "!=": 9,
             "<": 10, "<=": 10, ">": 10, ">=": 10, "<<": 11, ">>": 11,
             "+": 12, "-": 12, "*": 13, "/": 13, "%": 13}
_ATOM = 20
_BITWISE = {"|", "^", "&", "<<", ">>"}
_BOOLEAN = {"==", "!=", "<", "<=", ">", ">=", "&&", "||"}


def _float_literal(v: float) -> str:
    if math.isnan(v):
        return "NAN"
    if math.isinf(v):
        return "INFINITY" if v > 0 else "-INFINITY"
    text = repr(float(v))
    if "e" not in text and "." not in text:
        text += ".0"
    return text + "f"


def paren(text: str, prec: int, need: int) -> str:
    """`text` (of C++ precedence `prec`) parenthesised where an operator of precedence `need` needs it."""
    return f"({text})" if prec < need else text


class _Scope:
    """Declared names and their C++ scalar type ("int" or "float"), innermost scope last, and
    for the ints a number known to divide them whatever the call (Emitter.divisor of a `let`'s
    value; 1 where nothing is known)."""

    def __init__(self):
        self.frames: list[dict[str, str]] = [{}]
        self.divisors: list[dict[str, int]] = [{}]

    def declare(self, name: str, ctype: str, divisor: int = 1) -> None:
        self.frames[-1][name] = ctype
        self.divisors[-1][name] = divisor

    def lookup(self, name: str) -> str | None:
        for frame in reversed(self.frames):
            if name in frame:
                return frame[name]
        return None

    def divisor(self, name: str) -> int:
        for frame, divisors in zip(reversed(self.frames), reversed(self.divisors)):
            if name in frame:
                return divisors[name]
        return 1

    @contextmanager
    def nested(self) -> Iterator[None]:
        self.frames.append({})
        self.divisors.append({})
        try:
            yield
        finally:
            self.frames.pop()
            self.divisors.pop()


@dataclass
class RoleInfo:
    role: ir.Role
    first_wg: int
    tiles: dict[str, Tile] = field(default_factory=dict)
    fenced: list[str] = field(default_factory=list)  # accumulators / register A operands


class Emitter:
    def __init__(self, kernel: ir.Kernel):
        self.kernel = kernel
        self.lines: list[str] = []
        self.depth = 1
        self.scope = _Scope()
        self.level = KERNEL
        self.role: RoleInfo | None = None
        self.next_wg = 0
        self.open_guard: str | None = None
        self.role_chain_open = False
        self.host = False  # expressions of the host-side grid (num_sms allowed)
        self.wgmma: dict[str, str] = {}  # generated wgmma wrappers by name, in first-use order
        self.smem_offsets, self.barrier_offsets = _layout(kernel)
        self.names = _cpp_names(kernel)
        self.uses_builtin = {b: any(names_in(kernel.body, b)) for b in ("cta_id", "num_ctas")}
        self.trace = None  # emit_trace.TraceEmitter of an instrumented build (emit_kernel(trace=True))

    def c(self, name: str) -> str:
        """The C++ spelling of an IR-declared name."""
        return self.names.get(name, name)

    # -- text ------------------------------------------------------------------------------------
    def line(self, text: str = "") -> None:
        self.close_guard()
        self.raw(text)

    def raw(self, text: str) -> None:
        """`text` at the current depth, without closing an open one-thread guard."""
        self.lines.append(("  " * self.depth + text) if text else "")

    @contextmanager
    def block(self, head: str, tail: str = "}") -> Iterator[None]:
        """`head {` ... `}` with one more level of indentation and a nested name scope."""
        self.line(head)
        self.depth += 1
        try:
            with self.scope.nested():
                yield
            self.close_guard()
        finally:
            self.depth -= 1
        self.raw(tail)

    def guarded(self, cond: str | None, text: str) -> None:
        """`text` run by one thread: consecutive statements under the same guard share it."""
        if cond is None:
            self.line(text)
            return
        if self.open_guard != cond:
            self.close_guard()
            self.raw(f"if ({cond}) {{")
            self.depth += 1
            self.open_guard = cond
        self.raw(text)

    def close_guard(self) -> None:
        if self.open_guard is not None:
            self.open_guard = None
            self.depth -= 1
            self.raw("}")

    def one_thread(self) -> str | None:
        """The guard that makes one thread of the current executing group run a statement."""
        return {KERNEL: "threadIdx.x == 0", ROLE: f"threadIdx.x % {WARPGROUP_THREADS} == 0",
                ELECT: None}[self.level]

    # -- placement rules ---------------------------------------------------------------------------
    def require(self, s: ir.Stmt, *, level: tuple[str, ...], what: str) -> None:
        if self.level not in level:
            where = {KERNEL: "at kernel level", ROLE: "in a role outside elect_one",
                     ELECT: "inside elect_one"}[self.level]
            raise EmitError(f"{describe(s)} {what}; it is {where}")

    def require_warpgroup(self, s: ir.Stmt) -> None:
        self.require(s, level=(ROLE,), what="is warpgroup-collective (.sync.aligned) and must be in a "
                                            "role outside elect_one")

    # -- expressions -------------------------------------------------------------------------------
    def expr(self, e: ir.Expr) -> str:
        return self.expr_prec(e)[0]

    def expr_type(self, e: ir.Expr) -> str:
        return self.expr_prec(e)[2]

    def float_expr(self, e: ir.Expr) -> str:
        text, _, ctype = self.expr_prec(e)
        return text if ctype == "float" else f"static_cast<float>({text})"

    def expr_prec(self, e: ir.Expr) -> tuple[str, int, str]:
        """(C++ text, C++ precedence, "int" | "float")."""
        if isinstance(e, ir.IntConst):
            return str(e.value), (_ATOM if e.value >= 0 else 14), "int"
        if isinstance(e, ir.FloatConst):
            text = _float_literal(e.value)
            return text, (14 if text.startswith("-") else _ATOM), "float"
        if isinstance(e, ir.Var):
            return self._var(e.name), _ATOM, self.scope.lookup(e.name) or "int"
        if isinstance(e, ir.BinOp):
            return self._binop(e)
        if isinstance(e, ir.Call):
            return self._call(e)
        raise EmitError(f"no CUDA spelling for expression {e!r}")

    def coords_text(self, coords: tuple[ir.Expr, ...]) -> str:
        return ", ".join(self.expr(c) for c in coords)

    def _var(self, name: str) -> str:
        """Builtins and declared scalars keep their IR names in C++ (setup declares cta_id and
        num_ctas, each role branch wg)."""
        declared = self.scope.lookup(name)
        # verifier _expr: every name read is a scalar in scope (num_sms in the grid
        # only, wg inside a role)
        assert declared != "tensor", f"the tensor {name!r} read as a scalar"
        assert declared is not None or name in ir.BUILTINS, f"{name!r} is not in scope"
        assert name != "num_sms" or self.host, "num_sms read in device code"
        assert name != "wg" or self.role is not None, "wg read outside a role"
        return name if declared is None else self.c(name)

    def _binop(self, e: ir.BinOp) -> tuple[str, int, str]:
        prec = _CPP_PREC[e.op]  # verifier _expr: an operator of the IR
        lhs, lprec, ltype = self.expr_prec(e.lhs)
        rhs, rprec, rtype = self.expr_prec(e.rhs)
        ctype = "int" if e.op in _BOOLEAN or ltype == rtype == "int" else "float"
        if e.op in ("%",) + tuple(_BITWISE) and ctype == "float":
            raise EmitError(f"operator {e.op!r} needs integer operands: {e!r}")

        def wrap(text: str, child_prec: int, child: ir.Expr, right: bool) -> str:
            needs = child_prec < prec or (right and child_prec == prec and child_prec != _ATOM)
            # readability: say what a bitwise operator applies to (`(it / 3) & 1`)
            if isinstance(child, ir.BinOp) and child.op != e.op and (
                    e.op in _BITWISE or child.op in _BITWISE):
                needs = True
            if child_prec == 14 and e.op in ("-", "+"):
                needs = True  # a - (-1)
            return f"({text})" if needs else text

        text = f"{wrap(lhs, lprec, e.lhs, False)} {e.op} {wrap(rhs, rprec, e.rhs, True)}"
        return text, prec, ctype

    def _call(self, e: ir.Call) -> tuple[str, int, str]:
        assert ir.CALLS.get(e.func) == len(e.args), e  # verifier _expr: a call of the IR
        args = [self.expr_prec(a) for a in e.args]
        if e.func == "select":
            (c, cp, _), (a, ap, at), (b, bp, bt) = args
            ctype = "int" if at == bt == "int" else "float"
            return f"{paren(c, cp, 4)} ? {paren(a, ap, 4)} : {paren(b, bp, 4)}", 3, ctype
        texts = ", ".join(a[0] for a in args)
        if e.func == "ceil_div":
            if any(a[2] != "int" for a in args):
                raise EmitError(f"ceil_div needs integer operands: {e!r}")
            # device code calls wsp::ceil_div (scalar.cuh); the host grid is a formula in a comment
            return f"{'' if self.host else 'wsp::'}ceil_div({texts})", _ATOM, "int"
        if e.func == "bit_length":
            if args[0][2] != "int":
                raise EmitError(f"bit_length needs an integer operand: {e!r}")
            # device code calls wsp::bit_length (scalar.cuh); host text is a formula in a comment
            return f"{'' if self.host else 'wsp::'}bit_length({texts})", _ATOM, "int"
        if all(a[2] == "int" for a in args):
            return f"{e.func}({texts})", _ATOM, "int"
        return f"f{e.func}f({texts})", _ATOM, "float"

    # -- references --------------------------------------------------------------------------------
    def smem_ref(self, ref: ir.SmemRef) -> tuple[str, ir.SmemDecl, tuple[int, ...]]:
        """(`smem_X + byte offset` text, declaration, sub-array shape)."""
        decl = self.kernel.smem_decl(ref.buffer)  # verifier _smem: declared, indices in range
        sub = ir.smem_subshape(decl, ref)
        terms = []
        for d, idx in enumerate(ref.index):
            stride = DTYPE_BYTES[decl.dtype] * math.prod(decl.shape[d + 1:])
            if isinstance(idx, ir.IntConst):
                terms.append(idx.value * stride)
            else:
                text, prec, _ = self.expr_prec(idx)
                terms.append(f"{paren(text, prec, 13)} * {stride}")
        const = sum(t for t in terms if isinstance(t, int))
        parts = [t for t in terms if isinstance(t, str)] + ([str(const)] if const else [])
        return " + ".join([f"smem_{ref.buffer}"] + parts), decl, sub

    def ref_text(self, ref: ir.SmemRef) -> str:
        """`buffer[index, ...]` as the IR writes it, for comments."""
        return f"{ref.buffer}[{self.coords_text(ref.index)}]" if ref.index else ref.buffer

    def bar_ref(self, ref: ir.BarRef) -> str:
        assert ref.barrier in self.barrier_offsets, ref  # verifier _bar: declared
        return f"&{ref.barrier}_bar[{self.expr(ref.index)}]"

    def tile(self, name: str, s: ir.Stmt) -> Tile:
        # verifier _tile: a register tile declared in this role, in scope
        assert self.role is not None and name in self.role.tiles, (name, s)
        return self.role.tiles[name]

    def divisor(self, e: ir.Expr) -> int:
        """A number that divides an integer expression whatever the call (1 where nothing is
        known; 0 where the expression is 0, which every number divides): a constant's own
        value, a product's factors' product, a sum's or difference's terms' gcd, a `let` of one."""
        if isinstance(e, ir.IntConst):
            return abs(e.value)
        if isinstance(e, ir.Var):
            return self.scope.divisor(e.name)
        if isinstance(e, ir.BinOp) and e.op == "*":
            return self.divisor(e.lhs) * self.divisor(e.rhs)
        if isinstance(e, ir.BinOp) and e.op in ("+", "-"):
            return math.gcd(self.divisor(e.lhs), self.divisor(e.rhs))
        return 1

    def even(self, e: ir.Expr) -> bool:
        """Whether an integer expression is even whatever the call (Emitter.divisor)."""
        return self.divisor(e) % 2 == 0

    def global_param(self, name: str, s: ir.Stmt) -> ir.GlobalParam:
        p = self.kernel.param(name)
        assert isinstance(p, ir.GlobalParam), s  # verifier _global_tile: a global param
        return p

    def tensormap_param(self, name: str, s: ir.Stmt, coords: tuple[ir.Expr, ...]) -> ir.TensorMapParam:
        p = self.kernel.param(name)
        # verifier _tma: a tensormap param, one coordinate per dim
        assert isinstance(p, ir.TensorMapParam) and len(coords) == len(p.shape), s
        if not 1 <= len(coords) <= TMA_MAX_RANK:
            raise EmitError(f"{describe(s)}: {len(coords)} coordinates for the rank-{len(p.shape)} "
                            f"tensor map {name!r} (TMA takes 1 to {TMA_MAX_RANK})")
        return p


_KEYWORDS = {
    ir.TmaLoad: "tma.load", ir.TmaStore: "tma.store", ir.TmaCommit: "tma.commit",
    ir.TmaWait: "tma.wait", ir.Wgmma: "wgmma.mma", ir.WgmmaFence: "wgmma.fence",
    ir.WgmmaCommit: "wgmma.commit", ir.WgmmaWait: "wgmma.wait", ir.Setmaxnreg: "setmaxnreg",
    ir.SyncThreads: "syncthreads", ir.ClusterSync: "cluster.sync", ir.ElectOne: "elect_one", ir.Role: "role",
    ir.TileLoadGlobal: "tile.load", ir.TileStoreGlobal: "tile.store",
    ir.TileStoreSmem: "tile.store_smem", ir.TileReduce: "tile.reduce", ir.RegDecl: "reg",
    ir.TileMask: "tile.mask",
}


def describe(s: ir.Stmt) -> str:
    """`keyword` (the node's fields, blocks left out) for error messages."""
    fields = ", ".join(f"{k}={v!r}" for k, v in vars(s).items()
                       if not (isinstance(v, tuple) and any(isinstance(x, ir.STMT_TYPES) for x in v)))
    text = f"{type(s).__name__}({fields})"
    if len(text) > 240:
        text = text[:237] + "..."
    return f"`{_KEYWORDS.get(type(s), type(s).__name__)}` {text}"


def names_in(body: tuple[ir.Stmt, ...], wanted: str) -> Iterator[bool]:
    """True for every expression of `body` that reads `wanted` (used to skip unused builtins)."""
    for s in ir.walk(body):
        for value in vars(s).values():
            for e in _exprs_of(value):
                yield wanted in ir.expr_vars(e)


def _exprs_of(value) -> Iterator[ir.Expr]:
    if isinstance(value, (ir.IntConst, ir.FloatConst, ir.Var, ir.BinOp, ir.Call)):
        yield value
    elif isinstance(value, (ir.SmemRef, ir.BarRef)):
        for v in vars(value).values():
            yield from _exprs_of(v)
    elif isinstance(value, tuple) and not any(isinstance(v, ir.STMT_TYPES) for v in value):
        for v in value:
            yield from _exprs_of(v)


def _layout(kernel: ir.Kernel) -> tuple[dict[str, int], dict[str, int]]:
    """Byte offsets from the SMEM_ALIGN-aligned smem base, exactly as `ir.Kernel.smem_bytes`
    counts: each buffer on a SMEM_ALIGN boundary, then the mbarriers."""
    offset, smem, bars = 0, {}, {}
    for buf in kernel.smem:
        offset = smem_round(offset)
        smem[buf.name] = offset
        offset += buf.nbytes
    offset = -(-offset // BARRIER_BYTES) * BARRIER_BYTES
    for b in kernel.barriers:
        bars[b.name] = offset
        offset += BARRIER_BYTES * b.slots
    return smem, bars


def _cpp_names(kernel: ir.Kernel) -> dict[str, str]:
    """C++ spelling of every name the IR declares (parameters, lets, loop variables, register
    tiles): the IR name itself, or with a trailing underscore where it would clash with a C++
    keyword or a name the emitter uses (`v`, `ptr`, `min`, `smem_A`, `full_bar`, ...)."""
    declared = [p.name for p in kernel.params]
    for s in ir.walk(kernel.body):
        if isinstance(s, (ir.Let, ir.RegDecl, ir.LoadShared, ir.LoadGlobal)):
            declared.append(s.name)
        elif isinstance(s, ir.For):
            declared.append(s.var)
    taken = set(_RESERVED) | set(ir.BUILTINS) | {f"smem_{b.name}" for b in kernel.smem}
    taken |= {f"{b.name}_bar" for b in kernel.barriers}
    prefixed = ("wgmma_", "wsp", "__")   # owned by the wgmma wrappers, wsp::, the compiler
    for n in declared:
        if not n.isidentifier():
            raise EmitError(f"the IR name {n!r} is not a C identifier")
    keep = {n for n in declared if n not in taken and not n.startswith(prefixed)}
    taken |= keep   # names that need no change keep their spelling; the others move around them
    names: dict[str, str] = {}
    for n in dict.fromkeys(declared):
        if n in keep:
            names[n] = n
            continue
        cpp = f"v_{n}" if n.startswith(prefixed) else n
        while cpp in taken:
            cpp += "_"
        taken.add(cpp)
        names[n] = cpp
    return names
