"""Print loop IR in its text form (docs/ir.md): what users read, diff and hand-edit.

The output is deterministic, one statement a line, blocks in braces indented by two spaces, and
`parser.parse_kernel` reads it back to an equal kernel. Expressions carry only the parentheses
that re-parsing needs (`ir.BINARY_PRECEDENCE`, all operators left-associative), plus parentheses
around a negative constant that is an operand (`a * (-3)`), which reads better than `a * -3`.
"""

from __future__ import annotations

from wsched.lowering import ir
from wsched.lowering.spelling import SPELLINGS, keyword

INDENT = "  "


class IRPrintError(TypeError, ValueError):
    """What was given to print is not IR: not an IR node, or a node with a field of the wrong type
    (IR built in Python; `verify` names the same problems)."""


def print_kernel(k: ir.Kernel) -> str:
    """The whole kernel, ending with a newline."""
    from wsched.lowering.verify.types import type_problems  # the verifier prints expressions

    problems = type_problems(k)
    if problems:
        raise IRPrintError("cannot print this kernel:\n" + "\n".join(d.message for d in problems))
    params = ", ".join(_param(p) for p in k.params)
    header = (f"kernel {k.name}({params}) grid({print_expr(k.grid)}) "
              f"cluster({_join(k.cluster)}) {{")
    declarations = [*(_smem_decl(d) for d in k.smem), *(_barrier_decl(d) for d in k.barriers)]
    lines = [header, *(INDENT + d for d in declarations), *_block_lines(k.body, 1), "}"]
    return "\n".join(lines) + "\n"


def print_stmt(s: ir.Stmt, indent: int = 0) -> str:
    """One statement (a block statement spans several lines), without a final newline."""
    return "\n".join(_stmt_lines(s, indent))


def print_expr(e: ir.Expr) -> str:
    match e:
        case ir.IntConst():
            return str(e.value)
        case ir.FloatConst():
            # repr is the shortest text that reads back to the same float, and always has a
            # `.` or an exponent (or is inf / nan), so it never reads back as an integer.
            return repr(float(e.value))
        case ir.Var():
            return e.name
        case ir.Call():
            return f"{e.func}({', '.join(print_expr(a) for a in e.args)})"
        case ir.BinOp():
            precedence = _precedence(e.op)
            lhs = _operand(e.lhs, needs_parens=lambda p: p < precedence)
            # Left-associative: an operand of the same level on the right must be grouped.
            rhs = _operand(e.rhs, needs_parens=lambda p: p <= precedence)
            return f"{lhs} {e.op} {rhs}"
    raise IRPrintError(f"print_expr: {e!r} is not an ir expression")


def expr_text(e: ir.Expr) -> str:
    """`print_expr(e)`, or the repr of a malformed expression: for messages about IR that may be
    the very thing being reported."""
    try:
        return print_expr(e)
    except (TypeError, ValueError):
        return repr(e)


def _precedence(op: str) -> int:
    try:
        return ir.BINARY_PRECEDENCE[op]
    except KeyError:
        raise IRPrintError(f"BinOp operator {op!r} is not one of "
                         f"{', '.join(ir.BINARY_PRECEDENCE)}") from None


def _operand(e: ir.Expr, needs_parens) -> str:
    text = print_expr(e)
    if isinstance(e, ir.BinOp) and needs_parens(_precedence(e.op)):
        return f"({text})"
    if isinstance(e, (ir.IntConst, ir.FloatConst)) and text.startswith("-"):
        return f"({text})"
    return text


def _join(items) -> str:
    """Comma-separated shape, box, coordinates or indices: ints or expressions."""
    return ", ".join(str(i) if isinstance(i, int) else print_expr(i) for i in items)


# ---------------------------------------------------------------------------------------------
# Declarations
# ---------------------------------------------------------------------------------------------


def _param(p: ir.Param) -> str:
    match p:
        case ir.HostParam():        # before ScalarParam, its base class
            return f"{p.dtype} {p.name} = {print_expr(p.value)}"
        case ir.ScalarParam():
            return f"{p.dtype} {p.name}"
        case ir.TensorMapParam():
            return (f"tensormap {p.name}: {p.dtype}[{_join(p.shape)}] box({_join(p.box)}) "
                    f"swizzle({p.swizzle})")
        case ir.SpanParam():        # before GlobalParam, its base class
            return (f"spans {p.name}: {p.dtype}[{_join(p.shape)}] = overlap({p.query}, {p.key}) "
                    f"rows({p.rows}) cols({p.cols})")
        case ir.WorkspaceParam():   # before GlobalParam, its base class
            return (f"workspace {p.name}: {p.dtype}[{_join(p.shape)}]" + (" zeroed" if p.zeroed else "")
                    + (" fragments" if p.fragments else ""))
        case ir.GlobalParam():
            return f"global {p.name}: {p.dtype}[{_join(p.shape)}]"
    raise IRPrintError(f"print_kernel: {p!r} is not a kernel parameter")


def _smem_decl(d: ir.SmemDecl) -> str:
    return f"smem {d.name}: {d.dtype}[{_join(d.shape)}] swizzle({d.swizzle})"


def _barrier_decl(d: ir.BarrierDecl) -> str:
    return f"barrier {d.name}[{d.slots}]"


# ---------------------------------------------------------------------------------------------
# Statements
# ---------------------------------------------------------------------------------------------


def _block_lines(stmts: tuple[ir.Stmt, ...], indent: int) -> list[str]:
    return [line for s in stmts for line in _stmt_lines(s, indent)]


def _stmt_lines(s: ir.Stmt, indent: int) -> list[str]:
    pad = INDENT * indent
    if type(s) not in SPELLINGS:
        raise IRPrintError(f"print_stmt: {s!r} is not an ir statement")
    word = keyword(s)
    match s:
        case ir.For():
            header = (f"{word} {s.var} in {s.iteration}({print_expr(s.start)}, {print_expr(s.stop)}, "
                      f"{print_expr(s.step)})")
            return _braced(header, s.body, indent)
        case ir.If():
            lines = _braced(f"{word} {print_expr(s.cond)}", s.then, indent)
            if s.orelse:
                lines[-1:] = _braced("} else", s.orelse, indent)
            return lines
        case ir.Role():
            header = f"{word} {s.name} warpgroups({s.warpgroups}) registers({s.registers})"
            return _braced(header, s.body, indent)
        case ir.ElectOne():
            return _braced(word, s.body, indent)
    operands = _operands(s)
    return [f"{pad}{word} {operands}" if operands else pad + word]


def _braced(header: str, body: tuple[ir.Stmt, ...], indent: int) -> list[str]:
    pad = INDENT * indent
    return [f"{pad}{header} {{", *_block_lines(body, indent + 1), f"{pad}}}"]


def _operands(s: ir.Stmt) -> str:
    """What follows the keyword (`spelling.keyword`) on the line of a statement without a block;
    empty for a statement that is its keyword alone."""
    match s:
        case ir.Let() | ir.Assign():
            return f"{s.name} = {print_expr(s.value)}"
        case ir.Setmaxnreg():
            return str(s.registers)
        # synchronisation
        case ir.MbarrierInit():
            return f"{s.barrier} arrivals({s.arrivals})"
        case ir.MbarrierArrive():
            return _bar_ref(s.bar) + ("" if s.cta is None else f" cta({print_expr(s.cta)})")
        case ir.MbarrierArriveExpectTx():
            return f"{_bar_ref(s.bar)} bytes({print_expr(s.bytes)})"
        case ir.MbarrierWait():
            return f"{_bar_ref(s.bar)} phase({print_expr(s.phase)})"
        case ir.MbarrierInval():
            return s.barrier
        case ir.NamedBarrierSync() | ir.NamedBarrierArrive():
            return f"{print_expr(s.id)}, {s.threads}"
        # asynchronous copies
        case ir.TmaLoad():
            row = "" if s.row is None else f" row({print_expr(s.row)})"
            multicast = "" if s.multicast is None else f" multicast({print_expr(s.multicast)})"
            return f"{_smem_ref(s.dst)}{row} <- {s.tensor}[{_join(s.coords)}] bar({_bar_ref(s.bar)}){multicast}"
        case ir.TmaStore():
            return f"{s.tensor}[{_join(s.coords)}] <- {_smem_ref(s.src)}"
        case ir.TmaWait() | ir.WgmmaWait():
            return str(s.pending)
        # wgmma
        case ir.Wgmma():
            a = s.a if isinstance(s.a, str) else _smem_ref(s.a)
            return (f"{s.acc}, {a}, {_smem_ref(s.b)} major({s.a_major}, {s.b_major}) "
                    f"accumulate({print_expr(s.accumulate)})")
        # register tiles
        case ir.RegDecl():
            return f"{s.name}: {s.dtype}[{_join(s.shape)}]" + ("" if s.layout == "fragment" else f" {s.layout}")
        case ir.TileFill():
            return f"{s.dst}, {print_expr(s.value)}"
        case ir.TileUnary():
            return f"{s.dst}, {s.src}"
        case ir.TileBinary():
            return f"{s.dst}, {_tile_operand(s.lhs)}, {_tile_operand(s.rhs)}"
        case ir.TileReduce():
            return f"{s.dst}, {s.src}, axis({s.axis})"
        case ir.TileMask():
            causal = "" if s.causal is None else f" causal({print_expr(s.causal)})"
            causal += "" if s.period is None else f" period({print_expr(s.period)})"
            causal += "" if s.lower is None else f" lower({print_expr(s.lower)})"
            return (f"{s.dst}, rows({print_expr(s.row0)}), cols({print_expr(s.col0)}), "
                    f"limit({print_expr(s.limit)}){causal}")
        case ir.TileLoadGlobal():
            return f"{s.dst} <- {s.tensor}[{_join(s.coords)}]"
        case ir.TileStoreGlobal():
            row_limit = "" if s.row_limit is None else f" row_limit({print_expr(s.row_limit)})"
            return f"{s.tensor}[{_join(s.coords)}] <- {s.src}{row_limit}"
        case ir.TileStoreSmem():
            return f"{_smem_ref(s.dst)} <- {s.src}"
        # sliced epilogues and split-K
        case ir.TileView():
            return f"{s.name}, {s.src}, cols({print_expr(s.col0)}, {s.cols})"
        case ir.AtomicInc():
            return f"{_smem_ref(s.dst)} <- {s.tensor}[{_join(s.coords)}] wrap({print_expr(s.wrap)})"
        case ir.LoadShared():
            return f"{s.name} = {_smem_ref(s.src)}"
        # attention score functions
        case ir.TileIota():
            return f"{s.dst}, axis({s.axis}), start({print_expr(s.start)})"
        case ir.TileSelect():
            return ", ".join([s.dst] + [_tile_operand(o) for o in (s.cond, s.on_true, s.on_false)])
        # paged KV caches
        case ir.LoadGlobal():
            return f"{s.name} = {s.tensor}[{_join(s.coords)}]"
        case (ir.Return() | ir.FenceMbarrierInit() | ir.FenceProxyAsync() | ir.SyncThreads() | ir.ClusterSync()
              | ir.FenceGpu()
              | ir.TmaCommit() | ir.WgmmaFence() | ir.WgmmaCommit()):
            return ""
    raise IRPrintError(f"print_stmt: {s!r} is not an ir statement")


def _smem_ref(r: ir.SmemRef) -> str:
    return f"{r.buffer}[{_join(r.index)}]" if r.index else r.buffer


def _bar_ref(r: ir.BarRef) -> str:
    return f"{r.barrier}[{print_expr(r.index)}]"


def _tile_operand(operand: str | ir.Expr) -> str:
    """A tile is its bare name; a scalar expression is marked, so `x` and `scalar(x)` differ."""
    return operand if isinstance(operand, str) else f"scalar({print_expr(operand)})"
