"""The verifier's shape checks: TMA boxes and copies, wgmma operands, and register-tile ops.

`TileChecks` holds the per-statement checks of every statement that moves or computes a tile
(tma.load/store, wgmma.*, reg, tile.*) plus the tensormap declarations' box rules. It is a mixin
of `structure.StructureCheck`, whose walk calls these methods by statement type and
provides what they build on: the report `self.r`, name lookup (`_lookup`, `_declare`), scalar
expressions (`_expr`), barrier references (`_bar`) and dtypes (`_dtype`).
"""

from __future__ import annotations

from wsched.target import (
    DTYPE_NAMES, FRAGMENT_COLUMN_GROUP, INT_TILE_OPS, REGISTER_DTYPES, OPERAND_SWIZZLES, PAGE_ROWS_ALIGN, SWIZZLE_ROW_BYTES,
    TMA_INNER_BOX_ALIGNMENT, TMA_MAX_BOX_DIM, TMA_SWIZZLES, WARPGROUP_THREADS, WGMMA_ACCUMULATOR_DTYPE, WGMMA_K, WGMMA_M,
    WGMMA_N, WGMMA_OPERAND_DTYPES,
)

from .. import ir
from ..printer import expr_text
from ..spelling import keyword
from ..evaluate import evaluate
from .lines import array_text, constant, expr_nodes, plural, ref_text, volume

SWIZZLE_CHOICES = ", ".join(map(str, TMA_SWIZZLES[:-1])) + f" or {TMA_SWIZZLES[-1]}"   # "0, 32, 64 or 128"
_N_STEP = WGMMA_N[1] - WGMMA_N[0]
_ACCUMULATOR = (f"an {WGMMA_ACCUMULATOR_DTYPE}[{WGMMA_M}, N] register tile with N a multiple of {_N_STEP} in "
                f"[{WGMMA_N[0]}, {WGMMA_N[-1]}]")


class TileChecks:
    """Shapes and dtypes of every copy, MMA and tile op (a mixin of StructureCheck)."""

    # -- operands -------------------------------------------------------------------------------

    def _tile(self, name, path, scope, ctx) -> "ir.RegDecl | None":
        return self._lookup(name, "register tile", path, scope, ctx, "tile")

    def _smem(self, ref: ir.SmemRef, path, scope, ctx) -> "ir.SmemDecl | None":
        decl = self._lookup(ref.buffer, "smem buffer", path, scope, ctx, "buffer")
        for e in ref.index:
            self._expr(e, path, scope, ctx)
        if decl is None:
            return None
        if len(ref.index) >= len(decl.shape):
            self.r.at(path, f"`{ref_text(ref)}` has {len(ref.index)} indices but {decl.name} is "
                            f"{array_text(decl.dtype, decl.shape)} (rank {len(decl.shape)}); a reference "
                            f"selects a sub-array, so use at most {len(decl.shape) - 1}")
            return None
        for dim, e in enumerate(ref.index):
            v = constant(e)
            if isinstance(v, int) and not 0 <= v < decl.shape[dim]:
                self.r.at(path, f"`{ref_text(ref)}`: index {v} is out of range for dim {dim} of {decl.name} "
                                f"(extent {decl.shape[dim]}); valid indices are 0..{decl.shape[dim] - 1}")
                return None
        return decl

    def _tensormap(self, p: ir.TensorMapParam, report) -> None:
        """The box a tensormap param declares must be one TMA can copy."""
        if len(p.box) != len(p.shape):
            report(f"box({', '.join(map(str, p.box))}) has {len(p.box)} dims but the tensor has rank "
                   f"{len(p.shape)}; give one box extent per dim")
        for d in p.box:
            if not 1 <= d <= TMA_MAX_BOX_DIM:
                report(f"box extent {d} is outside [1, {TMA_MAX_BOX_DIM}], the range a TMA box allows")
        if p.swizzle not in TMA_SWIZZLES:
            report(f"swizzle({p.swizzle}) is not a TMA swizzle; use {SWIZZLE_CHOICES}")
        if not p.box or p.dtype not in ir.DTYPE_BYTES:
            return
        inner = p.box[-1] * ir.DTYPE_BYTES[p.dtype]
        if inner % TMA_INNER_BOX_ALIGNMENT:
            report(f"the box's inner dim is {p.box[-1]} {p.dtype} = {inner} bytes; TMA needs a multiple "
                   f"of {TMA_INNER_BOX_ALIGNMENT} bytes")
        if p.swizzle in TMA_SWIZZLES and p.swizzle and inner > p.swizzle:
            most = p.swizzle // ir.DTYPE_BYTES[p.dtype]
            report(f"the box's inner dim is {p.box[-1]} {p.dtype} = {inner} bytes, more than the "
                   f"{p.swizzle}-byte swizzle span; use at most {most} {p.dtype} per box row (store "
                   f"wider tiles as column chunks)")

    # -- statements -----------------------------------------------------------------------------

    def _tma(self, verb, ref: ir.SmemRef, tensor, coords, path, scope, ctx, row=None) -> None:
        decl = self._smem(ref, path, scope, ctx)
        for c in coords + ((row,) if row is not None else ()):
            self._expr(c, path, scope, ctx)
        b = scope.get(tensor)
        param = b.decl if b is not None and b.what == "tensormap param" else None
        if b is None:
            self.r.at(path, f"{verb} uses `{tensor}`, which is not a kernel parameter; declare it as "
                            f"`tensormap {tensor}: dtype[shape] box(...) swizzle(...)`")
        elif param is None:
            self.r.at(path, f"{verb} needs a tensormap param, but `{tensor}` is a {b.what}; declare it "
                            f"as `tensormap {tensor}: ...`")
        if param is None:
            return
        coord_text = f"{tensor}[{', '.join(expr_text(c) for c in coords)}]"
        if len(coords) != len(param.shape):
            self.r.at(path, f"{verb} {coord_text} gives {plural(len(coords), 'coordinate')} but tensormap {tensor} "
                            f"is {array_text(param.dtype, param.shape)} (rank {len(param.shape)}); give one "
                            f"coordinate per dim, outermost first")
        if decl is None or param.dtype not in ir.DTYPE_BYTES or decl.dtype not in ir.DTYPE_BYTES:
            return
        sub = ir.smem_subshape(decl, ref)
        box_bytes = volume(param.box) * ir.DTYPE_BYTES[param.dtype]
        sub_bytes = volume(sub) * ir.DTYPE_BYTES[decl.dtype]
        if param.dtype != decl.dtype:
            direction = "into" if verb == "tma.load" else "from"
            self.r.at(path, f"{verb} copies {param.dtype} (tensormap {tensor}) {direction} {decl.name}, "
                            f"which is {decl.dtype}; TMA does not convert: declare {decl.name} as "
                            f"{param.dtype}")
        elif row is not None:
            self._box_rows(param, decl, ref, row, path)
        elif box_bytes != sub_bytes:
            self.r.at(path, f"{verb} moves one box({', '.join(map(str, param.box))}) of {param.dtype} = "
                            f"{box_bytes} bytes but {ref_text(ref)} is {array_text(decl.dtype, sub)} = {sub_bytes} "
                            f"bytes; the smem sub-array must hold exactly one box")
        if param.swizzle != decl.swizzle:
            self.r.at(path, f"tensormap {tensor} has swizzle({param.swizzle}) but smem {decl.name} has "
                            f"swizzle({decl.swizzle}); TMA lays the box out with the map's swizzle, so both "
                            f"must agree")

    def _box_rows(self, param: ir.TensorMapParam, decl: ir.SmemDecl, ref: ir.SmemRef, row: ir.Expr, path) -> None:
        """`tma.load D row(r) <- ...`: the box lands as rows r .. r + rows - 1 of the 2-D sub-array D."""
        sub = ir.smem_subshape(decl, ref)
        box = f"box({', '.join(map(str, param.box))})"
        if len(sub) != 2:
            self.r.at(path, f"tma.load {ref_text(ref)} row({expr_text(row)}): {ref_text(ref)} is "
                            f"{array_text(decl.dtype, sub)}; a row offset fills rows of a 2-D [rows, width] "
                            f"sub-array: index all but the last two dims of {decl.name}")
            return
        height, width = sub
        if param.box[-1] != width:
            self.r.at(path, f"tma.load {ref_text(ref)} row({expr_text(row)}): the {box} of tensormap "
                            f"{param.name} has rows of {param.box[-1]} {param.dtype} but {ref_text(ref)} is "
                            f"{array_text(decl.dtype, sub)}; the box's inner extent must be the sub-array's "
                            f"width, {width}")
            return
        rows = volume(param.box) // width
        head = f"tma.load {ref_text(ref)} row({expr_text(row)}): the {box}"
        if rows > height:
            self.r.at(path, f"{head} is {rows} rows but {ref_text(ref)} has {height}; use a box of at most "
                            f"{height} rows")
            return
        first = constant(row)
        if isinstance(first, int) and not 0 <= first <= height - rows:
            self.r.at(path, f"{head} fills rows {first} .. {first + rows - 1} but {ref_text(ref)} has {height}; "
                            f"the box must land inside the sub-array: row(r) with 0 <= r <= {height - rows}")
            return
        align, step = ir.tma_row_step(decl)
        if isinstance(first, int) and first % step:
            whose = (f"swizzle({decl.swizzle}) needs ({PAGE_ROWS_ALIGN} rows of its {decl.swizzle}-byte span, "
                     f"where its pattern repeats)" if decl.swizzle else "TMA needs")
            row_bytes = width * ir.DTYPE_BYTES[decl.dtype]
            self.r.at(path, f"{head} would start {first} rows = {first * row_bytes} bytes into {ref_text(ref)}, "
                            f"not on the {align}-byte alignment {whose}; use a row that is a multiple of {step}")

    def _TmaLoad(self, s: ir.TmaLoad, path, scope, ctx):
        self._tma("tma.load", s.dst, s.tensor, s.coords, path, scope, ctx, s.row)
        self._bar(s.bar, path, scope, ctx)
        if s.multicast is not None:
            self._cluster_operand("multicast", s.multicast, path, scope, ctx)

    def _TmaStore(self, s: ir.TmaStore, path, scope, ctx):
        self._tma("tma.store", s.src, s.tensor, s.coords, path, scope, ctx)

    def _TmaCommit(self, s, path, scope, ctx):
        pass

    def _TmaWait(self, s: ir.TmaWait, path, scope, ctx):
        if s.pending < 0:
            self.r.at(path, f"{keyword(s)} {s.pending}: the pending count is >= 0")

    _WgmmaFence = _WgmmaCommit = _TmaCommit            # no operands to check

    def _WgmmaWait(self, s: ir.WgmmaWait, path, scope, ctx):
        if s.pending < 0:
            self.r.at(path, f"wgmma.wait {s.pending}: the pending count is >= 0")

    def _smem_tile(self, ref, decl, path) -> "tuple[int, int] | None":
        sub = ir.smem_subshape(decl, ref)
        try:
            return ir.tile_shape_of_subarray(sub)
        except ValueError:
            self.r.at(path, f"`{ref_text(ref)}` is a {array_text(decl.dtype, sub)} sub-array, which holds no 2-D "
                            f"tile; select a [rows, cols] or (chunks, rows, width) sub-array")
            return None

    def _Wgmma(self, s: ir.Wgmma, path, scope, ctx):
        self._expr(s.accumulate, path, scope, ctx)
        for which, major in (("a", s.a_major), ("b", s.b_major)):
            if major not in ir.MMA_MAJORS:
                self.r.at(path, f"major({s.a_major}, {s.b_major}): {which}'s major must be "
                                f"{' or '.join(ir.MMA_MAJORS)}")
        acc = self._tile(s.acc, path, scope, ctx)
        self._fragment_only("wgmma", (s.acc, s.a), path, scope)
        for name in (s.acc, s.a):
            if isinstance(name, str) and name in self.views:
                self.r.at(path, f"wgmma operand {name} is a tile.view; wgmma reads and writes whole `reg` tiles "
                                f"(an asynchronous wgmma holds the registers it names until its wgmma.wait)")
        n = k = a_dtype = None
        if acc is not None:
            if (acc.dtype != WGMMA_ACCUMULATOR_DTYPE or len(acc.shape) != 2 or acc.shape[0] != WGMMA_M
                    or acc.shape[1] not in WGMMA_N):
                self.r.at(path, f"the accumulator {s.acc} is {array_text(acc.dtype, acc.shape)}; wgmma "
                                f"accumulates into {_ACCUMULATOR}")
            else:
                n = acc.shape[1]
        if isinstance(s.a, ir.SmemRef):
            a_name = ref_text(s.a)
            decl = self._smem(s.a, path, scope, ctx)
            tile = self._smem_tile(s.a, decl, path) if decl is not None else None
            if tile is not None:
                a_dtype = decl.dtype
                rows, k = tile if s.a_major == "k" else (tile[1], tile[0])
        else:
            a_name = s.a
            reg = self._tile(s.a, path, scope, ctx)
            if s.a_major != "k":
                self.r.at(path, f"A from registers ({s.a}) is K-major; use major(k, {s.b_major})")
            tile = None
            if reg is not None and len(reg.shape) == 2:
                a_dtype = reg.dtype
                rows, k = reg.shape
                tile = reg.shape
        if tile is not None and (rows != WGMMA_M or k % WGMMA_K or k < WGMMA_K):
            self.r.at(path, f"A operand {a_name} holds a [{rows}, {k}] tile; wgmma's A is [{WGMMA_M}, K] with "
                            f"K a multiple of {WGMMA_K}")
            k = None
        if a_dtype is not None and a_dtype not in WGMMA_OPERAND_DTYPES:
            self.r.at(path, f"A operand {a_name} is {a_dtype}; wgmma multiplies "
                            f"{' or '.join(WGMMA_OPERAND_DTYPES)}")
        decl = self._smem(s.b, path, scope, ctx)
        tile = self._smem_tile(s.b, decl, path) if decl is not None else None
        if tile is None:
            return
        if a_dtype is not None and decl.dtype != a_dtype:
            self.r.at(path, f"B operand {ref_text(s.b)} is {decl.dtype} but A is {a_dtype}; both operands "
                            f"must have one dtype")
        b_n, b_k = tile if s.b_major == "k" else (tile[1], tile[0])
        if n is not None and k is not None and (b_n, b_k) != (n, k):
            sub = list(ir.smem_subshape(decl, s.b))
            if s.b_major == "k":
                want = f"[{n}, {k}] (K-major: [N, K])"
            else:
                # Column chunks one swizzle span wide (128 bytes: 64 bf16; or 64 bytes: 32 bf16).
                span = decl.swizzle if decl.swizzle in OPERAND_SWIZZLES else SWIZZLE_ROW_BYTES
                width = span // ir.DTYPE_BYTES[decl.dtype] if decl.dtype in ir.DTYPE_BYTES else 0
                want = (f"({n // width}, {k}, {width}) (N-major column chunks)" if width and n % width == 0
                        else f"[{k}, {n}]")
            self.r.at(path, f"B operand {ref_text(s.b)} is {sub}, a tile with N = {b_n} and K = {b_k}, but the "
                            f"accumulator {s.acc} has N = {n} and A has K = {k}; B must be {want}")

    def _RegDecl(self, s: ir.RegDecl, path, scope, ctx):
        self._dtype(s.dtype, lambda m: self.r.at(path, m))
        if s.dtype in DTYPE_NAMES and s.dtype not in REGISTER_DTYPES:
            self.r.at(path, f"register tile {s.name} is {s.dtype}: register tiles hold {', '.join(REGISTER_DTYPES)} "
                            f"values; read an {s.dtype} tensor into an f32 tile (tile.load converts)")
        if not s.shape or any(d < 1 for d in s.shape):
            self.r.at(path, f"shape {list(s.shape)}: a register tile needs at least one dim, each >= 1")
        elif s.layout not in ir.REG_LAYOUTS:
            self.r.at(path, f"reg {s.name}: layout `{s.layout}` is not a register tile layout; write nothing (the "
                            f"wgmma fragment layout) or `linear`")
        elif s.layout == "linear" and not _linear_shape(s.shape):
            self.r.at(path, f"reg {s.name}: {array_text(s.dtype, s.shape)} linear does not spread over the "
                            f"{WARPGROUP_THREADS} threads of a warpgroup; a linear tile is [R, C] with R dividing "
                            f"{WARPGROUP_THREADS} and R x C a multiple of {WARPGROUP_THREADS} (each thread "
                            f"R C / {WARPGROUP_THREADS} elements of one row), or [R, 1] (each row's value)")
        self._declare(s.name, "register tile", path, scope, s)

    # -- linear tiles (docs/ir.md, "Linear tiles") -------------------------------------------------

    def _layout_of(self, name, scope) -> "str | None":
        b = scope.get(name) if isinstance(name, str) else None
        if b is None or b.what != "register tile" or b.decl is None:
            return None
        return b.decl.layout

    @staticmethod
    def _single(name, scope) -> bool:
        """A tile of one value ([1, 1]): every thread holds it, in either layout."""
        b = scope.get(name)
        return b is not None and b.decl is not None and all(x == 1 for x in b.decl.shape)

    def _one_layout(self, word, names, path, scope) -> None:
        """The tiles of an elementwise op lie in one layout (a linear tile's elements are not where
        the fragment layout keeps them); a [1, 1] tile joins either."""
        layouts = {name: self._layout_of(name, scope) for name in names if isinstance(name, str)
                   and not self._single(name, scope)}
        layouts = {name: x for name, x in layouts.items() if x in ir.REG_LAYOUTS}   # (_RegDecl names others)
        if len(set(layouts.values())) > 1:
            spelled = ", ".join(f"{name} {layout}" for name, layout in layouts.items())
            self.r.at(path, f"{word}: the tiles lie in different layouts ({spelled}); an elementwise op "
                            f"combines tiles of one layout")
            return
        dst = scope.get(names[0]) if isinstance(names[0], str) else None
        if dst is None or dst.decl is None or dst.decl.layout != "linear":
            return
        rows = dst.decl.shape[0]
        for name in names[1:]:   # a thread holds one row of a linear tile: no broadcast along rows
            b = scope.get(name) if isinstance(name, str) else None
            if b is not None and b.decl is not None and tuple(b.decl.shape) not in (
                    tuple(dst.decl.shape), (rows, 1), (1, 1)):
                self.r.at(path, f"{word}: {name} {list(b.decl.shape)} broadcast into the linear tile {names[0]} "
                                f"{list(dst.decl.shape)}; a linear tile's operands are tiles of its shape, "
                                f"[{rows}, 1] (a value a row) or [1, 1]")

    def _fragment_only(self, word, names, path, scope) -> None:
        for name in names:
            if self._layout_of(name, scope) == "linear":
                self.r.at(path, f"{word}: {name} is a linear tile; this op works on tiles in the wgmma fragment "
                                f"layout (a linear tile takes tile.fill, tile.iota, the unary and binary ops, tile.load and tile.store)")

    # -- i32 tiles (docs/ir.md, "Integer tiles") -------------------------------------------------

    def _is_int_tile(self, name, scope) -> bool:
        b = scope.get(name) if isinstance(name, str) else None
        return b is not None and b.what == "register tile" and b.decl.dtype == "i32"

    def _int_operands(self, word, dst_name, operands, path, scope) -> None:
        """An op computing into an i32 tile reads i32 tiles and integer scalars only (a float
        operand would be truncated silently)."""
        for o in operands:
            if isinstance(o, str):
                b = scope.get(o)
                if b is not None and b.what == "register tile" and b.decl.dtype != "i32":
                    self.r.at(path, f"{word} {dst_name}: {dst_name} is i32 but operand {o} is {b.decl.dtype}; an op "
                                    f"into an i32 tile computes in integers on i32 tiles and integer scalars "
                                    f"(tile.cast {dst_name}, {o} truncates a float tile first)")
            elif any(isinstance(n, ir.FloatConst) or (isinstance(n, ir.Var) and self._is_float_scalar(n.name, scope))
                     for n in expr_nodes(o)):
                self.r.at(path, f"{word} {dst_name}: {dst_name} is i32 but the scalar {expr_text(o)} is a float; "
                                f"an op into an i32 tile takes integer scalars")

    @staticmethod
    def _is_float_scalar(name, scope) -> bool:
        b = scope.get(name)
        return b is not None and b.what == "scalar param" and b.decl.dtype != "i32"

    def _not_int(self, word, name, path, scope, what: str) -> None:
        if self._is_int_tile(name, scope):
            self.r.at(path, f"{word}: {name} is an i32 tile, which {what}; i32 tiles hold ids and positions "
                            f"for comparisons and integer arithmetic ({', '.join(INT_TILE_OPS)})")

    def _TileFill(self, s: ir.TileFill, path, scope, ctx):
        self._tile(s.dst, path, scope, ctx)
        self._expr(s.value, path, scope, ctx)
        if self._is_int_tile(s.dst, scope):
            self._int_operands("tile.fill", s.dst, (s.value,), path, scope)

    def _TileUnary(self, s: ir.TileUnary, path, scope, ctx):
        if s.op not in ir.TILE_UNARY_OPS:
            self.r.at(path, f"tile.{s.op} is not a unary tile op; use one of {', '.join(ir.TILE_UNARY_OPS)}")
        dst = self._tile(s.dst, path, scope, ctx)
        src = self._tile(s.src, path, scope, ctx)
        self._one_layout(f"tile.{s.op} {s.dst}, {s.src}", (s.dst, s.src), path, scope)
        if dst is not None and src is not None and dst.shape != src.shape:
            self.r.at(path, f"tile.{s.op} {s.dst}, {s.src}: {s.src} is {array_text(src.dtype, src.shape)} but "
                            f"{s.dst} is {array_text(dst.dtype, dst.shape)}; an elementwise op keeps the shape")
        if self._is_int_tile(s.dst, scope):
            if s.op not in INT_TILE_OPS:
                self.r.at(path, f"tile.{s.op} {s.dst}, {s.src}: {s.dst} is i32; an i32 tile is computed by "
                                f"{', '.join(INT_TILE_OPS)} (write float results into an f32 tile)")
            elif s.op != "cast":
                self._int_operands(f"tile.{s.op}", s.dst, (s.src,), path, scope)

    def _TileBinary(self, s: ir.TileBinary, path, scope, ctx):
        if s.op not in ir.TILE_BINARY_OPS:
            self.r.at(path, f"tile.{s.op} is not a binary tile op; use one of {', '.join(ir.TILE_BINARY_OPS)}")
        self._broadcast_operands(f"tile.{s.op}", s.dst, (s.lhs, s.rhs), path, scope, ctx)
        self._one_layout(f"tile.{s.op} {s.dst}", (s.dst, s.lhs, s.rhs), path, scope)
        if self._is_int_tile(s.dst, scope):
            if s.op in ir.COMPARE_OPS:
                self.r.at(path, f"tile.{s.op} {s.dst}: {s.dst} is i32; a comparison writes 1.0 / 0.0 into a "
                                f"float tile (its operands may be i32)")
            elif s.op not in INT_TILE_OPS:
                self.r.at(path, f"tile.{s.op} {s.dst}: {s.dst} is i32; an i32 tile is computed by "
                                f"{', '.join(INT_TILE_OPS)} (divide in an f32 tile)")
            else:
                self._int_operands(f"tile.{s.op}", s.dst, (s.lhs, s.rhs), path, scope)

    def _broadcast_operands(self, word, dst_name, operands, path, scope, ctx) -> None:
        """The tile operands of an elementwise op broadcast to its destination's shape."""
        dst = self._tile(dst_name, path, scope, ctx)
        shapes = []
        for operand in operands:
            if isinstance(operand, str):
                t = self._tile(operand, path, scope, ctx)
                if t is None:
                    return
                shapes.append((operand, t.shape))
            else:
                self._expr(operand, path, scope, ctx)
        if dst is None or not shapes:
            return
        names = ", ".join(f"{name} {list(shape)}" for name, shape in shapes)
        if any(len(shape) != len(dst.shape) for _, shape in shapes):
            self.r.at(path, f"{word} {dst_name}: operands {names} and result {list(dst.shape)} differ in "
                            f"rank; tiles of one op have one rank (extent 1 broadcasts)")
            return
        result = tuple(max(shape[d] for _, shape in shapes) for d in range(len(dst.shape)))
        bad = any(x not in (1, r) for _, shape in shapes for x, r in zip(shape, result))
        if bad or result != tuple(dst.shape):
            self.r.at(path, f"{word} {dst_name}: operands {names} do not broadcast to the result "
                            f"{list(dst.shape)}; each dim must equal the result's or be 1")

    def _TileMask(self, s: ir.TileMask, path, scope, ctx):
        dst = self._tile(s.dst, path, scope, ctx)
        self._fragment_only(f"tile.mask {s.dst}", (s.dst,), path, scope)
        self._not_int(f"tile.mask {s.dst}", s.dst, path, scope, "holds no -inf")
        for e in (s.row0, s.col0, s.limit) + tuple(x for x in (s.causal, s.period, s.lower) if x is not None):
            self._expr(e, path, scope, ctx)
        if dst is not None and len(dst.shape) != 2:
            self.r.at(path, f"tile.mask {s.dst}: {s.dst} is {list(dst.shape)}; the mask applies to a 2-D tile")

    def _TileReduce(self, s: ir.TileReduce, path, scope, ctx):
        if s.op not in ir.REDUCE_OPS:
            self.r.at(path, f"tile.reduce.{s.op} is not a reduction; use one of {', '.join(ir.REDUCE_OPS)}")
        dst = self._tile(s.dst, path, scope, ctx)
        src = self._tile(s.src, path, scope, ctx)
        self._fragment_only(f"tile.reduce.{s.op} {s.dst}, {s.src}", (s.src, s.dst), path, scope)
        for name in (s.src, s.dst):
            self._not_int(f"tile.reduce.{s.op} {s.dst}, {s.src}", name, path, scope, "is not reduced")
        if dst is None or src is None:
            return
        if not 0 <= s.axis < len(src.shape):
            self.r.at(path, f"axis({s.axis}) is out of range for {s.src} {list(src.shape)}; use 0.."
                            f"{len(src.shape) - 1}")
            return
        want = tuple(1 if d == s.axis else x for d, x in enumerate(src.shape))
        if tuple(dst.shape) != want:
            self.r.at(path, f"tile.reduce.{s.op} {s.dst}, {s.src}, axis({s.axis}): {s.dst} is "
                            f"{list(dst.shape)} but reducing {list(src.shape)} over axis {s.axis} gives "
                            f"{list(want)}; declare {s.dst} with that shape")

    def _global_tile(self, verb, tensor, coords, tile_name, path, scope, ctx) -> None:
        for c in coords:
            self._expr(c, path, scope, ctx)
        param = self._lookup(tensor, "global param", path, scope, ctx, "tensor")
        t = self._tile(tile_name, path, scope, ctx)
        if param is None:
            return
        if len(coords) != len(param.shape):
            self.r.at(path, f"{verb} {tensor}[{', '.join(expr_text(c) for c in coords)}] gives "
                            f"{plural(len(coords), 'coordinate')} but {tensor} is {array_text(param.dtype, param.shape)} (rank "
                            f"{len(param.shape)}); give one coordinate per dim")
        if t is None:
            return
        if t.layout == "linear" and len(param.shape) < 2:
            self.r.at(path, f"{verb}: {tile_name} is a linear tile and {tensor} has rank {len(param.shape)}; a linear "
                            f"tile is read from and written to tensors of rank 2 or more (its rows, then columns)")
        extra = len(t.shape) - len(param.shape)
        if extra > 0 and any(d != 1 for d in t.shape[:extra]):
            self.r.at(path, f"{verb}: tile {tile_name} {list(t.shape)} does not fit {tensor} (rank "
                          f"{len(param.shape)}); the tile covers the tensor's trailing dims, and its "
                          f"dims beyond the tensor's rank must be 1")

    def _TileLoadGlobal(self, s: ir.TileLoadGlobal, path, scope, ctx):
        self._global_tile("tile.load", s.tensor, s.coords, s.dst, path, scope, ctx)
        b = scope.get(s.tensor)
        if self._is_int_tile(s.dst, scope) and b is not None and b.what == "global param" and b.decl.dtype != "i32":
            self.r.at(path, f"tile.load {s.dst} <- {s.tensor}: {s.dst} is i32 but {s.tensor} is {b.decl.dtype}; an "
                            f"i32 tile reads an i32 tensor (read a float tensor into an f32 tile)")

    def _TileStoreGlobal(self, s: ir.TileStoreGlobal, path, scope, ctx):
        self._global_tile("tile.store", s.tensor, s.coords, s.src, path, scope, ctx)
        self._not_int(f"tile.store {s.tensor}", s.src, path, scope, "is not stored")
        if s.row_limit is None:
            return
        self._expr(s.row_limit, path, scope, ctx)
        if any(isinstance(node, ir.FloatConst) for node in expr_nodes(s.row_limit)):
            self.r.at(path, f"row_limit({expr_text(s.row_limit)}) is a row, an integer expression; it holds a "
                            f"float constant")
        b = scope.get(s.tensor)   # _global_tile reported a name that is not a global param
        param = b.decl if b is not None and b.what == "global param" else None
        if param is not None and len(param.shape) < 2:
            self.r.at(path, f"tile.store {s.tensor}[{', '.join(expr_text(c) for c in s.coords)}] <- {s.src} "
                            f"row_limit({expr_text(s.row_limit)}): {s.tensor} is "
                            f"{array_text(param.dtype, param.shape)} (rank {len(param.shape)}); row_limit "
                            f"bounds the rows (dim -2) of a tensor of rank 2 or more")

    def _TileStoreSmem(self, s: ir.TileStoreSmem, path, scope, ctx):
        decl = self._smem(s.dst, path, scope, ctx)
        t = self._tile(s.src, path, scope, ctx)
        self._not_int(f"tile.store_smem {ref_text(s.dst)}", s.src, path, scope, "is not stored")
        self._fragment_only(f"tile.store_smem {ref_text(s.dst)} <- {s.src}", (s.src,), path, scope)
        if decl is None or t is None:
            return
        holds = self._smem_tile(s.dst, decl, path)
        if holds is not None and tuple(t.shape) != holds:
            self.r.at(path, f"tile.store_smem {ref_text(s.dst)} <- {s.src}: {s.src} is {list(t.shape)} but "
                            f"{ref_text(s.dst)} ({list(ir.smem_subshape(decl, s.dst))}) holds a {list(holds)} "
                            f"tile; the tile and the sub-array must have one shape")

    # -- attention score functions ----------------------------------------------------------------

    def _TileIota(self, s: ir.TileIota, path, scope, ctx):
        self._expr(s.start, path, scope, ctx)
        dst = self._tile(s.dst, path, scope, ctx)
        if dst is not None and len(dst.shape) != 2:
            self.r.at(path, f"tile.iota {s.dst}: {s.dst} is {list(dst.shape)}; positions fill a 2-D tile")
        if s.axis not in (0, 1):
            self.r.at(path, f"tile.iota {s.dst}: axis({s.axis}) is not an axis of a 2-D tile; use 0 (rows) or "
                            f"1 (columns)")

    def _TileSelect(self, s: ir.TileSelect, path, scope, ctx):
        self._broadcast_operands("tile.select", s.dst, (s.cond, s.on_true, s.on_false), path, scope, ctx)
        self._fragment_only(f"tile.select {s.dst}", (s.dst, s.cond, s.on_true, s.on_false), path, scope)
        if self._is_int_tile(s.dst, scope):
            self._int_operands("tile.select", s.dst, (s.on_true, s.on_false), path, scope)

    # -- sliced epilogues -------------------------------------------------------------------------

    def _TileView(self, s: ir.TileView, path, scope, ctx):
        self._expr(s.col0, path, scope, ctx)
        src = self._tile(s.src, path, scope, ctx)
        self._fragment_only(f"tile.view {s.name}, {s.src}", (s.src,), path, scope)
        view = None
        if src is not None:
            if len(src.shape) != 2:
                self.r.at(path, f"tile.view {s.name}, {s.src}: {s.src} is {array_text(src.dtype, src.shape)}; a "
                                f"view takes columns of a 2-D tile")
            elif s.cols < 1 or s.cols % FRAGMENT_COLUMN_GROUP:
                self.r.at(path, f"tile.view {s.name}: cols({expr_text(s.col0)}, {s.cols}) is {s.cols} columns; a "
                                f"view spans whole column groups of the fragment layout, a multiple of "
                                f"{FRAGMENT_COLUMN_GROUP}")
            else:
                self._view_columns(s, src, path, scope)
                view = ir.RegDecl(s.name, src.dtype, (src.shape[0], s.cols))
        self.views.add(s.name)
        self._declare(s.name, "register tile", path, scope, view)

    def _view_columns(self, s: ir.TileView, src: ir.RegDecl, path, scope) -> None:
        """col0 reads constants and `unroll` loop variables only (every register index is then a
        compile-time constant); each of its values is a whole column group inside src."""
        loops = {}
        for name in ir.expr_vars(s.col0):
            b = scope.get(name)
            loop = b.decl if b is not None and b.what == "loop variable" else None
            if not isinstance(loop, ir.For) or loop.iteration != "unroll":
                self.r.at(path, f"tile.view {s.name}: the first column {expr_text(s.col0)} reads `{name}`, which "
                                f"is not the variable of an enclosing `unroll` loop; the registers of a view "
                                f"must be known at compile time (use constants and unroll loop variables)")
                return
            bounds = [constant(e) for e in (loop.start, loop.stop, loop.step)]
            if not all(isinstance(v, int) for v in bounds) or bounds[2] < 1:
                return      # checked where the loop's bounds are known: in the simulator
            loops[name] = range(*bounds)
        names = list(loops)
        for values in _product([loops[n] for n in names]):
            try:
                col0 = evaluate(s.col0, dict(zip(names, values)))
            except (KeyError, ZeroDivisionError, TypeError, ValueError):
                return
            if not isinstance(col0, int) or col0 < 0 or col0 % FRAGMENT_COLUMN_GROUP or col0 + s.cols > src.shape[1]:
                at = ", ".join(f"{n} = {v}" for n, v in zip(names, values))
                self.r.at(path, f"tile.view {s.name}: columns {col0}..{col0 + s.cols - 1 if isinstance(col0, int) else '?'}"
                                f"{f' (at {at})' if at else ''} are not a whole-group slice of {s.src} "
                                f"{list(src.shape)}; the first column is a multiple of {FRAGMENT_COLUMN_GROUP} and the "
                                f"last inside the tile")
                return



def _product(ranges):
    if not ranges:
        yield ()
        return
    for v in ranges[0]:
        for rest in _product(ranges[1:]):
            yield (v,) + rest


def _linear_shape(shape) -> bool:
    """[R, C] with R dividing the warpgroup's threads and R C a multiple of them, or [R, 1]."""
    if len(shape) != 2 or WARPGROUP_THREADS % shape[0]:
        return False
    return shape[1] == 1 or shape[0] * shape[1] % WARPGROUP_THREADS == 0
