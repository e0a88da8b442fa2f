"""Register tiles in CUDA: declarations and the computing tile ops.

A register tile lies in the wgmma accumulator fragment layout (`fragment.py`). Each op is
spelled as a fully unrolled loop over this thread's fragment positions (fj, fi):

    reg acc: f32[64, 256]            float acc[128];
    tile.add acc, acc, bias_t        #pragma unroll / for (fj ...) #pragma unroll / for (fi ...)
    tile.gelu acc, acc                 acc[4 * fj + 2 * fi + 0] = acc[...] + __bfloat162float(bias_t[fj].x);
                                       acc[4 * fj + 2 * fi + 0] = wsp::gelu(acc[...]); ...

Consecutive elementwise ops over one fragment space share one loop (`emit_elementwise_run`).
Loads and stores of tiles are in `emit_tile_memory.py`.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator, Union

from wsched.lowering import ir
from wsched.target import ELEMENT_TYPES, WGMMA_M

from .emit_context import ROLE, EmitError, Emitter, describe, paren
from .fragment import COL, FULL, LINEAR, LINEAR_ROWS, ROW, SCALAR, Tile

# The CUDA spelling of each of target.TILE_UNARY_OPS / BINARY_OPS, computed in fp32 (tanh with the
# hardware approximation, max relative error 2^-11: docs/ir.md, "tile.tanh on the GPU").
_UNARY = {
    "neg": "-{}", "exp": "expf({})", "exp2": "exp2f({})", "log": "logf({})",
    "relu": "fmaxf({}, 0.0f)", "gelu": "wsp::gelu({})", "silu": "wsp::silu({})",
    "sigmoid": "wsp::sigmoid({})", "tanh": "wsp::tanh_approx({})", "cast": "{}",
    "exp2_ftz": "wsp::ex2_approx({})",   # one MUFU op (docs/ir.md, "tile.exp2_ftz")
}
_BINARY = {
    "add": "{} + {}", "sub": "{} - {}", "mul": "{} * {}", "div": "{} / {}",
    "maximum": "fmaxf({}, {})", "minimum": "fminf({}, {})",
}
# target.INT_TILE_OPS into an i32 tile, on int operands.
_INT_UNARY = {"neg": "wsp::wrap_neg({})", "cast": "{}"}
_INT_BINARY = {"add": "wsp::wrap_add({}, {})", "sub": "wsp::wrap_sub({}, {})", "mul": "wsp::wrap_mul({}, {})",
               "maximum": "max({}, {})", "minimum": "min({}, {})"}
# target.COMPARE_OPS: 1.0f where it holds, else 0.0f (a logical op reads non-zero as true).
_COMPARE = {
    "lt": "({}) < ({})", "le": "({}) <= ({})", "gt": "({}) > ({})", "ge": "({}) >= ({})",
    "eq": "({}) == ({})", "ne": "({}) != ({})",
    "logical_and": "({}) != 0.0f && ({}) != 0.0f", "logical_or": "({}) != 0.0f || ({}) != 0.0f",
}


def _tile_from_decl(d: ir.RegDecl, cpp_name: str) -> Tile:
    if d.layout == "linear":   # verifier _RegDecl: [R, C], R dividing 128, R C a multiple of 128 or C = 1
        return Tile(cpp_name, d.dtype, d.shape[0], d.shape[1], linear=True)
    shape = tuple(d.shape)
    while len(shape) > 2 and shape[0] == 1:  # extra leading dims of extent 1
        shape = shape[1:]
    if len(shape) == 1:
        shape = (1,) + shape
    if len(shape) != 2:
        raise EmitError(f"reg {d.name}: {d.dtype}{list(d.shape)} is not a 2-D register tile")
    rows, cols = shape
    if rows not in (1, WGMMA_M) or (cols > 1 and cols % 8):
        raise EmitError(f"reg {d.name}: {d.dtype}{list(d.shape)} does not fit the warpgroup "
                        "fragment layout (rows 64 or 1, columns 1 or a multiple of 8)")
    return Tile(cpp_name, d.dtype, rows, cols)


def emit_reg_decl(em: Emitter, s: ir.RegDecl) -> None:
    em.require(s, level=(ROLE,), what="declares a per-warpgroup register tile and must be in a role")
    t = _tile_from_decl(s, em.c(s.name))
    assert s.name not in em.role.tiles, s  # verifier _declare: names are unique
    em.role.tiles[s.name] = t
    layout = {FULL: "wgmma fragment", ROW: "row fragment", COL: "column fragment",
              SCALAR: "per-thread scalar", LINEAR: f"linear, {t.length} of a row a thread",
              LINEAR_ROWS: "linear, its row's value a thread"}[t.layout]
    packed = ", packed pairs" if t.packed else ""
    em.line(f"{t.declaration():<32}// {s.name}: {s.dtype}{list(s.shape)}, {layout}{packed}")


@contextmanager
def fragment_loop(em: Emitter, layout: str, cols: int, length: int = 1) -> Iterator[None]:
    """Loop over this thread's fragment positions (fj, fi) of a tile of the given layout (li over
    the `length` elements of a linear tile); every index is a compile-time constant once unrolled."""
    loops = {FULL: [("fj", cols // 8), ("fi", 2)], ROW: [("fj", cols // 8)],
             COL: [("fi", 2)], SCALAR: [], LINEAR: [("li", length)], LINEAR_ROWS: []}[layout]
    opened = 0
    try:
        for var, n in loops:
            em.line("#pragma unroll")
            em.line(f"for (int {var} = 0; {var} < {n}; ++{var}) {{")
            em.depth += 1
            opened += 1
        yield
    finally:
        for _ in range(opened):
            em.close_guard()
            em.depth -= 1
            em.raw("}")


def _elems(layout: str) -> tuple[int, ...]:
    return (0, 1) if layout in (FULL, ROW) else (0,)


def assignments(dst: Tile, values: list[str], native: bool = False) -> list[str]:
    """Statements writing float values (one per element c of the fragment position) into dst,
    converted to its dtype; `native`: values already of dst's own C++ type (an i32 tile's ints)."""
    element = ELEMENT_TYPES[dst.dtype]
    if native:
        return [f"{dst.index(c)} = {v};" for c, v in enumerate(values)]
    if dst.packed:
        return [f"{dst.index()} = {element.pack.format(*values)};"]
    return [f"{dst.index(c)} = {element.from_float.format(v)};" for c, v in enumerate(values)]


def _operand(em: Emitter, s: ir.Stmt, dst: Tile, op: Union[str, ir.Expr],
             integer: bool = False) -> Callable[[int], str]:
    """Element c of an operand at dst's fragment position, as a float expression (`integer`: as
    an int expression, of an i32 tile or an integer scalar: the verifier's _int_operands)."""
    if not isinstance(op, str):
        text = em.expr(op) if integer else em.float_expr(op)
        return lambda c: text
    t = em.tile(op, s)
    # verifier _TileUnary / _TileBinary: the operand has dst's shape or broadcasts to it
    assert t.rows in (1, dst.rows) and t.cols in (1, dst.cols), s
    if integer:
        assert t.integer, s
        return t.index
    return t.read


def _integer_operands(em: Emitter, s: ir.Stmt, operands) -> bool:
    """Whether a comparison compares integers: an i32 tile among its operands and every operand
    an i32 tile or an integer scalar (docs/ir.md, "Integer tiles")."""
    tiles = [em.tile(o, s) for o in operands if isinstance(o, str)]
    scalars = [o for o in operands if not isinstance(o, str)]
    return (any(t.integer for t in tiles) and all(t.integer for t in tiles)
            and all(em.expr_prec(o)[2] == "int" for o in scalars))


# Elementwise tile ops: each spells the statements of ONE fragment position (fj, fi);
# consecutive ones over the same fragment space share one unrolled loop (`_emit_elementwise`).
# That is the same computation in the same per-element order (every element of a fused op
# reads only the same position of same-shaped operands, and broadcast operands are never
# written in the run), and it keeps each value in registers from one op to the next instead
# of sweeping the whole tile once per op.


def _tile_fill_lines(em: Emitter, s: ir.TileFill) -> tuple[Tile, list[str], str]:
    dst = em.tile(s.dst, s)
    value = em.expr(s.value) if dst.integer else em.float_expr(s.value)
    return (dst, assignments(dst, [value for _ in _elems(dst.layout)], native=dst.integer),
            f"tile.fill {s.dst}, {em.expr(s.value)}")


def _tile_unary_lines(em: Emitter, s: ir.TileUnary) -> tuple[Tile, list[str], str]:
    dst = em.tile(s.dst, s)
    text = f"tile.{s.op} {s.dst}, {s.src}"
    if dst.integer and (s.op == "neg" or em.tile(s.src, s).integer):   # verifier: neg or cast
        src = _operand(em, s, dst, s.src, integer=True)
        return dst, assignments(dst, [_INT_UNARY[s.op].format(src(c)) for c in _elems(dst.layout)], native=True), text
    src = _operand(em, s, dst, s.src)   # a float tile cast into an i32 one: truncated (from_float)
    return dst, assignments(dst, [_UNARY[s.op].format(src(c)) for c in _elems(dst.layout)]), text


def _shared_divisor(em: Emitter, s: ir.TileBinary, dst: Tile) -> bool:
    """Whether the divisor of a `tile.div` serves several quotients of a thread: a constant, or
    a tile broadcast along a dimension the destination spreads over a thread's fragment."""
    if not isinstance(s.rhs, str):
        return True
    t = em.tile(s.rhs, s)
    return (t.cols == 1 and dst.cols > 1) or (t.rows == 1 and dst.rows > 1)


def _tile_binary_lines(em: Emitter, s: ir.TileBinary) -> tuple[Tile, list[str], str]:
    dst = em.tile(s.dst, s)
    operands = ", ".join(o if isinstance(o, str) else em.expr(o) for o in (s.lhs, s.rhs))
    text = f"tile.{s.op} {s.dst}, {operands}"
    if dst.integer or (s.op in _COMPARE and _integer_operands(em, s, (s.lhs, s.rhs))):
        lhs, rhs = (_operand(em, s, dst, o, integer=True) for o in (s.lhs, s.rhs))
        if dst.integer:   # verifier _TileBinary: one of target.INT_TILE_OPS
            spelling = _INT_BINARY[s.op]
            return dst, assignments(dst, [spelling.format(lhs(c), rhs(c)) for c in _elems(dst.layout)],
                                    native=True), text
        spelling = "(" + _COMPARE[s.op].replace("0.0f", "0") + ") ? 1.0f : 0.0f"
        return dst, assignments(dst, [spelling.format(lhs(c), rhs(c)) for c in _elems(dst.layout)]), text
    lhs, rhs = _operand(em, s, dst, s.lhs), _operand(em, s, dst, s.rhs)
    if s.op in _COMPARE:
        spelling = "(" + _COMPARE[s.op] + ") ? 1.0f : 0.0f"
    elif s.op == "div" and _shared_divisor(em, s, dst):
        spelling = "wsp::div_shared({}, {})"   # one reciprocal a divisor (math.cuh)
    else:
        spelling = _BINARY[s.op]
    lines = assignments(dst, [spelling.format(lhs(c), rhs(c)) for c in _elems(dst.layout)])
    return dst, lines, text


def _tile_iota_lines(em: Emitter, s: ir.TileIota) -> tuple[Tile, list[str], str]:
    dst = em.tile(s.dst, s)
    start = paren(*em.expr_prec(s.start)[:2], 12)
    values = []
    for c in _elems(dst.layout):
        # element c of fragment position (fj, fi) lies at row frag_row() + 8 fi, column
        # frag_col() + 8 fj + c (fragment.py); a tile of extent 1 along the axis has position 0.
        # A linear tile's element li: row lane / (128 / R), column (lane % (128 / R)) n + li.
        if dst.linear and ((s.axis == 0 and dst.rows > 1) or (s.axis == 1 and dst.cols > 1)):
            base, step = (dst.first_row, "0") if s.axis == 0 else (dst.first_col, "li")
        elif s.axis == 0 and dst.rows > 1:
            base, step = dst.first_row, "8 * fi"
        elif s.axis == 1 and dst.cols > 1:
            base, step = dst.first_col, f"8 * fj + {c}" if c else "8 * fj"
        else:
            values.append(em.expr(s.start) if dst.integer else f"static_cast<float>({em.expr(s.start)})")
            continue
        if dst.integer:
            values.append(f"{start} + {base} + ({step})")
            continue
        # one int-to-float conversion per thread (loop-invariant), a constant added per element
        values.append(f"static_cast<float>({start} + {base}) + ({step})")
    return (dst, assignments(dst, values, native=dst.integer),
            f"tile.iota {s.dst}, axis({s.axis}), start({em.expr(s.start)})")


def _tile_select_lines(em: Emitter, s: ir.TileSelect) -> tuple[Tile, list[str], str]:
    dst = em.tile(s.dst, s)
    cond = _operand(em, s, dst, s.cond)
    on_true, on_false = (_operand(em, s, dst, o, integer=dst.integer) for o in (s.on_true, s.on_false))
    lines = assignments(dst, [f"({cond(c)}) != 0.0f ? {on_true(c)} : {on_false(c)}"
                              for c in _elems(dst.layout)], native=dst.integer)
    operands = ", ".join(o if isinstance(o, str) else em.expr(o) for o in (s.cond, s.on_true, s.on_false))
    return dst, lines, f"tile.select {s.dst}, {operands}"


ELEMENTWISE = {ir.TileFill: _tile_fill_lines, ir.TileUnary: _tile_unary_lines,
               ir.TileBinary: _tile_binary_lines,
               ir.TileIota: _tile_iota_lines, ir.TileSelect: _tile_select_lines}


def _space(t: Tile) -> tuple:
    """What an elementwise loop iterates over: the layout and width (and a linear tile's rows)."""
    return (t.layout, t.cols, t.rows if t.linear else None)


def emit_elementwise_run(em: Emitter, body: tuple[ir.Stmt, ...], i: int) -> int:
    """Emit body[i] and the elementwise ops after it over the same fragment space (the same
    destination layout and width) as one loop; return how many statements that took."""
    first = em.tile(body[i].dst, body[i])
    n = 1
    while i + n < len(body) and type(body[i + n]) in ELEMENTWISE:
        t = em.role.tiles.get(body[i + n].dst) if em.role else None
        if t is None or _space(t) != _space(first):
            break
        n += 1
    emit_elementwise(em, *body[i:i + n])
    return n


def emit_elementwise(em: Emitter, *run: ir.Stmt) -> None:
    """`tile.fill` / `tile.<unary>` / `tile.<binary>`, one statement or a fused run."""
    for s in run:
        em.require_warpgroup(s)
    parts = [ELEMENTWISE[type(s)](em, s) for s in run]
    dst = parts[0][0]
    em.line("// " + "; ".join(text for _, _, text in parts))
    with fragment_loop(em, dst.layout, dst.cols, dst.length):
        for _, lines, _ in parts:
            for ln in lines:
                em.line(ln)


def emit_tile_reduce(em: Emitter, s: ir.TileReduce) -> None:
    em.require_warpgroup(s)
    src, dst = em.tile(s.src, s), em.tile(s.dst, s)
    if s.axis != 1 or src.layout != FULL or dst.layout != COL:
        raise EmitError(f"{describe(s)}: only axis(1) of a [64, N] tile into a [64, 1] tile is "
                        "implemented (a reduction over rows would cross warps)")
    # verifier _TileReduce: one of target.REDUCE_OPS
    init, combine = {"max": ("-INFINITY", "fmaxf(fr, {})"), "sum": ("0.0f", "fr + {}")}[s.op]
    # The 4 threads of a quad (lanes 4g .. 4g+3) hold the columns of the same two rows.
    with fragment_loop(em, COL, 1):
        em.line(f"float fr = {init};")
        with fragment_loop(em, ROW, src.cols):
            for c in (0, 1):
                em.line(f"fr = {combine.format(src.read(c))};")
        for lane_mask in (1, 2):
            em.line(f"fr = {combine.format(f'__shfl_xor_sync(0xffffffff, fr, {lane_mask})')};")
        for ln in assignments(dst, ["fr"]):
            em.line(ln)


def emit_tile_mask(em: Emitter, s: ir.TileMask) -> None:
    em.require_warpgroup(s)
    t = em.tile(s.dst, s)
    if t.layout != FULL:
        raise EmitError(f"{describe(s)}: tile.mask needs a [64, N] tile; {t.name} is "
                        f"[{t.rows}, {t.cols}]")
    limit = em.expr(s.limit)
    text = f"tile.mask {s.dst}, rows({em.expr(s.row0)}), cols({em.expr(s.col0)}), limit({limit})"
    if s.causal is not None:
        text += f" causal({em.expr(s.causal)})"
    if s.period is not None:
        text += f" period({em.expr(s.period)})"
    if s.lower is not None:
        text += f" lower({em.expr(s.lower)})"
    with em.block(f"{{  // {text}"):
        # element (r, c) of the tile is at (row0 + r, col0 + c) of the score matrix
        em.line(f"const int row0 = {paren(*em.expr_prec(s.row0)[:2], 12)} + wsp::frag_row();")
        em.line(f"const int col0 = {paren(*em.expr_prec(s.col0)[:2], 12)} + wsp::frag_col();")
        causal = None if s.causal is None else paren(*em.expr_prec(s.causal)[:2], 12)
        edge = None   # the lower bound's column: a negative constant (a window's far edge) as `row - 255`
        if isinstance(s.lower, ir.IntConst) and s.lower.value < 0:
            edge = f"row - {-s.lower.value}"
        elif s.lower is not None:
            edge = f"row + {paren(*em.expr_prec(s.lower)[:2], 12)}"
        limit = paren(*em.expr_prec(s.limit)[:2], 10)
        if s.period is not None:
            em.line(f"const int period = {paren(*em.expr_prec(s.period)[:2], 12)};")
        with fragment_loop(em, FULL, t.cols):
            em.line("const int row = (row0 + 8 * fi) % period;" if s.period is not None
                    else "const int row = row0 + 8 * fi;")
            em.line("const int col = col0 + 8 * fj;")
            values = []
            for c in (0, 1):
                col = f"col + {c}" if c else "col"
                cond = (f"{col} >= {limit}" + (f" || {col} > row + {causal}" if causal else "")
                        + (f" || {col} < {edge}" if edge else ""))
                values.append(f"({cond}) ? -INFINITY : {t.read(c)}")
            for ln in assignments(t, values):
                em.line(ln)


def emit_tile_view(em: Emitter, s: ir.TileView) -> None:
    em.require_warpgroup(s)
    src = em.tile(s.src, s)
    if src.layout not in (FULL, ROW):
        raise EmitError(f"{describe(s)}: views are columns of a [64, N] or [1, N] tile; {s.src} is "
                        f"[{src.rows}, {src.cols}]")
    # verifier _TileView: whole 8-column groups inside src, col0 a constant or unroll variables
    view = src.columns(em.expr(s.col0), s.cols)
    # verifier _declare: unique in scope (a view of the same name in another block is replaced)
    assert s.name not in em.role.tiles or em.role.tiles[s.name].offset, s
    em.role.tiles[s.name] = view
    em.line(f"// tile.view {s.name}, {s.src}, cols({em.expr(s.col0)}, {s.cols}): {src.name}'s elements from "
            f"[{view.offset}]")
