"""The loop IR: every node kind of a lowered wsched kernel, as frozen, typed dataclasses.

Structural equality (`==`) is the contract of the text form: `parse(print(k)) == k`.
Children are tuples, names are strings, expressions are `Expr` nodes; nothing is `Any`.

Execution model (the simulator, `simulate/`, is the reference semantics of every node,
and `codegen/emit.py` is its CUDA spelling):

* A `Kernel` runs on a grid of CTAs. Statements at kernel level (outside a `Role`) are run by
  the whole CTA; `mbarrier.init` and `fence.mbarrier_init` there are performed by thread 0.
* A `Role` is a set of `warpgroups` consecutive warpgroups (128 threads each) running the same
  body; roles are laid out in the order they appear. Inside a role, statements are
  *warpgroup-collective*: each warpgroup of the role runs the body once, with the builtin `wg`
  bound to its index within the role (0 .. warpgroups-1). One `mbarrier.arrive` by a
  warpgroup is ONE arrival (emitted from one thread after the warpgroup's own work).
* `elect_one { ... }` runs its body on one thread of the warpgroup (its first warp); the other
  threads skip it. The producer's whole loop nest sits inside one.
* Register tiles (`reg acc: f32[64, 256]`) are per warpgroup.
* Shared memory buffers have a leading stage dimension; a `SmemRef` selects a sub-array by
  leading indices (`A[s]`, `C[wg, j]`); the remaining trailing dims are the sub-tile.
  A sub-array of shape (chunks, R, W) holds an [R, chunks*W] tile as column chunks of width W
  (that is how 128-byte-swizzled tiles wider than 64 bf16 are stored).
* Builtin names, usable in any expression without a declaration: `cta_id` (blockIdx.x),
  `num_ctas` (gridDim.x; a multiple of the cluster size), `num_sms` (multiprocessors of the device, host side: the grid and host params only),
  and `wg` (inside a role).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterator, Union

# Element types and tile ops are target facts (wsched/target.py); the IR re-exports them as
# `ir.DTYPES`, `ir.DTYPE_BYTES`, `ir.UNARY_OPS`, `ir.BINARY_OPS`, `ir.COMPARE_OPS` and
# `ir.REDUCE_OPS`. A `TileBinary` op is one of BINARY_OPS or COMPARE_OPS (`TILE_BINARY_OPS`), a
# `TileUnary` op one of UNARY_OPS or the compiler's own KERNEL_UNARY_OPS (`TILE_UNARY_OPS`).
from wsched.target import BINARY_OPS, COMPARE_OPS, DTYPE_BYTES, REDUCE_OPS, TILE_UNARY_OPS, UNARY_OPS  # noqa: F401
from wsched.target import DTYPE_NAMES as DTYPES  # noqa: F401
from wsched.target import (BARRIER_BYTES, FRAGMENT_COLUMN_GROUP, PAGE_ROWS_ALIGN, SMEM_ALIGN, SMEM_BASE_SLACK,
                           TMA_SMEM_ALIGNMENT, WARPGROUP_THREADS, WGMMA_M)

BUILTINS = ("cta_id", "num_ctas", "num_sms", "wg")
TILE_BINARY_OPS = BINARY_OPS + COMPARE_OPS

# ---------------------------------------------------------------------------------------------
# Expressions
# ---------------------------------------------------------------------------------------------

# Binary operators, loosest-binding first (the printer and grammar agree on this table).
# Integers are the CUDA's 32-bit `int`: "/" and "%" truncate toward zero (C semantics), and an
# overflow is an error (signed overflow is undefined on the GPU); on floats "/" is fp32 division.
# lowering/evaluate.py is the one definition.
BINARY_PRECEDENCE: dict[str, int] = {
    "||": 1,
    "&&": 2,
    "==": 3, "!=": 3, "<": 3, "<=": 3, ">": 3, ">=": 3,
    "|": 4, "^": 5, "&": 6,
    "<<": 7, ">>": 7,
    "+": 8, "-": 8,
    "*": 9, "/": 9, "%": 9,
}
CALLS = {"min": 2, "max": 2, "ceil_div": 2, "bit_length": 1, "select": 3}
# Operators and calls defined on integers only (evaluate.py; the emitter has no float spelling)
INTEGER_ONLY = frozenset({"%", "&", "|", "^", "<<", ">>", "ceil_div", "bit_length"})


@dataclass(frozen=True)
class IntConst:
    value: int


@dataclass(frozen=True)
class FloatConst:
    value: float


@dataclass(frozen=True)
class Var:
    name: str


@dataclass(frozen=True)
class BinOp:
    op: str
    lhs: "Expr"
    rhs: "Expr"


@dataclass(frozen=True)
class Call:
    """A builtin function: min(a, b), max(a, b), ceil_div(a, b), bit_length(x) (the number of
    bits of a non-negative int: 0 for 0, 3 for 5), select(cond, a, b)."""

    func: str
    args: tuple["Expr", ...]


Expr = Union[IntConst, FloatConst, Var, BinOp, Call]


def const(v: int | float) -> Expr:
    return FloatConst(float(v)) if isinstance(v, float) else IntConst(int(v))


def as_expr(v: "Expr | int | float | str") -> Expr:
    if isinstance(v, (IntConst, FloatConst, Var, BinOp, Call)):
        return v
    if isinstance(v, str):
        return Var(v)
    return const(v)


def add(a, b) -> Expr:
    return BinOp("+", as_expr(a), as_expr(b))


def sub(a, b) -> Expr:
    return BinOp("-", as_expr(a), as_expr(b))


def mul(a, b) -> Expr:
    return BinOp("*", as_expr(a), as_expr(b))


def div(a, b) -> Expr:
    return BinOp("/", as_expr(a), as_expr(b))


def mod(a, b) -> Expr:
    return BinOp("%", as_expr(a), as_expr(b))


def band(a, b) -> Expr:
    return BinOp("&", as_expr(a), as_expr(b))


def eq(a, b) -> Expr:
    return BinOp("==", as_expr(a), as_expr(b))


def lt(a, b) -> Expr:
    return BinOp("<", as_expr(a), as_expr(b))


def ceil_div(a, b) -> Expr:
    return Call("ceil_div", (as_expr(a), as_expr(b)))


def bit_length(x) -> Expr:
    return Call("bit_length", (as_expr(x),))


def emin(a, b) -> Expr:
    return Call("min", (as_expr(a), as_expr(b)))


def emax(a, b) -> Expr:
    return Call("max", (as_expr(a), as_expr(b)))


def expr_vars(e: Expr) -> Iterator[str]:
    """Names read by an expression, in order."""
    if isinstance(e, Var):
        yield e.name
    elif isinstance(e, BinOp):
        yield from expr_vars(e.lhs)
        yield from expr_vars(e.rhs)
    elif isinstance(e, Call):
        for a in e.args:
            yield from expr_vars(a)


# ---------------------------------------------------------------------------------------------
# Kernel-level declarations
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ScalarParam:
    """`i32 M` / `f32 scale`: a scalar kernel argument."""

    name: str
    dtype: str


@dataclass(frozen=True)
class TensorMapParam:
    """`tensormap a: bf16[M, K] box(128, 64) swizzle(128)`: a global tensor reached through a
    TMA tensor map (passed as `const __grid_constant__ CUtensorMap`). Shape and box are
    outermost first; the box is the extent one `tma.load`/`tma.store` moves."""

    name: str
    dtype: str
    shape: tuple[Expr, ...]
    box: tuple[int, ...]
    swizzle: int


@dataclass(frozen=True)
class GlobalParam:
    """`global bias: bf16[N]`: a row-major global tensor read or written with plain loads and
    stores (bias vectors, residuals, direct epilogue stores)."""

    name: str
    dtype: str
    shape: tuple[Expr, ...]


# --- parameters the host fills in itself (split-K) -------------------------------------------


@dataclass(frozen=True)
class HostParam(ScalarParam):
    """`i32 splits = min(8, ceil_div(num_sms, tiles))`: a scalar argument the host computes per
    call from the sizes (the scalar params) and `num_sms`, as it computes the grid; the kernel
    reads it like any scalar param. The value may read scalar params declared before it."""

    value: "Expr"


@dataclass(frozen=True)
class WorkspaceParam(GlobalParam):
    """`workspace partials: f32[splits, M, N]` / `workspace tickets: i32[T] zeroed`: a global
    scratch tensor that belongs to no fusion input or output. The host allocates it once per
    kernel and device, large enough for the call (its shape, evaluated like the grid), and keeps
    it between calls; `zeroed` ones are zero-filled when allocated, and the kernel must leave
    them zero again (split-K's tickets wrap back to 0).

    `fragments` (`workspace partials: f32[splits, M, N] fragments`, 4-byte elements, rank >= 2):
    each [rows, cols] matrix is stored in strips of [WGMMA_M, FRAGMENT_COLUMN_GROUP] (rows and
    columns padded up to whole strips), strip (r / 64, c / 8) after the strips of the rows
    above and to the left, and inside a strip in the order of the register-tile fragment: the
    element of thread t at fragment position (i, c) (fragment.py) at 4 t + 2 i + c. A warpgroup
    moves a [64, N] tile there with one 16-byte access per thread and strip, each warp's 512
    contiguous bytes (a row-major [64, N] f32 tile takes two 8-byte accesses per 16 bytes, a
    warp's spread over 8 rows). What is read and written is the same as for the row-major
    tensor of that shape: the layout only places it."""

    zeroed: bool = False
    fragments: bool = False

    def storage_dims(self, dims: list[int]) -> list[int]:
        """The extents the host allocates for these evaluated shape `dims`: the shape, with a
        fragments workspace's rows and columns padded up to whole strips."""
        if not self.fragments:
            return list(dims)
        rows, cols = dims[-2:]
        return list(dims[:-2]) + [-(-rows // WGMMA_M) * WGMMA_M,
                                  -(-cols // FRAGMENT_COLUMN_GROUP) * FRAGMENT_COLUMN_GROUP]


@dataclass(frozen=True)
class SpanParam(GlobalParam):
    """`spans doc_spans: i32[batch0, 1, ceil_div(S, 128), 4] = overlap(doc_q, doc_k) rows(128) cols(128)`:
    a table the host computes per call from two i32 global inputs, `query` ([..., S, 1]: an id
    per query row) and `key` ([..., 1, T]: an id per key), broadcast over their leading (batch)
    dims. For each batch index and each block of `rows` query rows (the last one may be
    shorter): [..., r, 0] the first and [..., r, 1] the count of the blocks of `cols` keys
    whose ids' range [min, max] meets the range of the row block's ids (outside them no key's
    id equals a row's: a document mask hides them; count 0: no block); [..., r, 2] the first
    and [..., r, 3] the count of the key blocks that hold only the one id all the block's rows
    have (a document mask hides nothing there), where those blocks are one run, else count 0.
    `lowering/block_spans.py` defines it; the simulator computes it there, the host on the GPU
    (codegen/block_spans.py)."""

    query: str = ""
    key: str = ""
    rows: int = 1
    cols: int = 1


# A subclass first: the type check takes the first class of a Union that a value is an instance of.
Param = Union[HostParam, ScalarParam, TensorMapParam, WorkspaceParam, SpanParam, GlobalParam]


@dataclass(frozen=True)
class SmemDecl:
    """`smem A: bf16[4, 2, 64, 64] swizzle(128)`: a shared-memory buffer; dim 0 is the stage."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    swizzle: int

    @property
    def nbytes(self) -> int:
        n = DTYPE_BYTES[self.dtype]
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class BarrierDecl:
    """`barrier full[4]`: an array of mbarriers in shared memory (8 bytes each)."""

    name: str
    slots: int


# ---------------------------------------------------------------------------------------------
# References
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SmemRef:
    """`A[s]`, `C[wg, j]`: the sub-array of a shared buffer selected by leading indices."""

    buffer: str
    index: tuple[Expr, ...]


@dataclass(frozen=True)
class BarRef:
    """`full[s]`: one mbarrier of a barrier array."""

    barrier: str
    index: Expr


# ---------------------------------------------------------------------------------------------
# Statements
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Let:
    """`let x = e` (immutable) or `var x = e` (mutable, updated with `set`)."""

    name: str
    value: Expr
    mutable: bool = False


@dataclass(frozen=True)
class Assign:
    """`set x = e`: update a `var`."""

    name: str
    value: Expr


@dataclass(frozen=True)
class For:
    """`for k in serial(0, k_tiles, 1) { ... }`. iteration: serial | persistent | unroll | dynamic.
    `persistent` marks the tile loop a CTA strides through (start cta_id, step num_ctas).
    `dynamic` is a tile loop whose next tile is not known in advance: `for tile in
    dynamic(cta_id, num_tiles, tile_next)` runs while tile < stop, and after each iteration sets
    tile to the value of `step` (a `var` the body sets: the tile taken from a counter)."""

    var: str
    start: Expr
    stop: Expr
    step: Expr
    iteration: str
    body: tuple["Stmt", ...]


@dataclass(frozen=True)
class If:
    cond: Expr
    then: tuple["Stmt", ...]
    orelse: tuple["Stmt", ...] = ()


@dataclass(frozen=True)
class Role:
    """`role consumer warpgroups(2) registers(232) { ... }`: warp-specialized branch.
    `registers` is the per-thread budget the role runs with (after its setmaxnreg)."""

    name: str
    warpgroups: int
    registers: int
    body: tuple["Stmt", ...]


@dataclass(frozen=True)
class ElectOne:
    """`elect_one { ... }`: one thread of the warpgroup runs the body."""

    body: tuple["Stmt", ...]


@dataclass(frozen=True)
class Return:
    """`return`: the executing threads leave the kernel."""


@dataclass(frozen=True)
class Setmaxnreg:
    """`setmaxnreg.inc 232` / `setmaxnreg.dec 40`."""

    action: str  # "inc" | "dec"
    registers: int


# --- synchronisation ---------------------------------------------------------------------------


@dataclass(frozen=True)
class MbarrierInit:
    """`mbarrier.init full arrivals(1)`: every slot of the array, by thread 0."""

    barrier: str
    arrivals: int


@dataclass(frozen=True)
class MbarrierArrive:
    """`mbarrier.arrive empty[s]`: one arrival (consumer_release).

    With `cta` (`mbarrier.arrive empty[s] cta(r)`, a kernel with a cluster of more than one CTA)
    the arrival lands on the barrier of the same name and index in the CTA of rank `r` of this
    CTA's cluster (0 .. cluster size - 1; this CTA's own rank is `cta_id % cluster size`): how a
    consumer frees a stage that a peer's producer multicasts into."""

    bar: BarRef
    cta: Union[Expr, None] = None


@dataclass(frozen=True)
class MbarrierArriveExpectTx:
    """`mbarrier.arrive_expect_tx full[s] bytes(49152)`: one arrival plus the number of bytes
    the TMA copies into this phase will deliver (producer_acquire's commit half)."""

    bar: BarRef
    bytes: Expr


@dataclass(frozen=True)
class MbarrierWait:
    """`mbarrier.wait full[s] phase(p)`: block until the phase with parity p has completed."""

    bar: BarRef
    phase: Expr


@dataclass(frozen=True)
class MbarrierInval:
    """`mbarrier.inval full`: every slot of the array."""

    barrier: str


@dataclass(frozen=True)
class FenceMbarrierInit:
    """`fence.mbarrier_init`: make barrier inits visible (before the CTA barrier)."""


@dataclass(frozen=True)
class FenceProxyAsync:
    """`fence.proxy.async`: order generic-proxy smem writes before async-proxy (TMA, wgmma)
    reads."""


@dataclass(frozen=True)
class SyncThreads:
    """`syncthreads`: whole-CTA barrier; never inside a role."""


@dataclass(frozen=True)
class ClusterSync:
    """`cluster.sync`: barrier over every thread of every CTA of the cluster (release / acquire at
    cluster scope); never inside a role. After `fence.mbarrier_init` it makes this CTA's barriers
    visible to its peers before any of them arrives on one or multicasts into its smem."""


@dataclass(frozen=True)
class NamedBarrierSync:
    """`bar.sync 1 + wg, 128`: named barrier `id` (>= 1, < 16) over `threads` threads."""

    id: Expr
    threads: int


@dataclass(frozen=True)
class NamedBarrierArrive:
    """`bar.arrive 1, 128`."""

    id: Expr
    threads: int


# --- asynchronous copies ------------------------------------------------------------------------


@dataclass(frozen=True)
class TmaLoad:
    """`tma.load A[s] <- a[m0, k0] bar(full[s])`: one box of tensor map `tensor` at element
    coordinates `coords` (outermost first) into the smem sub-array `dst`; completes on `bar`
    with the box's bytes. Elements outside the tensor are filled with zero.

    With `row` (`tma.load K[s, 1] row(r * 16) <- k_cache[page, 0, h, 64] bar(full[s])`), `dst`
    is a 2-D [R, W] sub-array and the box fills only its rows row .. row + rows - 1, where the
    box's inner extent is W and rows is the product of its other extents (a box lies in smem in
    row-major order): how one block of keys is gathered from the pages of a paged cache. `row`
    must keep the destination on the alignment `tma_row_step` gives (with a swizzle, its atom).

    With `multicast` (`... bar(full[s]) multicast(3)`, a kernel with a cluster of more than one
    CTA) the box is written to the same smem address in every CTA of the cluster whose rank's bit
    is set in the mask, and completes on each one's barrier of the same name and index with the
    box's bytes; the issuing CTA's own bit may be clear."""

    dst: SmemRef
    tensor: str
    coords: tuple[Expr, ...]
    bar: BarRef
    row: Union[Expr, None] = None
    multicast: Union[Expr, None] = None


@dataclass(frozen=True)
class TmaStore:
    """`tma.store c[m0, n0] <- C[wg, j]`: one box from smem to global; out-of-bounds elements
    are dropped. Completion is tracked by bulk groups (`tma.commit`, `tma.wait`)."""

    tensor: str
    coords: tuple[Expr, ...]
    src: SmemRef


@dataclass(frozen=True)
class TmaCommit:
    """`tma.commit`: close the current bulk group of stores."""


@dataclass(frozen=True)
class TmaWait:
    """`tma.wait 0` / `tma.wait.read 0`: at most n bulk groups still pending (`read`: only
    their smem reads need to be done)."""

    pending: int
    read: bool


# --- wgmma ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WgmmaFence:
    """`wgmma.fence`: order register accesses before the next wgmma."""


@dataclass(frozen=True)
class Wgmma:
    """`wgmma.mma acc, A[s, wg], B[s] major(k, k) accumulate(1)`:
    acc[64, N] = (accumulate ? acc : 0) + A[64, K] @ B[K, N], asynchronously.

    `a` is a smem sub-array [64, K] (a_major "k": K contiguous) or a register tile name;
    `b` is a smem sub-array holding B either K-major as [N, K] (b_major "k") or N-major as
    column chunks (N/64, K, 64) (b_major "n"). The result (and the end of the smem reads) is
    guaranteed only after a `wgmma.wait` that covers the commit group this mma belongs to."""

    acc: str
    a: Union[SmemRef, str]
    b: SmemRef
    a_major: str
    b_major: str
    accumulate: Expr


@dataclass(frozen=True)
class WgmmaCommit:
    """`wgmma.commit`: close the current wgmma group."""


@dataclass(frozen=True)
class WgmmaWait:
    """`wgmma.wait 0`: at most `pending` wgmma groups still in flight."""

    pending: int


# --- register tiles -------------------------------------------------------------------------------
# Tile ops compute in fp32 and round the result to the destination tile's dtype; operands of
# another dtype are read as their (exactly representable) fp32 values.

LOOP_KINDS = ("serial", "persistent", "unroll", "dynamic")
SETMAXNREG_ACTIONS = ("inc", "dec")
MMA_MAJORS = ("k", "n")
REG_LAYOUTS = ("fragment", "linear")


@dataclass(frozen=True)
class RegDecl:
    """`reg acc: f32[64, 256]`: a register tile of the warpgroup, in the wgmma fragment layout.
    `reg o: f32[4, 128] linear`: a tile whose rows lie one after another over the warpgroup's
    threads, each thread holding R C / 128 consecutive elements of one row (R rows, R dividing 128);
    a linear [R, 1] tile holds each row's value in every thread of that row (docs/ir.md, "Linear
    tiles")."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    layout: str = "fragment"     # one of REG_LAYOUTS


@dataclass(frozen=True)
class TileFill:
    """`tile.fill acc, 0.0`."""

    dst: str
    value: Expr


@dataclass(frozen=True)
class TileUnary:
    """`tile.gelu y, x`; `tile.cast y, x` converts to y's dtype (round to nearest even)."""

    op: str
    dst: str
    src: str


@dataclass(frozen=True)
class TileBinary:
    """`tile.add y, x, bias_t`: operands are tile names or scalar expressions; a tile of extent
    1 in a dim broadcasts along it. A comparison (`tile.le m, j_t, i_t`, one of COMPARE_OPS)
    gives 1.0 where it holds and 0.0 elsewhere; `logical_and` / `logical_or` read an operand
    as true where it is not 0."""

    op: str
    dst: str
    lhs: Union[str, Expr]
    rhs: Union[str, Expr]


@dataclass(frozen=True)
class TileReduce:
    """`tile.reduce.max m, s, axis(1)`: dst keeps extent 1 in the reduced axis."""

    op: str
    dst: str
    src: str
    axis: int


@dataclass(frozen=True)
class TileMask:
    """`tile.mask s, rows(r0), cols(c0), limit(T) causal(d) period(S) lower(e)`: element (r, c) of
    the full tile becomes -inf where c0 + c >= limit (beyond the keys), or, when `causal` is
    given, where c0 + c > i + causal (above the causal diagonal, shifted by `causal`), or, when
    `lower` is given, where c0 + c < i + lower (before a lower diagonal: a sliding window's far
    edge), with i = r0 + r the element's query position, or (r0 + r) mod period where a `period`
    is given (GQA-packed rows: the queries of several heads one after another)."""

    dst: str
    row0: Expr
    col0: Expr
    limit: Expr
    causal: Union[Expr, None] = None
    period: Union[Expr, None] = None
    lower: Union[Expr, None] = None


@dataclass(frozen=True)
class TileLoadGlobal:
    """`tile.load bias_t <- bias[n0]`: read the region of a `global` tensor whose first element
    is at `coords` (one per tensor dim). The tile covers the tensor's trailing dims (a [64, 128]
    tile of a [B, H, S, 128] tensor is one (b, h) slice; tile dims beyond the tensor's rank must
    be 1); elements outside the tensor read as zero."""

    dst: str
    tensor: str
    coords: tuple[Expr, ...]


@dataclass(frozen=True)
class TileStoreGlobal:
    """`tile.store c[m0, n0] <- y row_limit(L)`: plain stores of a tile, each value rounded to the
    tensor's dtype (round to nearest even); elements outside are dropped. With `row_limit`
    (tensors of rank >= 2), tile row r, at tensor row coords[-2] + r, is stored only where that
    row is below L: a tile of one sequence of a packed [total_rows, ...] tensor stops at the
    sequence's end (L <= coords[-2] stores nothing)."""

    tensor: str
    coords: tuple[Expr, ...]
    src: str
    row_limit: Union[Expr, None] = None


@dataclass(frozen=True)
class TileStoreSmem:
    """`tile.store_smem C[wg] <- y`: write a tile into a smem sub-array, each value rounded to
    the buffer's dtype (generic proxy: a `fence.proxy.async` must precede any TMA/wgmma read of
    it)."""

    dst: SmemRef
    src: str


# --- sliced epilogues and split-K (matmul) ----------------------------------------------------


@dataclass(frozen=True)
class TileView:
    """`tile.view acc_j, acc, cols(j * 64, 64)`: declare `name` as the [rows, cols] register tile
    made of columns col0 .. col0 + cols - 1 of the 2-D tile `src` (an alias, not a copy: what is
    written through one is read through the other). col0 is a multiple of 8 (a column group of
    the fragment layout) and the columns lie inside src; col0 reads only constants and the
    variables of enclosing `unroll` loops, so that every register index is a compile-time
    constant. An epilogue walks a wide accumulator in such slices, so the tiles it loads beside
    it are one slice wide."""

    name: str
    src: str
    col0: Expr
    cols: int


@dataclass(frozen=True)
class FenceGpu:
    """`fence.acq_rel.gpu`: the executing thread's memory accesses before it are ordered before
    its accesses after it, at GPU scope. Before an atomic it releases what this thread wrote (and
    what its warpgroup wrote before a barrier the thread took part in); after an atomic that read
    another CTA's release it acquires what that CTA wrote."""


@dataclass(frozen=True)
class AtomicInc:
    """`atomic.inc T[wg] <- tickets[t] wrap(splits - 1)`: one thread (inside elect_one) atomically
    replaces the i32 element of a `workspace` / `global` tensor at `coords` with
    (old >= wrap ? 0 : old + 1) and writes `old` into the i32 smem element `dst` (a generic-proxy
    write). The atomic itself is relaxed: a `fence.acq_rel.gpu` before it releases and one after
    it acquires."""

    dst: SmemRef
    tensor: str
    coords: tuple[Expr, ...]
    wrap: Expr


@dataclass(frozen=True)
class LoadShared:
    """`ld.shared ticket = T[wg]`: every running thread (the warpgroup's; inside elect_one the
    elected one) reads the i32 smem element `src` and binds it to the immutable scalar `name` (how
    one thread's result reaches its warpgroup: that thread writes the element, a barrier of the
    warpgroup, then this; or the elected thread reads what it wrote itself)."""

    name: str
    src: SmemRef


# --- paged KV caches ----------------------------------------------------------------------------


@dataclass(frozen=True)
class LoadGlobal:
    """`ld.global page = block_table[b, k]`: the executing threads (inside `elect_one` the elected
    one, in a role every thread of the warpgroup) read the element at `coords` (one per dim,
    outermost first) of an i32 `global` param that is a kernel input (not a workspace), and bind
    it to the immutable scalar `name`, like a `let`: a page of a paged cache, or a sequence's
    length. The element must lie inside the tensor."""

    name: str
    tensor: str
    coords: tuple[Expr, ...]


# --- attention score functions: positions and selection (elementwise, like TileBinary) ----------


@dataclass(frozen=True)
class TileIota:
    """`tile.iota j_t, axis(1), start(k * 128)`: element (r, c) of the 2-D tile becomes its
    position along `axis` plus `start` (start + r for axis 0, start + c for axis 1), as a value of
    the tile's dtype: the query and key index of every score of an attention block."""

    dst: str
    axis: int
    start: Expr


@dataclass(frozen=True)
class TileSelect:
    """`tile.select s, mask_t, s, scalar(-inf)`: dst = on_true where cond is not 0, else
    on_false; operands are tile names or scalar expressions, a tile of extent 1 in a dim
    broadcasts along it."""

    dst: str
    cond: Union[str, Expr]
    on_true: Union[str, Expr]
    on_false: Union[str, Expr]


Stmt = Union[
    Let, Assign, For, If, Role, ElectOne, Return, Setmaxnreg,
    MbarrierInit, MbarrierArrive, MbarrierArriveExpectTx, MbarrierWait, MbarrierInval,
    FenceMbarrierInit, FenceProxyAsync, SyncThreads, NamedBarrierSync, NamedBarrierArrive,
    TmaLoad, TmaStore, TmaCommit, TmaWait,
    WgmmaFence, Wgmma, WgmmaCommit, WgmmaWait,
    RegDecl, TileFill, TileUnary, TileBinary, TileReduce, TileMask, TileLoadGlobal, TileStoreGlobal,
    TileStoreSmem,
    TileView, FenceGpu, AtomicInc, LoadShared,   # sliced epilogues and split-K
    TileIota, TileSelect,                         # attention score functions
    LoadGlobal,                                   # paged KV caches
    ClusterSync,                                  # clusters with TMA multicast
]

STMT_TYPES: tuple[type, ...] = Stmt.__args__  # type: ignore[attr-defined]

# Statements every thread of a warpgroup executes together: never inside `elect_one`.
WARPGROUP_COLLECTIVE: tuple[type, ...] = (
    Role, Setmaxnreg, SyncThreads, ClusterSync, NamedBarrierSync, NamedBarrierArrive,
    WgmmaFence, Wgmma, WgmmaCommit, WgmmaWait,
    RegDecl, TileFill, TileUnary, TileBinary, TileReduce, TileMask, TileLoadGlobal, TileStoreGlobal,
    TileStoreSmem,
    TileView,
    TileIota, TileSelect,
)


@dataclass(frozen=True)
class Kernel:
    """A whole kernel: parameters, launch shape, shared memory, barriers and the body."""

    name: str
    params: tuple[Param, ...]
    grid: Expr
    cluster: tuple[int, int, int]
    smem: tuple[SmemDecl, ...]
    barriers: tuple[BarrierDecl, ...]
    body: tuple[Stmt, ...]
    ir_after: dict = field(default_factory=dict, compare=False, hash=False, repr=False)

    def __str__(self) -> str:
        from .printer import print_kernel  # the printer depends on this module, not the reverse

        return print_kernel(self)

    # -- derived facts -----------------------------------------------------------------------
    def roles(self) -> list[Role]:
        return [s for s in walk(self.body) if isinstance(s, Role)]

    @property
    def threads(self) -> int:
        return WARPGROUP_THREADS * sum(r.warpgroups for r in self.roles()) or WARPGROUP_THREADS

    @property
    def smem_bytes(self) -> int:
        """Dynamic shared memory: buffers laid out in order, each SMEM_ALIGN-aligned (128B
        swizzle needs it), then the barriers."""
        offset = 0
        for buf in self.smem:
            offset = _align(offset, SMEM_ALIGN) + buf.nbytes
        offset = _align(offset, BARRIER_BYTES) + BARRIER_BYTES * sum(b.slots for b in self.barriers)
        return _align(offset, SMEM_ALIGN) + SMEM_BASE_SLACK  # to align the dynamic smem base itself

    def param(self, name: str) -> Param:
        for p in self.params:
            if p.name == name:
                return p
        raise KeyError(name)

    def smem_decl(self, name: str) -> SmemDecl:
        for s in self.smem:
            if s.name == name:
                return s
        raise KeyError(name)


def _align(x: int, a: int) -> int:
    return (x + a - 1) // a * a


def child_blocks(s: Stmt) -> tuple[tuple[Stmt, ...], ...]:
    """The statement lists nested directly in `s`."""
    if isinstance(s, (For, Role, ElectOne)):
        return (s.body,)
    if isinstance(s, If):
        return (s.then, s.orelse)
    return ()


def walk(stmts: tuple[Stmt, ...]) -> Iterator[Stmt]:
    """Every statement, pre-order."""
    for s in stmts:
        yield s
        for block in child_blocks(s):
            yield from walk(block)


def smem_subshape(decl: SmemDecl, ref: SmemRef) -> tuple[int, ...]:
    """Shape of the sub-array a reference selects."""
    return decl.shape[len(ref.index):]


def tma_row_step(decl: SmemDecl) -> tuple[int, int]:
    """(bytes, rows): the alignment a `tma.load ... row(r)` destination needs in buffer `decl`,
    and the rows `r` must be a multiple of to keep it. TMA writes shared memory from an address
    aligned to TMA_SMEM_ALIGNMENT, and a swizzled box to one aligned to the swizzle's atom
    (PAGE_ROWS_ALIGN rows of the swizzle span), since the pattern is taken from the address bits:
    only there do the box's rows land as the rows of the whole sub-array would."""
    align = max(TMA_SMEM_ALIGNMENT, PAGE_ROWS_ALIGN * decl.swizzle)
    row_bytes = decl.shape[-1] * DTYPE_BYTES[decl.dtype]
    return align, align // math.gcd(align, row_bytes)


def tile_shape_of_subarray(shape: tuple[int, ...]) -> tuple[int, int]:
    """The [rows, cols] tile a smem sub-array holds: (R, C) as is, (chunks, R, W) as column
    chunks of width W."""
    if len(shape) == 2:
        return shape[0], shape[1]
    if len(shape) == 3:
        return shape[1], shape[0] * shape[2]
    raise ValueError(f"a smem sub-array of shape {list(shape)} does not hold a 2-D tile")


def cluster_operand_problem(clause: str, value: int, size: int) -> "str | None":
    """What is wrong with the value of a `cta(r)` rank or a `multicast(mask)` in a cluster of
    `size` CTAs (None if nothing): the verifier's check of a constant and the simulator's of a
    value at run time."""
    if clause == "multicast" and not 1 <= value < 1 << size:
        return (f"multicast({value}): the mask has one bit per CTA rank; with {size} CTAs in the cluster it is in "
                f"[1, {(1 << size) - 1}]")
    if clause == "cta" and not 0 <= value < size:
        return f"cta({value}): the rank of a CTA in a cluster of {size} is in [0, {size - 1}]"
    return None
