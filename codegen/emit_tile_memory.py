"""Register tiles to and from memory in CUDA: `tile.load`, `tile.store`, `tile.store_smem`.

Global tile loads and stores are bounds-checked and branch-free per element: each row takes one
64-bit row pointer plus constant column offsets and predicated accesses (`wsp::load_pair`,
`wsp::store_split`, ... in `include/global_access.cuh`), choosing pair vs element accesses once
per row:

    tile.load bias_t <- bias[n0]      const int col0 = n0 + wsp::frag_col();
                                      if (wsp::pairs_aligned(ptr, N)) { ... bias_t[fj] =
                                        wsp::load_pair(ptr + 8 * fj, row_ok && col0 + 8 * fj < N); }
                                      else { ... wsp::load_split(...) }

Shared-memory tile stores write one pair per `st.shared`, xor-ing each 128B-swizzled address
where it is stored (`wsp::swizzle128` in `include/shared_access.cuh`): ptxas hoisted 64
precomputed swizzled offsets out of the tile loop and spilled.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Callable

from wsched.lowering import ir
from wsched.target import DTYPE_BYTES, ELEMENT_TYPES, FRAGMENT_COLUMN_GROUP, WARPGROUP_THREADS, WGMMA_M

from .emit_context import EmitError, Emitter, describe, paren
from .emit_tiles import assignments, fragment_loop
from .fragment import COL, FULL, LINEAR, LINEAR_ROWS, ROW, SCALAR, Tile


@dataclass(frozen=True)
class _Addressing:
    """Where a tile's fragment lies in a row-major global tensor (C++ texts)."""

    row0: str | None   # first row of this thread's fragment (None: a 1-D tensor)
    col0: str          # first column of this thread's fragment
    checks: tuple[str, ...]  # row (and leading coordinates) inside the tensor, reading `row`
    base: str          # element offset of (row, col0), reading `row`
    cols: str          # the tensor's innermost extent
    pairs: bool = False  # every row pointer is pair-aligned and every row even: no runtime test


def _pairs_aligned(em: Emitter, p: ir.GlobalParam, coords: tuple[ir.Expr, ...], t: Tile) -> bool:
    """A workspace the host allocates (torch: a 256-byte aligned base) whose rows have an even
    length, read at an even column (Emitter.even): every fragment's row pointer is pair-aligned
    (the fragment's own column offset, wsp::frag_col(), is even), so the pair accesses need no
    per-row test and no element-by-element branch (a branch per row keeps the loads of the
    rows, and of the loop iterations around them, from being issued together)."""
    return (isinstance(p, ir.WorkspaceParam) and len(p.shape) >= 2 and em.even(p.shape[-1])
            and em.even(coords[-1]) and t.layout in (FULL, ROW))


def _global_addressing(em: Emitter, s: ir.Stmt, p: ir.GlobalParam, t: Tile,
                       coords: tuple[ir.Expr, ...]) -> _Addressing:
    rank = len(p.shape)
    # verifier _global_tile: one coordinate per dim; a tile of a 1-D tensor is one row
    assert len(coords) == rank and (rank > 1 or t.rows == 1), s
    dims = [paren(text, prec, 13) for text, prec, _ in (em.expr_prec(d) for d in p.shape)]

    def at(coord: ir.Expr, frag: str | None) -> str:
        text, prec, _ = em.expr_prec(coord)
        return f"{paren(text, prec, 12)} + {frag}" if frag else text

    checks, offsets = [], []
    for d in range(rank - 2):  # leading coordinates select one [rows, cols] matrix
        text, prec, _ = em.expr_prec(coords[d])
        offsets.append(f"static_cast<long long>({text}) * {' * '.join(dims[d + 1:])}")
        checks.append(f"{paren(text, prec, 10)} < {dims[d]}")
    row0 = None
    if t.linear and rank < 2:
        raise EmitError(f"{describe(s)}: a linear tile is read from and written to tensors of rank >= 2 "
                        f"(rows and columns); {p.name} has rank {rank}")
    if rank >= 2:
        row0 = at(coords[-2], t.first_row)
        checks.insert(0, f"row < {dims[-2]}")
        offsets.append(f"static_cast<long long>(row) * {dims[-1]}")
    col0 = at(coords[-1], t.first_col)
    return _Addressing(row0, col0, tuple(checks), " + ".join(offsets + ["col0"]), dims[-1],
                       _pairs_aligned(em, p, coords, t))


def _global_loop(em: Emitter, t: Tile, a: _Addressing, p: ir.GlobalParam, writes: bool,
                 access: Callable[[str, str], str]) -> None:
    """Fragment loop of a tile load/store: rows outside (`row_ok`, and `ptr` = this thread's
    first element of the row: one 64-bit address per row, constant offsets per column),
    columns inside. `access(form, ok)` spells the access of one fragment position at
    `ptr + 8 * fj`: form "pair" (one 32/64-bit access, predicate `ok`), "split" (two element
    accesses, predicates `ok0, ok1`) or "one" (a column tile's element)."""
    if a.row0 is not None:
        em.line(f"const int row0 = {a.row0};")
    em.line(f"const int col0 = {a.col0};")
    if t.linear:   # this thread's row, and its `length` consecutive elements of it (fragment.py)
        em.line("const int row = row0;")
        em.line(f"const bool row_ok = {' && '.join(a.checks) or 'true'};")
        em.line(f"{'' if writes else 'const '}{ELEMENT_TYPES[p.dtype].cuda}* const ptr = "
                f"{em.c(p.name)} + {a.base};")
        if t.layout == LINEAR_ROWS:
            em.line(access("one", f"row_ok && col0 < {a.cols}"))
            return
        with fragment_loop(em, LINEAR, t.cols, t.length):
            em.line(access("linear", f"row_ok && col0 + li < {a.cols}"))
        return
    with fragment_loop(em, COL if t.layout in (FULL, COL) else SCALAR, 1):
        if a.row0 is not None:
            em.line("const int row = row0 + 8 * fi;" if t.layout in (FULL, COL) else "const int row = row0;")
        em.line(f"const bool row_ok = {' && '.join(a.checks) or 'true'};")
        em.line(f"{'' if writes else 'const '}{ELEMENT_TYPES[p.dtype].cuda}* const ptr = "
                f"{em.c(p.name)} + {a.base};")
        if t.layout not in (FULL, ROW):
            em.line(access("one", f"row_ok && col0 < {a.cols}"))
            return
        col = "col0 + 8 * fj"
        if a.pairs:   # known aligned: one straight-line body (see _pairs_aligned)
            with fragment_loop(em, ROW, t.cols):
                em.line(access("pair", f"row_ok && {col} < {a.cols}"))
            return
        oks = f"row_ok && {col} < {a.cols}, row_ok && {col} + 1 < {a.cols}"
        # One branch per row, not per element: both sides are straight-line predicated code
        # (three predicated accesses per pair in one path would need three load destinations).
        em.line(f"if (wsp::pairs_aligned(ptr, {a.cols})) {{")
        em.depth += 1
        with fragment_loop(em, ROW, t.cols):
            em.line(access("pair", f"row_ok && {col} < {a.cols}"))
        em.depth -= 1
        em.line("} else {  // unaligned row or odd row length: element by element")
        em.depth += 1
        with fragment_loop(em, ROW, t.cols):
            em.line(access("split", oks))
        em.depth -= 1
        em.line("}")


def emit_tile_load_global(em: Emitter, s: ir.TileLoadGlobal) -> None:
    em.require_warpgroup(s)
    t = em.tile(s.dst, s)
    p = em.global_param(s.tensor, s)
    if isinstance(p, ir.WorkspaceParam) and p.fragments:
        _fragments_access(em, s, t, p, s.coords, store=False)
        return

    def access(form: str, ok: str) -> str:
        if form in ("one", "linear"):
            load = f"wsp::load_one(ptr{' + li' if form == 'linear' else ''}, {ok})"
            if t.dtype == p.dtype:
                return f"{t.index(0)} = {load};"
            return assignments(t, [ELEMENT_TYPES[p.dtype].to_float.format(load)])[0]
        return _pair_assign(t, p, f"wsp::load_{form}(ptr + 8 * fj, {ok})")

    with em.block(f"{{  // tile.load {t.name} <- {p.name}[{em.coords_text(s.coords)}], zero outside"):
        _global_loop(em, t, _global_addressing(em, s, p, t, s.coords), p, False, access)


def _fragments_access(em: Emitter, s: ir.Stmt, t: Tile, p: ir.WorkspaceParam, coords: tuple[ir.Expr, ...],
                      store: bool) -> None:
    """`tile.load` / `tile.store` of a [64, N] tile in a fragments workspace (ir.WorkspaceParam):
    per 8-column group fj, one 16-byte access of this thread's four elements there, (i, c) =
    (0, 0), (0, 1), (1, 0), (1, 1), at 4 t of the strip; a warp's 32 accesses are 512
    contiguous bytes. Bounds as for a row-major tensor: an access is made where its first
    element is inside; a store writes zeros for its other elements that are outside (into the
    strip's padding), so a load of those reads 0 as the row-major tensor's would, without a
    test of its own (tests in the sum's loop made ptxas spill a one-warpgroup 64x256 tile)."""
    what = "tile.store" if store else "tile.load"
    if t.layout != FULL or t.dtype != p.dtype:
        raise EmitError(f"{describe(s)}: a fragments workspace ({p.name}: {p.dtype}) is moved in whole "
                        f"[{WGMMA_M}, N] register tiles of its own dtype; {t.name} is {t.dtype}[{t.rows}, {t.cols}]")
    row, col = coords[-2], coords[-1]
    off = [f"its {what_} coordinate ({em.expr(e)}) must be a multiple of {n}"
           for what_, e, n in (("row", row, WGMMA_M), ("column", col, FRAGMENT_COLUMN_GROUP)) if em.divisor(e) % n]
    if off:
        raise EmitError(f"{describe(s)}: a fragments workspace is moved in whole [{WGMMA_M}, {FRAGMENT_COLUMN_GROUP}] "
                        f"strips: {' and '.join(off)} whatever the call (a constant, a product with one, a sum "
                        f"of such, a let of those)")
    if getattr(s, "row_limit", None) is not None:
        raise EmitError(f"{describe(s)}: a fragments workspace takes no row_limit (its rows are bounded by its shape)")
    dims = [paren(text, prec, 13) for text, prec, _ in (em.expr_prec(d) for d in p.shape)]
    lead, checks = "0", []
    for d in range(len(p.shape) - 2):   # leading coordinates select one matrix
        text, prec, _ = em.expr_prec(coords[d])
        lead = f"({lead}) * {dims[d]} + {paren(text, prec, 12)}" if d else paren(text, prec, 12)
        checks.append(f"{paren(text, prec, 10)} < {dims[d]}")
    rows, cols = dims[-2:]
    row_text, col_text = (paren(*em.expr_prec(c)[:2], 12) for c in (row, col))     # terms of a sum
    row_div, col_div = (paren(*em.expr_prec(c)[:2], 13) for c in (row, col))       # dividends
    strips = (f"(static_cast<long long>({lead}) * wsp::ceil_div({rows}, {WGMMA_M}) + {row_div} / {WGMMA_M}) * "
              f"wsp::ceil_div({cols}, {FRAGMENT_COLUMN_GROUP}) + {col_div} / {FRAGMENT_COLUMN_GROUP}")
    strip = WGMMA_M * FRAGMENT_COLUMN_GROUP
    element = ELEMENT_TYPES[t.dtype].cuda
    with em.block(f"{{  // {what} {p.name}[{em.coords_text(coords)}] {'<-' if store else '->'} {t.name}, "
                  f"fragments: 16 bytes a thread and strip"):
        em.line(f"const int row0 = {row_text} + wsp::frag_row();")
        em.line(f"const int col0 = {col_text} + wsp::frag_col();")
        em.line(f"const bool row_ok = {' && '.join(checks + [f'row0 < {rows}'])};")
        em.line(f"{'' if store else 'const '}{element}* const ptr = {em.c(p.name)} + ({strips}) * {strip} + "
                f"4 * (threadIdx.x % {WARPGROUP_THREADS});")

        def at(i: int, c: int) -> str:
            return re.sub(r"\bfi\b", str(i), t.index(c))

        em.line("#pragma unroll")
        with em.block(f"for (int fj = 0; fj < {t.cols // FRAGMENT_COLUMN_GROUP}; ++fj) {{"):
            ok = f"row_ok && col0 + 8 * fj < {cols}"
            quad = [(0, 0), (0, 1), (1, 0), (1, 1)]
            if store:   # the first element is inside where the access is made; the others are tested
                inside = {(0, 0): None, (0, 1): f"col0 + 8 * fj + 1 < {cols}", (1, 0): f"row0 + 8 < {rows}",
                          (1, 1): f"row0 + 8 < {rows} && col0 + 8 * fj + 1 < {cols}"}
                bits = ", ".join(f"wsp::bit_cast<uint32_t>({at(i, c)})" if inside[i, c] is None else
                                 f"{inside[i, c]} ? wsp::bit_cast<uint32_t>({at(i, c)}) : 0u" for i, c in quad)
                em.line(f"wsp::st_b128_if(ptr + {strip} * fj, make_uint4({bits}), {ok});")
            else:
                em.line(f"const uint4 v = wsp::ld_b128_if(ptr + {strip} * fj, {ok});")
                for (i, c), xyzw in zip(quad, "xyzw"):
                    em.line(f"{at(i, c)} = wsp::bit_cast<{element}>(v.{xyzw});")


def _pair_assign(t: Tile, p: ir.GlobalParam, load: str) -> str:
    """`t at (fj, fi) = the loaded pair`, converting element-wise when the dtypes differ."""
    if t.packed and t.dtype == p.dtype:
        return f"{t.index()} = {load};"
    if not t.packed and t.dtype == p.dtype:   # f32, or i32 into an i32 tile (no conversion)
        return f"{{ const {ELEMENT_TYPES[p.dtype].cuda_pair} v = {load}; {t.index(0)} = v.x; {t.index(1)} = v.y; }}"
    element = ELEMENT_TYPES[p.dtype]
    values = [element.to_float.format(f"v.{xy}") for xy in "xy"]
    return f"{{ const {element.cuda_pair} v = {load}; {' '.join(assignments(t, values))} }}"


def emit_tile_store_global(em: Emitter, s: ir.TileStoreGlobal) -> None:
    em.require_warpgroup(s)
    t = em.tile(s.src, s)
    p = em.global_param(s.tensor, s)
    if isinstance(p, ir.WorkspaceParam) and p.fragments:
        _fragments_access(em, s, t, p, s.coords, store=True)
        return
    element = ELEMENT_TYPES[p.dtype]
    value = t.index() if t.packed and t.dtype == p.dtype else element.pack.format(t.read(0), t.read(1))

    def access(form: str, ok: str) -> str:
        if form in ("one", "linear"):
            one = t.index(0) if t.dtype == p.dtype else element.from_float.format(t.read(0))
            return f"if ({ok}) {'ptr[li]' if form == 'linear' else '*ptr'} = {one};"
        return f"wsp::store_{form}(ptr + 8 * fj, {ok}, {value});"

    # Row (column) tiles are replicated over the threads sharing columns (rows): one copy stores.
    owner = {ROW: f"threadIdx.x % {WARPGROUP_THREADS} < 4", COL: "threadIdx.x % 4 == 0",
             SCALAR: f"threadIdx.x % {WARPGROUP_THREADS} == 0",
             LINEAR_ROWS: f"threadIdx.x % {t.threads_per_row} == 0"}.get(t.layout)
    head = f"if ({owner}) {{" if owner else "{"
    addressing = _global_addressing(em, s, p, t, s.coords)
    limit = ""
    if s.row_limit is not None:
        # verifier _TileStoreGlobal: row_limit on a tensor of rank >= 2 (one with rows)
        assert addressing.row0 is not None, s
        text, prec, ctype = em.expr_prec(s.row_limit)
        if ctype != "int":
            raise EmitError(f"{describe(s)}: row_limit({em.expr(s.row_limit)}) is a float; a row limit is an "
                            f"integer row index")
        checks = addressing.checks[:1] + (f"row < {paren(text, prec, 12)}",) + addressing.checks[1:]
        addressing = replace(addressing, checks=checks)
        limit = f" row_limit({em.expr(s.row_limit)})"
    if _stores_by_quads(t, p) and em.role.role.warpgroups >= QUAD_STORE_WARPGROUPS:
        _quad_store(em, s, t, p, addressing, value, limit)
        return
    with em.block(f"{head}  // tile.store {p.name}[{em.coords_text(s.coords)}] <- {t.name}{limit}, "
                  "bounds-checked"):
        _global_loop(em, t, addressing, p, True, access)


# The 16-byte stores are emitted in roles of at least this many warpgroups. With one consumer
# warpgroup (the split-KV decode steps, which use all 255 registers a thread may have) ptxas laid
# out the whole kernel differently and its kv loop ran slower: B1 H32/32 T32768 195 -> 233 us,
# B1 H32/8 T1024 13.4 -> 15.1 (H100, cold L2, 2026-11-24), where two-warpgroup prefill gained.
QUAD_STORE_WARPGROUPS = 2


def _stores_by_quads(t: Tile, p: ir.GlobalParam) -> bool:
    """A [64, N] tile stored into 16-bit values with N a multiple of 32: each quad's pairs of
    four 8-column groups are transposed so that a lane holds 16 consecutive bytes of its row."""
    return t.layout == FULL and DTYPE_BYTES[p.dtype] == 2 and t.cols % 32 == 0


def _quad_store(em: Emitter, s: ir.TileStoreGlobal, t: Tile, p: ir.GlobalParam, a: _Addressing,
                value: str, limit: str) -> None:
    """`tile.store` with 16-byte stores (`wsp::quad_transpose`, include/global_access.cuh): per
    fragment row, the row's words are transposed within the quad (every lane, unconditionally:
    the shuffles), then one 16-byte store per 8 columns where the row is 16-byte aligned and its
    length a multiple of 8, else element by element, each bounds-checked. A warp's store then
    writes 64 bytes of each of its 8 rows, not 16: four times fewer store requests."""
    groups = t.cols // 32
    element = ELEMENT_TYPES[p.dtype]

    def word(k: int) -> str:   # the bits of the pair of 8-column group 4J + k at this fragment row
        pair = re.sub(r"\bfj\b", f"(4 * J + {k})", value)
        return f"wsp::bit_cast<uint32_t>({pair})"

    with em.block(f"{{  // tile.store {p.name}[{em.coords_text(s.coords)}] <- {t.name}{limit}, "
                  "bounds-checked, 16 bytes a lane (a quad's pairs transposed)"):
        em.line(f"const int row0 = {a.row0};")
        base_col = paren(*em.expr_prec(s.coords[-1])[:2], 12)   # the tile's first column (a.col0 less frag_col)
        em.line(f"const int col0 = {base_col} + 8 * (threadIdx.x % 4);   // this lane's chunk of each 4 groups")
        with fragment_loop(em, COL, 1):
            em.line("const int row = row0 + 8 * fi;")
            em.line(f"const bool row_ok = {' && '.join(a.checks) or 'true'};")
            em.line(f"{element.cuda}* const ptr = {em.c(p.name)} + {a.base};")
            em.line(f"uint4 chunk[{groups}];")
            em.line("#pragma unroll")
            em.line(f"for (int J = 0; J < {groups}; ++J) chunk[J] = wsp::quad_transpose("
                    f"{', '.join(word(k) for k in range(4))});")
            # (ptr is 16-byte aligned for every lane of the quad or for none: 8 values apart)
            em.line(f"if (wsp::rows16_aligned(ptr, {a.cols}) && col0 % 8 == 0) {{")
            em.line("#pragma unroll")
            em.line(f"  for (int J = 0; J < {groups}; ++J) "
                    f"wsp::store_eight(ptr + 32 * J, row_ok && col0 + 32 * J + 8 <= {a.cols}, chunk[J]);")
            em.line("} else {  // a row not 16-byte aligned, or of a length no multiple of 8")
            em.line("#pragma unroll")
            em.line(f"  for (int J = 0; J < {groups}; ++J) "
                    f"wsp::store_eight_split(ptr + 32 * J, row_ok, col0 + 32 * J, {a.cols}, chunk[J]);")
            em.line("}")


def _stmatrix_store(em: Emitter, s: ir.TileStoreSmem, t: Tile, ptr: str, rows: int, per_chunk: int,
                    value: str) -> None:
    """A [64, N] 16-bit tile into 128-byte-swizzled rows by `stmatrix .x4`: one instruction per
    warp stores a 16 x 16 block, four 8 x 8 matrices whose rows are the warp's fragment pairs
    (fi, fj), (1, fj), (0, fj + 1), (1, fj + 1) — a lane's pair at (fi, fj) is its element of
    that matrix — and lane l gives the address of row l % 8 of matrix l / 8 (16 bytes, one
    swizzle unit). A quarter of the shared-memory store instructions of one st.shared a pair;
    the same bytes (H100, same process: matmul outputs bit-identical, 0.99-1.02x the st.shared
    path's time over 8 shapes and the gated epilogue: the stores were not the bottleneck)."""
    with em.block(f"{{  // tile.store_smem {em.ref_text(s.dst)} <- {t.name}: stmatrix.x4, 16 x 16 a warp"):
        em.line(f"const uint32_t st_base = wsp::smem_u32({ptr}) + wsp::stmatrix_row() * 128;")
        em.line("const int st_half = wsp::stmatrix_half();")
        em.line("#pragma unroll")
        with em.block(f"for (int fj2 = 0; fj2 < {t.cols // 8}; fj2 += 2) {{"):
            em.line("uint32_t st_v[4];")
            em.line("#pragma unroll")
            with em.block("for (int st_m = 0; st_m < 4; ++st_m) {"):
                em.line("const int fi = st_m % 2, fj = fj2 + st_m / 2;")
                em.line(f"st_v[st_m] = wsp::bit_cast<uint32_t>({value});")
            em.line("const int st_j = fj2 + st_half;")
            em.line(f"wsp::stmatrix_x4_at(wsp::swizzle128(st_base + {rows * 128} * (st_j / {per_chunk}) + "
                    f"16 * (st_j % {per_chunk})), st_v[0], st_v[1], st_v[2], st_v[3]);")


def emit_tile_store_smem(em: Emitter, s: ir.TileStoreSmem) -> None:
    em.require_warpgroup(s)
    t = em.tile(s.src, s)
    ptr, decl, sub = em.smem_ref(s.dst)
    if t.layout != FULL:
        raise EmitError(f"{describe(s)}: only [64, N] tiles are stored to shared memory")
    rows, cols = ir.tile_shape_of_subarray(sub)
    assert (rows, cols) == (t.rows, t.cols), s  # verifier _TileStoreSmem: one shape
    b = DTYPE_BYTES[decl.dtype]
    value = t.index() if t.packed and t.dtype == decl.dtype else \
        ELEMENT_TYPES[decl.dtype].pack.format(t.read(0), t.read(1))
    bits = "uint32_t" if b == 2 else "uint2"
    if decl.swizzle == 128 and b == 2 and sub[-1] * b == 128 and t.cols % 16 == 0:
        _stmatrix_store(em, s, t, ptr, rows, sub[-1] // 8, value)
        return
    with em.block(f"{{  // tile.store_smem {em.ref_text(s.dst)} <- {t.name}: one st.shared per "
                  "pair"):
        # The pair (fj, fi) sits at row frag_row() + 8 fi, column frag_col() + 8 fj: in chunk
        # fj / (W/8) (R rows of 128 bytes), byte (frag_col() + 8 (fj % (W/8))) * b of its row.
        if decl.swizzle == 128 and b in (2, 4) and sub[-1] * b == 128:
            per_chunk = sub[-1] // 8
            em.line(f"const uint32_t row_addr = wsp::smem_u32({ptr}) + wsp::frag_row() * 128 + "
                    f"wsp::frag_col() * {b};")
            offset = f"1024 * fi + {rows * 128} * (fj / {per_chunk}) + {8 * b} * (fj % {per_chunk})"
            address = f"wsp::swizzle128(row_addr + {offset})"
        elif decl.swizzle == 0 and len(sub) == 2:
            em.line(f"const uint32_t row_addr = wsp::smem_u32({ptr}) + "
                    f"(wsp::frag_row() * {cols} + wsp::frag_col()) * {b};")
            address = f"row_addr + {8 * cols * b} * fi + {8 * b} * fj"
        else:
            raise EmitError(f"{describe(s)}: tile stores into swizzle({decl.swizzle}) "
                            f"{decl.dtype} buffers of shape {list(sub)} are not implemented "
                            "(128-byte-swizzled rows of 16/32-bit elements, or unswizzled 2-D)")
        with fragment_loop(em, FULL, t.cols):
            em.line(f"wsp::st_shared({address}, wsp::bit_cast<{bits}>({value}));")
