"""The CUDA spelling of the final loop IR: one `.cu` per kernel, one emit function per node kind.

    emitted = emit_kernel(kernel)       # EmittedKernel(source, name, threads, smem_bytes, params)
    compile_cuda(emitted.source, name=emitted.name)

The generated file reads like a hand-written warp-specialized kernel (ThunderKittens' lcf
skeleton): a header comment with the kernel's launch facts, the wgmma wrappers and small
helpers it uses, then the kernel with a `// setup` section (shared-memory carve-up, kernel-level
lets, barrier init) and one branch per role (`// role producer`, `// role consumer`) of a single
if/else on the warpgroup index, which is what setmaxnreg needs. Every statement comes from an IR
node; nothing is specialised per workload.

Execution-model mapping (see `lowering/ir.py`):

* kernel level: all threads; `mbarrier.init` / `fence.mbarrier_init` by thread 0 only.
* inside a role: warpgroup-collective. One `mbarrier.arrive` (or `arrive_expect_tx`) is ONE
  arrival per warpgroup, made by the warpgroup's first thread; `mbarrier.wait` by every thread.
* `elect_one`: one thread of the warpgroup's first warp; TMA issue, commit and wait must be
  inside one (bulk async-groups belong to the issuing thread).
* register tiles use the wgmma accumulator fragment layout: thread t of the warpgroup
  (warp w = t / 32, lane l, g = l / 4, q = l % 4) holds element d[4j + 2i + c] of a [64, N]
  tile at row 16w + g + 8i, column 8j + 2q + c. f32 tiles are `float[N/2]`; 16-bit tiles are
  packed pairs (the c = 0, 1 elements) `__nv_bfloat162[N/4]` / `__half2[N/4]`. A row tile
  [1, N] holds columns 8j + 2q + c (pairs when 16-bit), a column tile [64, 1] rows g + 8i.

Spellings chosen so that ptxas keeps a 128x256 consumer (128 accumulator registers plus a
64-register bf16 output tile) inside its setmaxnreg budget without spilling:

* consecutive elementwise tile ops over one fragment space share one unrolled loop;
* 128B-swizzled smem stores xor the shared address per store (`wsk::swizzle128`) instead of
  precomputing swizzled offsets (ptxas hoisted 64 of them out of the tile loop and spilled);
* global tile loads/stores take one 64-bit row pointer plus constant column offsets, use
  predicated ld/st (no branch per element) and choose pair vs element accesses once per row;
* 16-bit values move as raw bits (cuda_bf16.h's conversion asm would go through local memory).
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator, Union

from wsched.lowering import ir

from .wgmma import VALID_N, wgmma_function

__all__ = ["EmitError", "EmittedKernel", "emit_kernel", "EMITTERS"]


class EmitError(ValueError):
    """The IR cannot be spelled in CUDA as it stands (names the statement and what is wrong)."""


@dataclass(frozen=True)
class EmittedKernel:
    source: str
    name: str
    threads: int
    smem_bytes: int
    params: tuple


# ---------------------------------------------------------------------------------------------
# C++ spellings of IR types and names
# ---------------------------------------------------------------------------------------------

_CTYPE = {"bf16": "__nv_bfloat16", "f16": "__half", "f32": "float", "i32": "int"}
_CPAIR = {"bf16": "__nv_bfloat162", "f16": "__half2", "f32": "float2"}
_TO_FLOAT = {"bf16": "__bfloat162float({})", "f16": "__half2float({})", "f32": "{}"}
_FROM_FLOAT = {"bf16": "__float2bfloat16_rn({})", "f16": "__float2half_rn({})", "f32": "{}"}
_PACK = {"bf16": "__floats2bfloat162_rn({}, {})", "f16": "__floats2half2_rn({}, {})",
         "f32": "make_float2({}, {})"}

# C++ names an IR name must not take: the emitter's own locals and helpers, CUDA builtins and
# C++ keywords. An IR name that would is spelled with a trailing underscore (`_cpp_names`).
_RESERVED = frozenset("""
    smem wsp_smem_raw wg_index fi fj fr row col row0 col0 row_ok row_addr v ptr i
    desc_a desc_b ceil_div min max fminf fmaxf expf exp2f logf tanhf erff make_float2 memcpy
    wsp wsk threadIdx blockIdx gridDim blockDim warpSize INFINITY NAN uint8_t uint16_t uint32_t
    uint64_t uintptr_t float2 uint2 CUtensorMap
    alignas alignof and asm auto bool break case catch char class const constexpr continue
    default delete do double else enum explicit extern false float for friend goto if inline
    int long namespace new not operator or private protected public register return short
    signed sizeof static struct switch template this throw true try typedef typename union
    unsigned using virtual void volatile while xor
""".split())


# ---------------------------------------------------------------------------------------------
# Expressions
# ---------------------------------------------------------------------------------------------

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


class _Scope:
    """Declared names and their C++ scalar type ("int" or "float"), innermost scope last."""

    def __init__(self):
        self.frames: list[dict[str, str]] = [{}]

    def declare(self, name: str, ctype: str) -> None:
        self.frames[-1][name] = ctype

    def lookup(self, name: str) -> str | None:
        for frame in reversed(self.frames):
            if name in frame:
                return frame[name]
        return None

    @contextmanager
    def nested(self) -> Iterator[None]:
        self.frames.append({})
        try:
            yield
        finally:
            self.frames.pop()


# ---------------------------------------------------------------------------------------------
# Register tiles: fragment kinds and element access
# ---------------------------------------------------------------------------------------------

_FULL, _ROW, _COL, _SCALAR = "full", "row", "col", "scalar"


@dataclass(frozen=True)
class _Tile:
    name: str
    dtype: str
    rows: int
    cols: int

    @property
    def kind(self) -> str:
        if self.rows == 64 and self.cols > 1:
            return _FULL
        if self.rows == 1 and self.cols > 1:
            return _ROW
        if self.rows == 64 and self.cols == 1:
            return _COL
        return _SCALAR

    @property
    def packed(self) -> bool:
        """16-bit full and row tiles store the c = 0, 1 elements as one packed pair."""
        return self.dtype in ("bf16", "f16") and self.kind in (_FULL, _ROW)

    @property
    def length(self) -> int:
        per_thread = {_FULL: self.cols // 2, _ROW: self.cols // 4, _COL: 2, _SCALAR: 1}[self.kind]
        return per_thread // 2 if self.packed else per_thread

    def declaration(self) -> str:
        ctype = _CPAIR[self.dtype] if self.packed else _CTYPE[self.dtype]
        return f"{ctype} {self.name}[{self.length}];"

    def index(self, c: int | None = None) -> str:
        """The C++ element (c given) or packed pair (c None) at fragment position (fj, fi)."""
        if self.kind == _FULL:
            if self.packed:
                base = f"{self.name}[2 * fj + fi]"
            else:
                return f"{self.name}[4 * fj + 2 * fi + {c}]"
        elif self.kind == _ROW:
            if self.packed:
                base = f"{self.name}[fj]"
            else:
                return f"{self.name}[2 * fj + {c}]"
        elif self.kind == _COL:
            return f"{self.name}[fi]"
        else:
            return f"{self.name}[0]"
        return base if c is None else f"{base}.{'xy'[c]}"

    def read(self, c: int) -> str:
        """Element c of fragment position (fj, fi) as a float expression."""
        return _TO_FLOAT[self.dtype].format(self.index(c))


def _tile_from_decl(d: ir.RegDecl, cpp_name: str) -> _Tile:
    shape = tuple(d.shape)
    while len(shape) > 2 and shape[0] == 1:  # extra leading dims of extent 1
        shape = shape[1:]
    if len(shape) == 1:
        shape = (1,) + shape
    if len(shape) != 2:
        raise EmitError(f"reg {d.name}: {d.dtype}{list(d.shape)} is not a 2-D register tile")
    rows, cols = shape
    if d.dtype == "i32":
        raise EmitError(f"reg {d.name}: i32 register tiles have no CUDA spelling yet")
    if rows not in (1, 64) or (cols > 1 and cols % 8):
        raise EmitError(f"reg {d.name}: {d.dtype}{list(d.shape)} does not fit the warpgroup "
                        "fragment layout (rows 64 or 1, columns 1 or a multiple of 8)")
    return _Tile(cpp_name, d.dtype, rows, cols)


# ---------------------------------------------------------------------------------------------
# Helpers emitted into the .cu preamble on first use (fixed order, so the text is stable)
# ---------------------------------------------------------------------------------------------

_PRED_ASM = r'"{\n .reg .pred q;\n setp.ne.b32 q, %{p}, 0;\n @q {op};\n}\n"'


def _pred_asm(op: str, pred: int) -> str:
    return _PRED_ASM.replace("{p}", str(pred)).replace("{op}", op)


_HELPERS: dict[str, str] = {
    "ceil_div": """\
static __device__ __forceinline__ int ceil_div(int a, int b) { return (a + b - 1) / b; }""",
    "frag": """\
// This thread's place in a [64, N] register tile (wgmma accumulator layout): element
// d[4j + 2i + c] sits at row frag_row() + 8i, column frag_col() + 8j + c.
__device__ __forceinline__ int frag_row() { return 16 * ((threadIdx.x % 128) / 32) + (threadIdx.x % 32) / 4; }
__device__ __forceinline__ int frag_col() { return 2 * (threadIdx.x % 4); }""",
    "gelu": """\
__device__ __forceinline__ float gelu(float x) { return 0.5f * x * (1.0f + erff(x * 0.7071067811865476f)); }""",
    "silu": """\
__device__ __forceinline__ float silu(float x) { return x / (1.0f + expf(-x)); }""",
    "sigmoid": """\
__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }""",
    "bit_cast": """\
// Raw bits of a value (bf16/f16 constants and selects would go through the conversion asm of
// cuda_bf16.h / cuda_fp16.h, and through local memory).
template <typename To, typename From>
__device__ __forceinline__ To bit_cast(const From& v) {
  static_assert(sizeof(To) == sizeof(From), "bit_cast between types of one size");
  To r;
  memcpy(&r, &v, sizeof(To));
  return r;
}""",
    "global": f"""\
// Predicated global loads / stores: one instruction each, no branch (a branch per element
// splits the epilogue into many small blocks and ptxas spills). A disabled load reads 0.
__device__ __forceinline__ uint16_t ld_b16_if(const void* p, bool ok) {{
  uint16_t v = 0;
  asm volatile({_pred_asm("ld.global.b16 %0, [%1]", 2)} : "+h"(v) : "l"(p), "r"(int(ok)));
  return v;
}}
__device__ __forceinline__ uint32_t ld_b32_if(const void* p, bool ok) {{
  uint32_t v = 0;
  asm volatile({_pred_asm("ld.global.b32 %0, [%1]", 2)} : "+r"(v) : "l"(p), "r"(int(ok)));
  return v;
}}
__device__ __forceinline__ uint2 ld_b64_if(const void* p, bool ok) {{
  uint2 v = make_uint2(0, 0);
  asm volatile({_pred_asm("ld.global.v2.b32 {%0, %1}, [%2]", 3)} : "+r"(v.x), "+r"(v.y) : "l"(p), "r"(int(ok)));
  return v;
}}
__device__ __forceinline__ void st_b16_if(void* p, uint16_t v, bool ok) {{
  asm volatile({_pred_asm("st.global.b16 [%0], %1", 2)} :: "l"(p), "h"(v), "r"(int(ok)) : "memory");
}}
__device__ __forceinline__ void st_b32_if(void* p, uint32_t v, bool ok) {{
  asm volatile({_pred_asm("st.global.b32 [%0], %1", 2)} :: "l"(p), "r"(v), "r"(int(ok)) : "memory");
}}
__device__ __forceinline__ void st_b64_if(void* p, uint2 v, bool ok) {{
  asm volatile({_pred_asm("st.global.v2.b32 [%0], {%1, %2}", 3)} :: "l"(p), "r"(v.x), "r"(v.y), "r"(int(ok)) : "memory");
}}

// Element types as raw bits: one element (ld/st) or an adjacent pair (ld2/st2).
template <typename T> struct pair_of;
template <> struct pair_of<__nv_bfloat16> {{
  using type = __nv_bfloat162;
  using bits = uint32_t;
  static __device__ __forceinline__ uint16_t ld(const void* p, bool ok) {{ return ld_b16_if(p, ok); }}
  static __device__ __forceinline__ uint32_t ld2(const void* p, bool ok) {{ return ld_b32_if(p, ok); }}
  static __device__ __forceinline__ uint32_t join(uint16_t lo, uint16_t hi) {{ return lo | (uint32_t(hi) << 16); }}
  static __device__ __forceinline__ void st(void* p, uint32_t b, int half, bool ok) {{ st_b16_if(p, uint16_t(b >> (16 * half)), ok); }}
  static __device__ __forceinline__ void st2(void* p, uint32_t b, bool ok) {{ st_b32_if(p, b, ok); }}
}};
template <> struct pair_of<__half> : pair_of<__nv_bfloat16> {{ using type = __half2; }};
template <> struct pair_of<float> {{
  using type = float2;
  using bits = uint2;
  static __device__ __forceinline__ uint32_t ld(const void* p, bool ok) {{ return ld_b32_if(p, ok); }}
  static __device__ __forceinline__ uint2 ld2(const void* p, bool ok) {{ return ld_b64_if(p, ok); }}
  static __device__ __forceinline__ uint2 join(uint32_t lo, uint32_t hi) {{ return make_uint2(lo, hi); }}
  static __device__ __forceinline__ void st(void* p, uint2 b, int half, bool ok) {{ st_b32_if(p, half ? b.y : b.x, ok); }}
  static __device__ __forceinline__ void st2(void* p, uint2 b, bool ok) {{ st_b64_if(p, b, ok); }}
}};

// A row of a global tensor moves in pairs (p, p + 1) with one 32/64-bit access when the row
// pointer is aligned for it and the row length is even (a pair is then wholly inside or wholly
// outside); otherwise element by element. Outside elements read as zero / are not written.
template <typename T>
__device__ __forceinline__ bool pairs_aligned(const T* row_ptr, int cols) {{
  return reinterpret_cast<uintptr_t>(row_ptr) % sizeof(typename pair_of<T>::type) == 0 && cols % 2 == 0;
}}
template <typename T>
__device__ __forceinline__ typename pair_of<T>::type load_pair(const T* p, bool ok) {{
  return bit_cast<typename pair_of<T>::type>(pair_of<T>::ld2(p, ok));
}}
template <typename T>
__device__ __forceinline__ typename pair_of<T>::type load_split(const T* p, bool ok0, bool ok1) {{
  using P = pair_of<T>;
  return bit_cast<typename P::type>(P::join(P::ld(p, ok0), P::ld(p + 1, ok1)));
}}
template <typename T>
__device__ __forceinline__ T load_one(const T* p, bool ok) {{
  return bit_cast<T>(pair_of<T>::ld(p, ok));
}}
template <typename T>
__device__ __forceinline__ void store_pair(T* p, bool ok, typename pair_of<T>::type v) {{
  pair_of<T>::st2(p, bit_cast<typename pair_of<T>::bits>(v), ok);
}}
template <typename T>
__device__ __forceinline__ void store_split(T* p, bool ok0, bool ok1, typename pair_of<T>::type v) {{
  const auto b = bit_cast<typename pair_of<T>::bits>(v);
  pair_of<T>::st(p, b, 0, ok0);
  pair_of<T>::st(p + 1, b, 1, ok1);
}}""",
    "shared": """\
// 128-byte swizzle (what TMA and wgmma use, on 1024-byte-aligned buffers): the 16-byte unit
// bits [4, 7) of a shared address are xor-ed with its 128-byte row bits [7, 10). Applied per
// store to the unswizzled address, so no per-thread table of swizzled offsets stays live.
__device__ __forceinline__ uint32_t swizzle128(uint32_t addr) { return addr ^ ((addr >> 3) & 0x70); }
__device__ __forceinline__ void st_shared(uint32_t addr, uint32_t v) {
  asm volatile("st.shared.b32 [%0], %1;\\n" :: "r"(addr), "r"(v) : "memory");
}
__device__ __forceinline__ void st_shared(uint32_t addr, uint2 v) {
  asm volatile("st.shared.v2.b32 [%0], {%1, %2};\\n" :: "r"(addr), "r"(v.x), "r"(v.y) : "memory");
}""",
    "fence_packed": """\
// Keep the compiler from moving reads/writes of a packed 16-bit register fragment (a wgmma A
// operand) across wgmma issue/wait (wsp::warpgroup_fence_array covers float fragments only).
template <typename T2, int N>
__device__ __forceinline__ void fence_packed(T2 (&d)[N]) {
  static_assert(sizeof(T2) == 4, "packed 16-bit pairs");
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+r"(*reinterpret_cast<uint32_t*>(&d[i])) :: "memory");
}""",
}
_HELPER_NEEDS: dict[str, tuple[str, ...]] = {"global": ("bit_cast",), "shared": ("bit_cast",)}

_UNARY = {
    "neg": "-{}", "exp": "expf({})", "exp2": "exp2f({})", "log": "logf({})",
    "relu": "fmaxf({}, 0.0f)", "gelu": "wsk::gelu({})", "silu": "wsk::silu({})",
    "sigmoid": "wsk::sigmoid({})", "tanh": "tanhf({})", "cast": "{}",
}
_BINARY = {
    "add": "{} + {}", "sub": "{} - {}", "mul": "{} * {}", "div": "{} / {}",
    "maximum": "fmaxf({}, {})", "minimum": "fminf({}, {})",
}


# ---------------------------------------------------------------------------------------------
# The emitter
# ---------------------------------------------------------------------------------------------

_KERNEL, _ROLE, _ELECT = "kernel", "role", "elect_one"


@dataclass
class _RoleInfo:
    role: ir.Role
    first_wg: int
    tiles: dict[str, _Tile] = field(default_factory=dict)
    fenced: list[str] = field(default_factory=list)  # accumulators / register A operands


class _Emitter:
    def __init__(self, kernel: ir.Kernel):
        self.kernel = kernel
        self.lines: list[str] = []
        self.depth = 1
        self.scope = _Scope()
        self.level = _KERNEL
        self.role: _RoleInfo | None = None
        self.next_wg = 0
        self.open_guard: str | None = None
        self.role_chain_open = False
        self.host = False  # expressions of the host-side grid (num_sms allowed)
        self.helpers: set[str] = set()
        self.wgmma: dict[str, str] = {}
        self.smem_offsets, self.barrier_offsets = _layout(kernel)
        self.names = _cpp_names(kernel)
        self.uses_builtin = {b: any(_names_in(kernel.body, b)) for b in ("cta_id", "num_ctas")}

    def c(self, name: str) -> str:
        """The C++ spelling of an IR-declared name."""
        return self.names.get(name, name)

    # -- text ------------------------------------------------------------------------------------
    def line(self, text: str = "") -> None:
        self.close_guard()
        self._raw(text)

    def _raw(self, text: str) -> None:
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
        self._raw(tail)

    def guarded(self, cond: str | None, text: str) -> None:
        """`text` run by one thread: consecutive statements under the same guard share it."""
        if cond is None:
            self.line(text)
            return
        if self.open_guard != cond:
            self.close_guard()
            self._raw(f"if ({cond}) {{")
            self.depth += 1
            self.open_guard = cond
        self._raw(text)

    def close_guard(self) -> None:
        if self.open_guard is not None:
            self.open_guard = None
            self.depth -= 1
            self._raw("}")

    def one_thread(self) -> str | None:
        """The guard that makes one thread of the current executing group run a statement."""
        return {_KERNEL: "threadIdx.x == 0", _ROLE: "threadIdx.x % 128 == 0", _ELECT: None}[self.level]

    def use(self, helper: str) -> None:
        for dep in _HELPER_NEEDS.get(helper, ()):
            self.helpers.add(dep)
        self.helpers.add(helper)

    # -- statements --------------------------------------------------------------------------------
    def stmts(self, body: tuple[ir.Stmt, ...]) -> None:
        i = 0
        while i < len(body):
            s = body[i]
            fn = EMITTERS.get(type(s))
            if fn is None:
                raise EmitError(f"no CUDA spelling for IR node {type(s).__name__} ({s!r}); "
                                f"codegen/emit.py handles: {sorted(t.__name__ for t in EMITTERS)}")
            if type(s) in _ELEMENTWISE and self.level == _ROLE:
                n = _elementwise_run(self, body, i)
                _emit_elementwise(self, *body[i:i + n])
                i += n
                continue
            fn(self, s)
            i += 1
            if isinstance(s, ir.Role) and not (i < len(body) and isinstance(body[i], ir.Role)):
                self.close_guard()
                self.depth -= 1  # close the if/else chain of the roles
                self._raw("}")
                self.role_chain_open = False

    def require(self, s: ir.Stmt, *, level: tuple[str, ...], what: str) -> None:
        if self.level not in level:
            where = {_KERNEL: "at kernel level", _ROLE: "in a role outside elect_one",
                     _ELECT: "inside elect_one"}[self.level]
            raise EmitError(f"{_describe(s)} {what}; it is {where}")

    # -- expressions -------------------------------------------------------------------------------
    def expr(self, e: ir.Expr) -> str:
        return self._expr(e)[0]

    def expr_type(self, e: ir.Expr) -> str:
        return self._expr(e)[2]

    def float_expr(self, e: ir.Expr) -> str:
        text, _, ctype = self._expr(e)
        return text if ctype == "float" else f"static_cast<float>({text})"

    def _expr(self, e: ir.Expr) -> tuple[str, int, str]:
        """(C++ text, C++ precedence, "int" | "float")."""
        if isinstance(e, ir.IntConst):
            return str(e.value), (_ATOM if e.value >= 0 else 14), "int"
        if isinstance(e, ir.FloatConst):
            text = _float_literal(e.value)
            return text, (14 if text.startswith("-") else _ATOM), "float"
        if isinstance(e, ir.Var):
            return self._var(e.name), _ATOM, self._var_type(e.name)
        if isinstance(e, ir.BinOp):
            return self._binop(e)
        if isinstance(e, ir.Call):
            return self._call(e)
        raise EmitError(f"no CUDA spelling for expression {e!r}")

    def _var(self, name: str) -> str:
        """Builtins and declared scalars keep their IR names in C++ (setup declares cta_id and
        num_ctas, each role branch wg)."""
        declared = self.scope.lookup(name)
        if declared == "tensor":
            raise EmitError(f"expression uses the tensor {name!r} as a scalar")
        if name == "num_sms" and not self.host:
            raise EmitError("num_sms is a host-side builtin (grid expressions only); "
                            "device code must use num_ctas")
        if name == "wg" and self.role is None:
            raise EmitError("the builtin wg is defined only inside a role")
        if declared is None and name not in ir.BUILTINS:
            raise EmitError(f"expression uses {name!r}, which is neither a parameter, a builtin "
                            "nor a let/var/loop variable in scope")
        return name if declared is None else self.c(name)

    def _var_type(self, name: str) -> str:
        return self.scope.lookup(name) or "int"

    def _binop(self, e: ir.BinOp) -> tuple[str, int, str]:
        if e.op not in _CPP_PREC:
            raise EmitError(f"unknown binary operator {e.op!r} in {e!r}")
        prec = _CPP_PREC[e.op]
        lhs, lprec, ltype = self._expr(e.lhs)
        rhs, rprec, rtype = self._expr(e.rhs)
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
        if ir.CALLS.get(e.func) != len(e.args):
            raise EmitError(f"unknown call {e.func}/{len(e.args)} in {e!r}; known: {ir.CALLS}")
        args = [self._expr(a) for a in e.args]
        if e.func == "select":
            (c, cp, _), (a, ap, at), (b, bp, bt) = args
            ctype = "int" if at == bt == "int" else "float"
            return f"{_paren(c, cp, 4)} ? {_paren(a, ap, 4)} : {_paren(b, bp, 4)}", 3, ctype
        texts = ", ".join(a[0] for a in args)
        if e.func == "ceil_div":
            if any(a[2] != "int" for a in args):
                raise EmitError(f"ceil_div needs integer operands: {e!r}")
            self.use("ceil_div")
            return f"ceil_div({texts})", _ATOM, "int"
        if all(a[2] == "int" for a in args):
            return f"{e.func}({texts})", _ATOM, "int"
        return f"f{e.func}f({texts})", _ATOM, "float"

    # -- shared memory -------------------------------------------------------------------------------
    def smem_ref(self, ref: ir.SmemRef) -> tuple[str, ir.SmemDecl, tuple[int, ...]]:
        """(`smem_X + byte offset` text, declaration, sub-array shape)."""
        decl = self._smem_decl(ref.buffer)
        if len(ref.index) > len(decl.shape):
            raise EmitError(f"smem reference {ref.buffer}[{len(ref.index)} indices] has more "
                            f"indices than {ref.buffer}'s {len(decl.shape)} dims")
        sub = ir.smem_subshape(decl, ref)
        terms = []
        for d, idx in enumerate(ref.index):
            stride = ir.DTYPE_BYTES[decl.dtype] * math.prod(decl.shape[d + 1:])
            if isinstance(idx, ir.IntConst):
                terms.append(idx.value * stride)
            else:
                text, prec, _ = self._expr(idx)
                terms.append(f"{_paren(text, prec, 13)} * {stride}")
        const = sum(t for t in terms if isinstance(t, int))
        parts = [t for t in terms if isinstance(t, str)] + ([str(const)] if const else [])
        return " + ".join([f"smem_{ref.buffer}"] + parts), decl, sub

    def _smem_decl(self, name: str) -> ir.SmemDecl:
        try:
            return self.kernel.smem_decl(name)
        except KeyError:
            raise EmitError(f"shared buffer {name!r} is not declared (have "
                            f"{[s.name for s in self.kernel.smem]})") from None

    def bar_ref(self, ref: ir.BarRef) -> str:
        if ref.barrier not in self.barrier_offsets:
            raise EmitError(f"barrier {ref.barrier!r} is not declared (have "
                            f"{list(self.barrier_offsets)})")
        return f"&{ref.barrier}_bar[{self.expr(ref.index)}]"

    def tile(self, name: str, s: ir.Stmt) -> _Tile:
        if self.role is None or name not in self.role.tiles:
            raise EmitError(f"{_describe(s)}: register tile {name!r} is not declared in this role")
        return self.role.tiles[name]

    def global_param(self, name: str, s: ir.Stmt) -> ir.GlobalParam:
        p = _param(self.kernel, name, s)
        if not isinstance(p, ir.GlobalParam):
            raise EmitError(f"{_describe(s)}: {name!r} is a {type(p).__name__}, not a global tensor")
        return p

    def tensormap_param(self, name: str, s: ir.Stmt, coords: tuple[ir.Expr, ...]) -> ir.TensorMapParam:
        p = _param(self.kernel, name, s)
        if not isinstance(p, ir.TensorMapParam):
            raise EmitError(f"{_describe(s)}: {name!r} is a {type(p).__name__}, not a tensor map")
        if len(coords) != len(p.shape) or not 1 <= len(coords) <= 5:
            raise EmitError(f"{_describe(s)}: {len(coords)} coordinates for the rank-{len(p.shape)} "
                            f"tensor map {name!r} (TMA takes 1 to 5)")
        return p


def _paren(text: str, prec: int, need: int) -> str:
    return f"({text})" if prec < need else text


_KEYWORDS = {
    ir.TmaLoad: "tma.load", ir.TmaStore: "tma.store", ir.TmaCommit: "tma.commit",
    ir.TmaWait: "tma.wait", ir.Wgmma: "wgmma.mma", ir.WgmmaFence: "wgmma.fence",
    ir.WgmmaCommit: "wgmma.commit", ir.WgmmaWait: "wgmma.wait", ir.Setmaxnreg: "setmaxnreg",
    ir.SyncThreads: "syncthreads", ir.ElectOne: "elect_one", ir.Role: "role",
    ir.TileLoadGlobal: "tile.load", ir.TileStoreGlobal: "tile.store",
    ir.TileStoreSmem: "tile.store_smem", ir.TileReduce: "tile.reduce", ir.RegDecl: "reg",
    ir.TileMask: "tile.mask",
}


def _describe(s: ir.Stmt) -> str:
    """`keyword` (the node's fields, blocks left out) for error messages."""
    fields = ", ".join(f"{k}={v!r}" for k, v in vars(s).items()
                       if not (isinstance(v, tuple) and any(isinstance(x, ir.STMT_TYPES) for x in v)))
    text = f"{type(s).__name__}({fields})"
    if len(text) > 240:
        text = text[:237] + "..."
    return f"`{_KEYWORDS.get(type(s), type(s).__name__)}` {text}"


def _param(kernel: ir.Kernel, name: str, s: ir.Stmt) -> ir.Param:
    try:
        return kernel.param(name)
    except KeyError:
        raise EmitError(f"{_describe(s)}: no kernel parameter named {name!r}") from None


def _names_in(body: tuple[ir.Stmt, ...], wanted: str) -> Iterator[bool]:
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
    """Byte offsets from the 1024-aligned smem base, exactly as `ir.Kernel.smem_bytes` counts."""
    offset, smem, bars = 0, {}, {}
    for buf in kernel.smem:
        offset = ir._align(offset, 1024)
        smem[buf.name] = offset
        offset += buf.nbytes
    offset = ir._align(offset, 8)
    for b in kernel.barriers:
        bars[b.name] = offset
        offset += 8 * b.slots
    return smem, bars


# ---------------------------------------------------------------------------------------------
# One emit function per IR statement kind
# ---------------------------------------------------------------------------------------------


def _emit_let(em: _Emitter, s: ir.Let) -> None:
    ctype = em.expr_type(s.value)
    value = em.expr(s.value)
    em.scope.declare(s.name, ctype)
    em.line(f"{'' if s.mutable else 'const '}{ctype} {em.c(s.name)} = {value};")


def _emit_assign(em: _Emitter, s: ir.Assign) -> None:
    if em.scope.lookup(s.name) is None:
        raise EmitError(f"`set {s.name}`: no `var {s.name}` in scope")
    em.line(f"{em.c(s.name)} = {em.expr(s.value)};")


def _emit_for(em: _Emitter, s: ir.For) -> None:
    if s.kind not in ("serial", "persistent", "unroll"):
        raise EmitError(f"for {s.var}: unknown loop kind {s.kind!r} (serial | persistent | unroll)")
    start, stop = em.expr(s.start), em.expr(s.stop)
    var = em.c(s.var)
    step = "++" + var if s.step == ir.IntConst(1) else f"{var} += {em.expr(s.step)}"
    if s.kind == "unroll":
        em.line("#pragma unroll")
    note = "  // persistent: this CTA's tiles" if s.kind == "persistent" else ""
    with em.block(f"for (int {var} = {start}; {var} < {stop}; {step}) {{{note}"):
        em.scope.declare(s.var, "int")
        em.stmts(s.body)


def _emit_if(em: _Emitter, s: ir.If) -> None:
    head = f"if ({em.expr(s.cond)}) {{"
    while True:
        em.line(head)
        em.depth += 1
        with em.scope.nested():
            em.stmts(s.then)
        em.close_guard()
        em.depth -= 1
        if not s.orelse:
            em.line("}")
            return
        if len(s.orelse) == 1 and isinstance(s.orelse[0], ir.If):
            s = s.orelse[0]
            head = f"}} else if ({em.expr(s.cond)}) {{"
            continue
        em.line("} else {")
        em.depth += 1
        with em.scope.nested():
            em.stmts(s.orelse)
        em.close_guard()
        em.depth -= 1
        em.line("}")
        return


def _emit_role(em: _Emitter, s: ir.Role) -> None:
    # One branch of a single if/else on the warpgroup index per role, in order: setmaxnreg is
    # honoured only when each role is one such branch.
    if em.level != _KERNEL or em.depth != (2 if em.role_chain_open else 1):
        raise EmitError(f"role {s.name}: roles must be kernel-level statements, not nested in a "
                        "loop, an if or another role")
    if em.next_wg and not em.role_chain_open:
        raise EmitError(f"role {s.name}: the roles must be consecutive statements (one if/else "
                        "chain); a statement separates it from the previous role")
    first = em.next_wg
    em.next_wg += s.warpgroups
    if not em.role_chain_open:
        em.line()
        em.line("const int wg_index = __shfl_sync(0xffffffff, threadIdx.x / 128, 0);")
        em.line(f"if (wg_index < {em.next_wg}) {{")
        em.role_chain_open = True
    else:
        em.close_guard()
        em.depth -= 1
        em._raw(f"}} else if (wg_index < {em.next_wg}) {{")
    em.depth += 1
    wgs = f"warpgroup {first}" if s.warpgroups == 1 else f"warpgroups {first}-{em.next_wg - 1}"
    em.line(f"// role {s.name}: {wgs}, {s.registers} registers")
    em.level, em.role = _ROLE, _RoleInfo(s, first, fenced=_wgmma_register_operands(s.body))
    try:
        with em.scope.nested():
            if any(_names_in(s.body, "wg")):
                em.line(f"const int wg = wg_index - {first};")
            em.stmts(s.body)
        em.close_guard()
    finally:
        em.level, em.role = _KERNEL, None
    # the branch stays open: the next role's `} else if` or the caller's `}` closes it


def _wgmma_register_operands(body: tuple[ir.Stmt, ...]) -> list[str]:
    names: list[str] = []
    for st in ir.walk(body):
        if isinstance(st, ir.Wgmma):
            for n in (st.acc, st.a if isinstance(st.a, str) else None):
                if n is not None and n not in names:
                    names.append(n)
    return names


def _emit_elect_one(em: _Emitter, s: ir.ElectOne) -> None:
    em.require(s, level=(_ROLE,), what="must be inside a role and not nested in another elect_one")
    with em.block("if (wsp::warp_id_in_warpgroup() == 0 && wsp::elect_one()) {  // elect_one"):
        em.level = _ELECT
        try:
            em.stmts(s.body)
        finally:
            em.level = _ROLE


def _emit_return(em: _Emitter, s: ir.Return) -> None:
    em.line("return;")


def _emit_setmaxnreg(em: _Emitter, s: ir.Setmaxnreg) -> None:
    em.require(s, level=(_ROLE,), what="is warpgroup-wide and must be in a role outside elect_one")
    if s.action not in ("inc", "dec"):
        raise EmitError(f"{_describe(s)}: action must be inc or dec")
    em.line(f"wsp::setmaxnreg_{s.action}<{s.registers}>();")


def _emit_mbarrier_init(em: _Emitter, s: ir.MbarrierInit) -> None:
    slots = _barrier_slots(em, s.barrier)
    em.guarded(em.one_thread(), f"for (int i = 0; i < {slots}; ++i) "
                                f"wsp::mbar_init(&{s.barrier}_bar[i], {s.arrivals});")


def _emit_mbarrier_inval(em: _Emitter, s: ir.MbarrierInval) -> None:
    slots = _barrier_slots(em, s.barrier)
    em.guarded(em.one_thread(), f"for (int i = 0; i < {slots}; ++i) "
                                f"wsp::mbar_inval(&{s.barrier}_bar[i]);")


def _barrier_slots(em: _Emitter, name: str) -> int:
    for b in em.kernel.barriers:
        if b.name == name:
            return b.slots
    raise EmitError(f"barrier {name!r} is not declared (have {[b.name for b in em.kernel.barriers]})")


def _emit_fence_mbarrier_init(em: _Emitter, s: ir.FenceMbarrierInit) -> None:
    em.guarded(em.one_thread(), "wsp::fence_mbarrier_init();")


def _emit_mbarrier_arrive(em: _Emitter, s: ir.MbarrierArrive) -> None:
    em.guarded(em.one_thread(), f"wsp::mbar_arrive({em.bar_ref(s.bar)});")


def _emit_mbarrier_arrive_expect_tx(em: _Emitter, s: ir.MbarrierArriveExpectTx) -> None:
    em.guarded(em.one_thread(),
               f"wsp::mbar_arrive_expect_tx({em.bar_ref(s.bar)}, {em.expr(s.bytes)});")


def _emit_mbarrier_wait(em: _Emitter, s: ir.MbarrierWait) -> None:
    em.line(f"wsp::mbar_wait({em.bar_ref(s.bar)}, {em.expr(s.phase)});")


def _emit_fence_proxy_async(em: _Emitter, s: ir.FenceProxyAsync) -> None:
    em.line("wsp::fence_proxy_async();")


def _emit_syncthreads(em: _Emitter, s: ir.SyncThreads) -> None:
    em.require(s, level=(_KERNEL,), what="is a whole-CTA barrier and must be at kernel level "
                                         "(use bar.sync inside roles)")
    em.line("__syncthreads();")


def _emit_named_barrier_sync(em: _Emitter, s: ir.NamedBarrierSync) -> None:
    em.line(f"wsp::named_barrier_sync({em.expr(s.id)}, {s.threads});")


def _emit_named_barrier_arrive(em: _Emitter, s: ir.NamedBarrierArrive) -> None:
    em.line(f"wsp::named_barrier_arrive({em.expr(s.id)}, {s.threads});")


# --- TMA -------------------------------------------------------------------------------------------


def _require_elected(em: _Emitter, s: ir.Stmt) -> None:
    em.require(s, level=(_ELECT,), what="must be inside elect_one (TMA is issued, committed and "
                                        "waited on by one thread)")


def _tma_coords(em: _Emitter, coords: tuple[ir.Expr, ...]) -> str:
    # IR coordinates are outermost first; the hardware (and wsp::tma_*) take innermost first.
    return ", ".join(em.expr(c) for c in reversed(coords))


def _check_box(em: _Emitter, s: ir.Stmt, p: ir.TensorMapParam, decl: ir.SmemDecl,
               sub: tuple[int, ...]) -> None:
    box_bytes = math.prod(p.box) * ir.DTYPE_BYTES[p.dtype]
    sub_bytes = math.prod(sub) * ir.DTYPE_BYTES[decl.dtype]
    if box_bytes != sub_bytes or p.dtype != decl.dtype:
        raise EmitError(f"{_describe(s)}: the box of {p.name} ({p.dtype}{list(p.box)}, {box_bytes} "
                        f"bytes) does not fill the smem sub-array {decl.dtype}{list(sub)} "
                        f"({sub_bytes} bytes)")


def _tma_operands(em: _Emitter, s: ir.TmaLoad | ir.TmaStore, ref: ir.SmemRef) -> tuple[str, str, str]:
    """(smem pointer, &tensor map, coordinates innermost first) of a TMA copy."""
    _require_elected(em, s)
    p = em.tensormap_param(s.tensor, s, s.coords)
    ptr, decl, sub = em.smem_ref(ref)
    _check_box(em, s, p, decl, sub)
    return ptr, f"&{em.c(s.tensor)}", _tma_coords(em, s.coords)


def _emit_tma_load(em: _Emitter, s: ir.TmaLoad) -> None:
    dst, tensor_map, coords = _tma_operands(em, s, s.dst)
    em.line(f"wsp::tma_load_{len(s.coords)}d({dst}, {tensor_map}, {em.bar_ref(s.bar)}, {coords});")


def _emit_tma_store(em: _Emitter, s: ir.TmaStore) -> None:
    src, tensor_map, coords = _tma_operands(em, s, s.src)
    em.line(f"wsp::tma_store_{len(s.coords)}d({tensor_map}, {src}, {coords});")


def _emit_tma_commit(em: _Emitter, s: ir.TmaCommit) -> None:
    _require_elected(em, s)
    em.line("wsp::tma_store_commit();")


def _emit_tma_wait(em: _Emitter, s: ir.TmaWait) -> None:
    _require_elected(em, s)
    em.line(f"wsp::tma_store_wait{'_read' if s.read else ''}<{s.pending}>();")


# --- wgmma -------------------------------------------------------------------------------------------


def _require_warpgroup(em: _Emitter, s: ir.Stmt) -> None:
    em.require(s, level=(_ROLE,), what="is warpgroup-collective (.sync.aligned) and must be in a "
                                       "role outside elect_one")


def _fence_operands(em: _Emitter) -> None:
    for name in em.role.fenced:
        t = em.role.tiles.get(name)
        if t is None:
            continue  # not declared yet: the wgmma using it reports that
        if t.packed:
            em.use("fence_packed")
            em.line(f"wsk::fence_packed({t.name});")
        else:
            em.line(f"wsp::warpgroup_fence_array({t.name});")


def _emit_wgmma_fence(em: _Emitter, s: ir.WgmmaFence) -> None:
    _require_warpgroup(em, s)
    # As CUTLASS: pin the fragments wgmma reads/writes to this point, then wgmma.fence.
    _fence_operands(em)
    em.line("wsp::wgmma_fence();")


def _emit_wgmma_commit(em: _Emitter, s: ir.WgmmaCommit) -> None:
    _require_warpgroup(em, s)
    em.line("wsp::wgmma_commit();")


def _emit_wgmma_wait(em: _Emitter, s: ir.WgmmaWait) -> None:
    _require_warpgroup(em, s)
    em.line(f"wsp::wgmma_wait<{s.pending}>();")
    # Accumulator reads after this wait must not be hoisted above it.
    _fence_operands(em)


_SWIZZLE_SPAN = 128  # the only operand layout implemented: 128-byte swizzle, 64 x 16-bit per row


def _k_major_operand(em: _Emitter, s: ir.Wgmma, ref: ir.SmemRef, rows: int | None,
                     what: str) -> tuple[str, int, Callable[[int], int]]:
    """(start pointer text, K, byte offset of k16 step ks) of a K-major operand: sub-array
    [rows, K] (K * bytes <= 128) or column chunks (K / 64, rows, 64)."""
    ptr, decl, sub = em.smem_ref(ref)
    _check_operand_swizzle(s, decl, what)
    if len(sub) == 2:
        r, k = sub
        w = k
    elif len(sub) == 3:
        chunks, r, w = sub
        k = chunks * w
    else:
        raise EmitError(f"{_describe(s)}: {what} sub-array {list(sub)} is not [rows, K] or (chunks, rows, 64)")
    nbytes = ir.DTYPE_BYTES[decl.dtype]
    if w * nbytes > _SWIZZLE_SPAN or (len(sub) == 3 and w * nbytes != _SWIZZLE_SPAN):
        raise EmitError(f"{_describe(s)}: {what} rows of {w} {decl.dtype} exceed the 128-byte swizzle span")
    if rows is not None and r != rows:
        raise EmitError(f"{_describe(s)}: {what} sub-array {list(sub)} has {r} rows, expected {rows}")
    if k % 16:
        raise EmitError(f"{_describe(s)}: K = {k} is not a multiple of 16")

    def step(ks: int) -> int:
        col = 16 * ks
        return (col // w) * r * _SWIZZLE_SPAN + (col % w) * nbytes

    return ptr, k, step


def _check_operand_swizzle(s: ir.Wgmma, decl: ir.SmemDecl, what: str) -> None:
    if decl.swizzle != 128 or decl.dtype not in ("bf16", "f16"):
        raise EmitError(f"{_describe(s)}: {what} buffer {decl.name} is {decl.dtype} swizzle({decl.swizzle}); "
                        "wgmma operands are implemented for bf16/f16 with swizzle(128) only")


def _emit_wgmma(em: _Emitter, s: ir.Wgmma) -> None:
    _require_warpgroup(em, s)
    acc = em.tile(s.acc, s)
    if acc.kind != _FULL or acc.dtype != "f32" or acc.cols not in VALID_N:
        raise EmitError(f"{_describe(s)}: the accumulator must be an f32[64, N] tile with N a "
                        f"multiple of 8 in [8, 256]; {acc.name} is {acc.dtype}[{acc.rows}, {acc.cols}]")
    n = acc.cols
    b_ptr, b_decl, b_sub = em.smem_ref(s.b)
    _check_operand_swizzle(s, b_decl, "B")
    dtype = b_decl.dtype

    lines: list[str] = []
    if s.b_major == "k":
        b_ptr, k_b, b_step = _k_major_operand(em, s, s.b, n, "B")
        b_desc = f"wsp::make_smem_desc({b_ptr}, 128, 16, 1024)"
        b_note = "B K-major [N, K]: rows of 128 bytes, SBO = 1024 (8-row group), LBO unused (1)"
    elif s.b_major == "n":
        sub = b_sub if len(b_sub) == 3 else (1,) + tuple(b_sub)
        if len(sub) != 3 or sub[2] * ir.DTYPE_BYTES[dtype] != _SWIZZLE_SPAN or sub[0] * sub[2] != n:
            raise EmitError(f"{_describe(s)}: N-major B must be a (N/64, K, 64) sub-array with "
                            f"N = {n}; got {list(b_sub)}")
        k_b = sub[1]
        chunk_bytes = k_b * _SWIZZLE_SPAN

        def b_step(ks: int) -> int:
            return 16 * ks * _SWIZZLE_SPAN

        # MN-major, 128B swizzle (PTX ISA "Shared Memory Matrix Layout" / strides table; CUTLASS
        # make_gmma_desc<Major::MN>, canonical B128 layout ((8,n),(8,k)):((1,LBO),(8,SBO)) in
        # 16-byte units): LBO = stride between 64-element N chunks, SBO = stride between
        # 8-row K groups. Here chunks are K rows x 128 bytes apart and 8 rows are 1024 bytes.
        b_desc = f"wsp::make_smem_desc({b_ptr}, 128, {chunk_bytes}, 1024)"
        b_note = (f"B N-major (N/64, K, 64): LBO = {chunk_bytes} (next 64-column chunk), "
                  "SBO = 1024 (next 8 k-rows)")
    else:
        raise EmitError(f"{_describe(s)}: b_major must be 'k' or 'n', not {s.b_major!r}")

    if isinstance(s.a, ir.SmemRef):
        if s.a_major != "k":
            raise EmitError(f"{_describe(s)}: only K-major A in shared memory is implemented")
        a_ptr, k, a_step = _k_major_operand(em, s, s.a, 64, "A")
        if em._smem_decl(s.a.buffer).dtype != dtype:
            raise EmitError(f"{_describe(s)}: A and B have different dtypes")
        name, text = wgmma_function(n, dtype, "smem", s.b_major == "n")
        lines.append(f"const uint64_t desc_a = wsp::make_smem_desc({a_ptr}, 128, 16, 1024);")
    else:
        a_tile = em.tile(s.a, s)
        if a_tile.kind != _FULL or not a_tile.packed or a_tile.dtype != dtype or s.a_major != "k":
            raise EmitError(f"{_describe(s)}: a register A operand must be a K-major {dtype}[64, K] "
                            f"tile; {a_tile.name} is {a_tile.dtype}[{a_tile.rows}, {a_tile.cols}]")
        k = a_tile.cols
        name, text = wgmma_function(n, dtype, "regs", s.b_major == "n")
        em.use("bit_cast")
    if k != k_b:
        raise EmitError(f"{_describe(s)}: A has K = {k} but B has K = {k_b}")
    em.wgmma.setdefault(name, text)
    lines.append(f"const uint64_t desc_b = {b_desc};  // {b_note}")

    for ks in range(k // 16):
        scale = em.expr(s.accumulate) if ks == 0 else "1"
        if isinstance(s.a, ir.SmemRef):
            a_arg = "desc_a" if ks == 0 else f"wsp::smem_desc_add(desc_a, {a_step(ks)})"
        else:
            a_arg = ", ".join(f"wsk::bit_cast<uint32_t>({a_tile.name}[{4 * ks + r}])" for r in range(4))
        b_arg = "desc_b" if ks == 0 else f"wsp::smem_desc_add(desc_b, {b_step(ks)})"
        lines.append(f"{name}({acc.name}, {a_arg}, {b_arg}, {scale});")

    a_text = s.a if isinstance(s.a, str) else _ref_text(em, s.a)
    b_text = _ref_text(em, s.b)
    with em.block(f"{{  // wgmma: {acc.name}[64, {n}] (+)= {a_text} x {b_text}, "
                  f"{k // 16} x m64n{n}k16"):
        for ln in lines:
            em.line(ln)


# --- register tiles ----------------------------------------------------------------------------------


def _emit_reg_decl(em: _Emitter, s: ir.RegDecl) -> None:
    em.require(s, level=(_ROLE,), what="declares a per-warpgroup register tile and must be in a role")
    t = _tile_from_decl(s, em.c(s.name))
    if s.name in em.role.tiles:
        raise EmitError(f"reg {s.name} is declared twice in role {em.role.role.name}")
    em.role.tiles[s.name] = t
    layout = {_FULL: "wgmma fragment", _ROW: "row fragment", _COL: "column fragment",
              _SCALAR: "per-thread scalar"}[t.kind]
    packed = ", packed pairs" if t.packed else ""
    em.line(f"{t.declaration():<32}// {s.name}: {s.dtype}{list(s.shape)}, {layout}{packed}")


@contextmanager
def _fragment_loop(em: _Emitter, kind: str, cols: int) -> Iterator[None]:
    """Loop over this thread's fragment positions (fj, fi) of a tile of the given kind; every
    index is a compile-time constant once unrolled."""
    loops = {_FULL: [("fj", cols // 8), ("fi", 2)], _ROW: [("fj", cols // 8)],
             _COL: [("fi", 2)], _SCALAR: []}[kind]
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
            em._raw("}")


def _elems(kind: str) -> tuple[int, ...]:
    return (0, 1) if kind in (_FULL, _ROW) else (0,)


def _assignments(dst: _Tile, values: list[str]) -> list[str]:
    """Statements writing float values (one per element c of the fragment position) into dst."""
    if dst.packed:
        return [f"{dst.index()} = {_PACK[dst.dtype].format(*values)};"]
    return [f"{dst.index(c)} = {_FROM_FLOAT[dst.dtype].format(v)};" for c, v in enumerate(values)]


def _assign(em: _Emitter, dst: _Tile, values: list[str]) -> None:
    for ln in _assignments(dst, values):
        em.line(ln)


def _operand(em: _Emitter, s: ir.Stmt, dst: _Tile, op: Union[str, ir.Expr]) -> Callable[[int], str]:
    """Element c of an operand at dst's fragment position, as a float expression."""
    if not isinstance(op, str):
        text = em.float_expr(op)
        return lambda c: text
    t = em.tile(op, s)
    ok = {
        _FULL: {_FULL, _ROW, _COL, _SCALAR}, _ROW: {_ROW, _SCALAR}, _COL: {_COL, _SCALAR},
        _SCALAR: {_SCALAR},
    }[dst.kind]
    same_cols = t.kind in (_COL, _SCALAR) or t.cols == dst.cols
    if t.kind not in ok or not same_cols or (t.kind in (_FULL, _COL) and t.rows != dst.rows):
        raise EmitError(f"{_describe(s)}: {t.name} [{t.rows}, {t.cols}] does not broadcast to "
                        f"{dst.name} [{dst.rows}, {dst.cols}]")
    return t.read


# Elementwise tile ops: each spells the statements of ONE fragment position (fj, fi);
# consecutive ones over the same fragment space share one unrolled loop (`_emit_elementwise`).
# That is the same computation in the same per-element order (every element of a fused op
# reads only the same position of same-shaped operands, and broadcast operands are never
# written in the run), and it keeps each value in registers from one op to the next instead
# of sweeping the whole tile once per op.


def _tile_fill_lines(em: _Emitter, s: ir.TileFill) -> tuple[_Tile, list[str], str]:
    dst = em.tile(s.dst, s)
    value = em.float_expr(s.value)
    return dst, _assignments(dst, [value for _ in _elems(dst.kind)]), f"tile.fill {s.dst}, {em.expr(s.value)}"


def _tile_unary_lines(em: _Emitter, s: ir.TileUnary) -> tuple[_Tile, list[str], str]:
    if s.op not in _UNARY:
        raise EmitError(f"{_describe(s)}: unknown unary tile op {s.op!r}; known: {sorted(_UNARY)}")
    if s.op in ("gelu", "silu", "sigmoid"):
        em.use(s.op)
    dst = em.tile(s.dst, s)
    src = _operand(em, s, dst, s.src)
    lines = _assignments(dst, [_UNARY[s.op].format(src(c)) for c in _elems(dst.kind)])
    return dst, lines, f"tile.{s.op} {s.dst}, {s.src}"


def _tile_binary_lines(em: _Emitter, s: ir.TileBinary) -> tuple[_Tile, list[str], str]:
    if s.op not in _BINARY:
        raise EmitError(f"{_describe(s)}: unknown binary tile op {s.op!r}; known: {sorted(_BINARY)}")
    dst = em.tile(s.dst, s)
    lhs, rhs = _operand(em, s, dst, s.lhs), _operand(em, s, dst, s.rhs)
    lines = _assignments(dst, [_BINARY[s.op].format(lhs(c), rhs(c)) for c in _elems(dst.kind)])
    operands = ", ".join(o if isinstance(o, str) else em.expr(o) for o in (s.lhs, s.rhs))
    return dst, lines, f"tile.{s.op} {s.dst}, {operands}"


_ELEMENTWISE = {ir.TileFill: _tile_fill_lines, ir.TileUnary: _tile_unary_lines,
                ir.TileBinary: _tile_binary_lines}


def _elementwise_run(em: _Emitter, body: tuple[ir.Stmt, ...], i: int) -> int:
    """How many statements from body[i] on form one run of elementwise ops over one fragment
    space (the same destination kind and width)."""
    first = em.tile(body[i].dst, body[i])
    n = 1
    while i + n < len(body) and type(body[i + n]) in _ELEMENTWISE:
        t = em.role.tiles.get(body[i + n].dst) if em.role else None
        if t is None or (t.kind, t.cols) != (first.kind, first.cols):
            break
        n += 1
    return n


def _emit_elementwise(em: _Emitter, *run: ir.Stmt) -> None:
    """`tile.fill` / `tile.<unary>` / `tile.<binary>`, one statement or a fused run."""
    for s in run:
        _require_warpgroup(em, s)
    parts = [_ELEMENTWISE[type(s)](em, s) for s in run]
    dst = parts[0][0]
    em.line("// " + "; ".join(text for _, _, text in parts))
    with _fragment_loop(em, dst.kind, dst.cols):
        for _, lines, _ in parts:
            for ln in lines:
                em.line(ln)


def _emit_tile_reduce(em: _Emitter, s: ir.TileReduce) -> None:
    _require_warpgroup(em, s)
    src, dst = em.tile(s.src, s), em.tile(s.dst, s)
    if s.op not in ir.REDUCE_OPS:
        raise EmitError(f"{_describe(s)}: unknown reduction {s.op!r}")
    if s.axis != 1 or src.kind != _FULL or dst.kind != _COL:
        raise EmitError(f"{_describe(s)}: only axis(1) of a [64, N] tile into a [64, 1] tile is "
                        "implemented (a reduction over rows would cross warps)")
    init, combine = ("-INFINITY", "fmaxf(fr, {})") if s.op == "max" else ("0.0f", "fr + {}")
    # The 4 threads of a quad (lanes 4g .. 4g+3) hold the columns of the same two rows.
    with _fragment_loop(em, _COL, 1):
        em.line(f"float fr = {init};")
        with _fragment_loop(em, _ROW, src.cols):
            for c in (0, 1):
                em.line(f"fr = {combine.format(src.read(c))};")
        for lane_mask in (1, 2):
            em.line(f"fr = {combine.format(f'__shfl_xor_sync(0xffffffff, fr, {lane_mask})')};")
        _assign(em, dst, ["fr"])


def _emit_tile_mask(em: _Emitter, s: ir.TileMask) -> None:
    _require_warpgroup(em, s)
    t = em.tile(s.dst, s)
    if t.kind != _FULL:
        raise EmitError(f"{_describe(s)}: tile.mask needs a [64, N] tile; {t.name} is "
                        f"[{t.rows}, {t.cols}]")
    em.use("frag")
    limit = em.expr(s.limit)
    text = f"tile.mask {s.dst}, rows({em.expr(s.row0)}), cols({em.expr(s.col0)}), limit({limit})"
    if s.causal is not None:
        text += f" causal({em.expr(s.causal)})"
    with em.block(f"{{  // {text}"):
        # element (r, c) of the tile is at (row0 + r, col0 + c) of the score matrix
        em.line(f"const int row0 = {_paren(*em._expr(s.row0)[:2], 12)} + wsk::frag_row();")
        em.line(f"const int col0 = {_paren(*em._expr(s.col0)[:2], 12)} + wsk::frag_col();")
        causal = None if s.causal is None else _paren(*em._expr(s.causal)[:2], 12)
        limit = _paren(*em._expr(s.limit)[:2], 10)
        with _fragment_loop(em, _FULL, t.cols):
            em.line("const int row = row0 + 8 * fi;")
            em.line("const int col = col0 + 8 * fj;")
            values = []
            for c in (0, 1):
                col = f"col + {c}" if c else "col"
                cond = f"{col} >= {limit}" + (f" || {col} > row + {causal}" if causal else "")
                values.append(f"({cond}) ? -INFINITY : {t.read(c)}")
            for ln in _assignments(t, values):
                em.line(ln)


@dataclass(frozen=True)
class _Addressing:
    """Where a tile's fragment lies in a row-major global tensor (C++ texts)."""

    row0: str | None   # first row of this thread's fragment (None: a 1-D tensor)
    col0: str          # first column of this thread's fragment
    checks: tuple[str, ...]  # row (and leading coordinates) inside the tensor, reading `row`
    base: str          # element offset of (row, col0), reading `row`
    cols: str          # the tensor's innermost extent


def _global_addressing(em: _Emitter, s: ir.Stmt, p: ir.GlobalParam, t: _Tile,
                       coords: tuple[ir.Expr, ...]) -> _Addressing:
    rank = len(p.shape)
    if len(coords) != rank:
        raise EmitError(f"{_describe(s)}: {len(coords)} coordinates for {p.name}, a rank-{rank} tensor")
    if rank == 1 and t.rows != 1:
        raise EmitError(f"{_describe(s)}: a [{t.rows}, {t.cols}] tile does not fit the 1-D tensor {p.name}")
    dims = [_paren(text, prec, 13) for text, prec, _ in (em._expr(d) for d in p.shape)]

    def at(coord: ir.Expr, frag: str | None) -> str:
        text, prec, _ = em._expr(coord)
        return f"{_paren(text, prec, 12)} + {frag}" if frag else text

    checks, offsets = [], []
    for d in range(rank - 2):  # leading coordinates select one [rows, cols] matrix
        text, prec, _ = em._expr(coords[d])
        offsets.append(f"static_cast<long long>({text}) * {' * '.join(dims[d + 1:])}")
        checks.append(f"{_paren(text, prec, 10)} < {dims[d]}")
    row0 = None
    if rank >= 2:
        row0 = at(coords[-2], "wsk::frag_row()" if t.kind in (_FULL, _COL) else None)
        checks.insert(0, f"row < {dims[-2]}")
        offsets.append(f"static_cast<long long>(row) * {dims[-1]}")
    col0 = at(coords[-1], "wsk::frag_col()" if t.kind in (_FULL, _ROW) else None)
    return _Addressing(row0, col0, tuple(checks), " + ".join(offsets + ["col0"]), dims[-1])


def _global_loop(em: _Emitter, t: _Tile, a: _Addressing, p: ir.GlobalParam, writes: bool,
                 access: Callable[[str, str], str]) -> None:
    """Fragment loop of a tile load/store: rows outside (`row_ok`, and `ptr` = this thread's
    first element of the row: one 64-bit address per row, constant offsets per column),
    columns inside. `access(kind, ok)` spells the access of one fragment position at
    `ptr + 8 * fj`: kind "pair" (one 32/64-bit access, predicate `ok`), "split" (two element
    accesses, predicates `ok0, ok1`) or "one" (a column tile's element)."""
    em.use("global")
    if "wsk::frag_" in f"{a.row0} {a.col0}":
        em.use("frag")
    if a.row0 is not None:
        em.line(f"const int row0 = {a.row0};")
    em.line(f"const int col0 = {a.col0};")
    with _fragment_loop(em, _COL if t.kind in (_FULL, _COL) else _SCALAR, 1):
        if a.row0 is not None:
            em.line("const int row = row0 + 8 * fi;" if t.kind in (_FULL, _COL) else "const int row = row0;")
        em.line(f"const bool row_ok = {' && '.join(a.checks) or 'true'};")
        em.line(f"{'' if writes else 'const '}{_CTYPE[p.dtype]}* const ptr = {em.c(p.name)} + {a.base};")
        if t.kind not in (_FULL, _ROW):
            em.line(access("one", f"row_ok && col0 < {a.cols}"))
            return
        col = "col0 + 8 * fj"
        oks = f"row_ok && {col} < {a.cols}, row_ok && {col} + 1 < {a.cols}"
        # One branch per row, not per element: both sides are straight-line predicated code
        # (three predicated accesses per pair in one path would need three load destinations).
        em.line(f"if (wsk::pairs_aligned(ptr, {a.cols})) {{")
        em.depth += 1
        with _fragment_loop(em, _ROW, t.cols):
            em.line(access("pair", f"row_ok && {col} < {a.cols}"))
        em.depth -= 1
        em.line("} else {  // unaligned row or odd row length: element by element")
        em.depth += 1
        with _fragment_loop(em, _ROW, t.cols):
            em.line(access("split", oks))
        em.depth -= 1
        em.line("}")


def _emit_tile_load_global(em: _Emitter, s: ir.TileLoadGlobal) -> None:
    _require_warpgroup(em, s)
    t = em.tile(s.dst, s)
    p = em.global_param(s.tensor, s)
    def access(kind: str, ok: str) -> str:
        if kind == "one":
            load = f"wsk::load_one(ptr, {ok})"
            if t.dtype == p.dtype:
                return f"{t.index(0)} = {load};"
            return _assignments(t, [_TO_FLOAT[p.dtype].format(load)])[0]
        return _pair_assign(t, p, f"wsk::load_{kind}(ptr + 8 * fj, {ok})")

    with em.block(f"{{  // tile.load {t.name} <- {p.name}[{_coords_text(em, s.coords)}], zero outside"):
        _global_loop(em, t, _global_addressing(em, s, p, t, s.coords), p, False, access)


def _pair_assign(t: _Tile, p: ir.GlobalParam, load: str) -> str:
    """`t at (fj, fi) = the loaded pair`, converting element-wise when the dtypes differ."""
    if t.packed and t.dtype == p.dtype:
        return f"{t.index()} = {load};"
    if not t.packed and t.dtype == p.dtype == "f32":
        return f"{{ const float2 v = {load}; {t.index(0)} = v.x; {t.index(1)} = v.y; }}"
    values = [_TO_FLOAT[p.dtype].format(f"v.{xy}") for xy in "xy"]
    return f"{{ const {_CPAIR[p.dtype]} v = {load}; {' '.join(_assignments(t, values))} }}"


def _emit_tile_store_global(em: _Emitter, s: ir.TileStoreGlobal) -> None:
    _require_warpgroup(em, s)
    t = em.tile(s.src, s)
    p = em.global_param(s.tensor, s)
    value = t.index() if t.packed and t.dtype == p.dtype else _PACK[p.dtype].format(t.read(0), t.read(1))

    def access(kind: str, ok: str) -> str:
        if kind == "one":
            one = t.index(0) if t.dtype == p.dtype else _FROM_FLOAT[p.dtype].format(t.read(0))
            return f"if ({ok}) *ptr = {one};"
        return f"wsk::store_{kind}(ptr + 8 * fj, {ok}, {value});"

    # Row (column) tiles are replicated over the threads sharing columns (rows): one copy stores.
    owner = {_ROW: "threadIdx.x % 128 < 4", _COL: "threadIdx.x % 4 == 0",
             _SCALAR: "threadIdx.x % 128 == 0"}.get(t.kind)
    head = f"if ({owner}) {{" if owner else "{"
    with em.block(f"{head}  // tile.store {p.name}[{_coords_text(em, s.coords)}] <- {t.name}, "
                  "bounds-checked"):
        _global_loop(em, t, _global_addressing(em, s, p, t, s.coords), p, True, access)


def _coords_text(em: _Emitter, coords: tuple[ir.Expr, ...]) -> str:
    return ", ".join(em.expr(c) for c in coords)


def _ref_text(em: _Emitter, ref: ir.SmemRef) -> str:
    return f"{ref.buffer}[{_coords_text(em, ref.index)}]" if ref.index else ref.buffer


def _emit_tile_store_smem(em: _Emitter, s: ir.TileStoreSmem) -> None:
    _require_warpgroup(em, s)
    t = em.tile(s.src, s)
    ptr, decl, sub = em.smem_ref(s.dst)
    if t.kind != _FULL:
        raise EmitError(f"{_describe(s)}: only [64, N] tiles are stored to shared memory")
    rows, cols = ir.tile_shape_of_subarray(sub)
    if (rows, cols) != (t.rows, t.cols):
        raise EmitError(f"{_describe(s)}: tile {t.name} [{t.rows}, {t.cols}] does not match the "
                        f"smem sub-array {list(sub)} ([{rows}, {cols}])")
    b = ir.DTYPE_BYTES[decl.dtype]
    value = t.index() if t.packed and t.dtype == decl.dtype else \
        _PACK[decl.dtype].format(t.read(0), t.read(1))
    bits = "uint32_t" if b == 2 else "uint2"
    em.use("frag")
    em.use("shared")
    with em.block(f"{{  // tile.store_smem {_ref_text(em, s.dst)} <- {t.name}: one st.shared per "
                  "pair (stmatrix is a later optimisation)"):
        # The pair (fj, fi) sits at row frag_row() + 8 fi, column frag_col() + 8 fj: in chunk
        # fj / (W/8) (R rows of 128 bytes), byte (frag_col() + 8 (fj % (W/8))) * b of its row.
        if decl.swizzle == 128 and b in (2, 4) and sub[-1] * b == 128:
            per_chunk = sub[-1] // 8
            em.line(f"const uint32_t row_addr = wsp::smem_u32({ptr}) + wsk::frag_row() * 128 + "
                    f"wsk::frag_col() * {b};")
            offset = f"1024 * fi + {rows * 128} * (fj / {per_chunk}) + {8 * b} * (fj % {per_chunk})"
            address = f"wsk::swizzle128(row_addr + {offset})"
        elif decl.swizzle == 0 and len(sub) == 2:
            em.line(f"const uint32_t row_addr = wsp::smem_u32({ptr}) + "
                    f"(wsk::frag_row() * {cols} + wsk::frag_col()) * {b};")
            address = f"row_addr + {8 * cols * b} * fi + {8 * b} * fj"
        else:
            raise EmitError(f"{_describe(s)}: tile stores into swizzle({decl.swizzle}) "
                            f"{decl.dtype} buffers of shape {list(sub)} are not implemented "
                            "(128-byte-swizzled rows of 16/32-bit elements, or unswizzled 2-D)")
        with _fragment_loop(em, _FULL, t.cols):
            em.line(f"wsk::st_shared({address}, wsk::bit_cast<{bits}>({value}));")


EMITTERS: dict[type, Callable[[_Emitter, ir.Stmt], None]] = {
    ir.Let: _emit_let,
    ir.Assign: _emit_assign,
    ir.For: _emit_for,
    ir.If: _emit_if,
    ir.Role: _emit_role,
    ir.ElectOne: _emit_elect_one,
    ir.Return: _emit_return,
    ir.Setmaxnreg: _emit_setmaxnreg,
    ir.MbarrierInit: _emit_mbarrier_init,
    ir.MbarrierArrive: _emit_mbarrier_arrive,
    ir.MbarrierArriveExpectTx: _emit_mbarrier_arrive_expect_tx,
    ir.MbarrierWait: _emit_mbarrier_wait,
    ir.MbarrierInval: _emit_mbarrier_inval,
    ir.FenceMbarrierInit: _emit_fence_mbarrier_init,
    ir.FenceProxyAsync: _emit_fence_proxy_async,
    ir.SyncThreads: _emit_syncthreads,
    ir.NamedBarrierSync: _emit_named_barrier_sync,
    ir.NamedBarrierArrive: _emit_named_barrier_arrive,
    ir.TmaLoad: _emit_tma_load,
    ir.TmaStore: _emit_tma_store,
    ir.TmaCommit: _emit_tma_commit,
    ir.TmaWait: _emit_tma_wait,
    ir.WgmmaFence: _emit_wgmma_fence,
    ir.Wgmma: _emit_wgmma,
    ir.WgmmaCommit: _emit_wgmma_commit,
    ir.WgmmaWait: _emit_wgmma_wait,
    ir.RegDecl: _emit_reg_decl,
    ir.TileFill: _emit_elementwise,
    ir.TileUnary: _emit_elementwise,
    ir.TileBinary: _emit_elementwise,
    ir.TileReduce: _emit_tile_reduce,
    ir.TileMask: _emit_tile_mask,
    ir.TileLoadGlobal: _emit_tile_load_global,
    ir.TileStoreGlobal: _emit_tile_store_global,
    ir.TileStoreSmem: _emit_tile_store_smem,
}


# ---------------------------------------------------------------------------------------------
# The whole file
# ---------------------------------------------------------------------------------------------


def _cpp_names(kernel: ir.Kernel) -> dict[str, str]:
    """C++ spelling of every name the IR declares (parameters, lets, loop variables, register
    tiles): the IR name itself, or with a trailing underscore where it would clash with a C++
    keyword or a name the emitter uses (`v`, `ptr`, `min`, `smem_A`, `full_bar`, ...)."""
    declared = [p.name for p in kernel.params]
    for s in ir.walk(kernel.body):
        if isinstance(s, (ir.Let, ir.RegDecl)):
            declared.append(s.name)
        elif isinstance(s, ir.For):
            declared.append(s.var)
    taken = set(_RESERVED) | set(ir.BUILTINS) | {f"smem_{b.name}" for b in kernel.smem}
    taken |= {f"{b.name}_bar" for b in kernel.barriers}
    names: dict[str, str] = {}
    for n in dict.fromkeys(declared):
        if not n.isidentifier():
            raise EmitError(f"the IR name {n!r} is not a C identifier")
        cpp = n
        while cpp in taken or cpp.startswith(("wgmma_", "wsp", "wsk", "__")):
            cpp += "_"
        names[n] = cpp
    return names


def _param_decl(em: _Emitter, p: ir.Param) -> str:
    if isinstance(p, ir.TensorMapParam):
        return f"const __grid_constant__ CUtensorMap {em.c(p.name)}"
    if isinstance(p, ir.GlobalParam):
        return f"{_CTYPE[p.dtype]}* __restrict__ {em.c(p.name)}"
    if isinstance(p, ir.ScalarParam):
        if p.dtype not in ("i32", "f32"):
            raise EmitError(f"scalar parameter {p.name}: dtype {p.dtype} (i32 or f32)")
        return f"{_CTYPE[p.dtype]} {em.c(p.name)}"
    raise EmitError(f"no CUDA spelling for parameter {p!r}")


def _header(kernel: ir.Kernel, em: _Emitter) -> list[str]:
    roles, first = [], 0
    for r in kernel.roles():
        wgs = f"warpgroup {first}" if r.warpgroups == 1 else f"warpgroups {first}-{first + r.warpgroups - 1}"
        roles.append(f"{r.name} ({wgs}, {r.registers} registers)")
        first += r.warpgroups
    grid = _host_expr(em, kernel.grid)
    out = [
        f"// {kernel.name}: warp-specialized kernel generated by wsched.codegen.emit from the loop IR.",
        "//",
        f"//   launch    grid {grid}, block {kernel.threads} threads, cluster "
        f"{'x'.join(map(str, kernel.cluster))}, {kernel.smem_bytes} bytes dynamic shared memory",
        f"//   roles     {'; '.join(roles) if roles else '(none)'}",
    ]
    for buf in kernel.smem:
        out.append(f"//   smem      {buf.name}: {buf.dtype}{list(buf.shape)} swizzle({buf.swizzle}) "
                   f"at +{em.smem_offsets[buf.name]} ({buf.nbytes} bytes)")
    for b in kernel.barriers:
        inits = [s.arrivals for s in ir.walk(kernel.body)
                 if isinstance(s, ir.MbarrierInit) and s.barrier == b.name]
        arrivals = f", {inits[0]} arrival{'s' if inits[0] != 1 else ''}" if inits else ""
        out.append(f"//   barrier   {b.name}[{b.slots}] at +{em.barrier_offsets[b.name]}{arrivals}")
    return out


def _host_expr(em: _Emitter, e: ir.Expr) -> str:
    """A host-side expression (the grid) for the header comment: num_sms allowed, no helpers."""
    saved = set(em.helpers)
    em.host = True
    try:
        return em.expr(e)
    finally:
        em.host, em.helpers = False, saved


def emit_kernel(kernel: ir.Kernel) -> EmittedKernel:
    """The CUDA C++ source of `kernel` (sm_90a), with its launch facts."""
    em = _Emitter(kernel)
    for p in kernel.params:
        if isinstance(p, ir.ScalarParam):
            em.scope.declare(p.name, _CTYPE[p.dtype] if p.dtype in _CTYPE else "int")
        else:
            em.scope.declare(p.name, "tensor")

    # setup: shared memory carve-up in the layout ir.Kernel.smem_bytes assumes
    em.line("// setup")
    em.line("extern __shared__ __align__(1024) uint8_t wsp_smem_raw[];")
    em.line("// the dynamic smem base, aligned up to 1024 bytes (128B-swizzle atoms need it)")
    em.line("uint8_t* const smem = reinterpret_cast<uint8_t*>("
            "(reinterpret_cast<uintptr_t>(wsp_smem_raw) + 1023) & ~uintptr_t(1023));")
    for buf in kernel.smem:
        em.line(f"uint8_t* const smem_{buf.name} = smem + {em.smem_offsets[buf.name]};"
                f"  // {buf.dtype}{list(buf.shape)} swizzle({buf.swizzle})")
    for b in kernel.barriers:
        em.line(f"uint64_t* const {b.name}_bar = reinterpret_cast<uint64_t*>("
                f"smem + {em.barrier_offsets[b.name]});  // {b.slots} mbarriers")
    if em.uses_builtin["cta_id"]:
        em.line("const int cta_id = blockIdx.x;")
    if em.uses_builtin["num_ctas"]:
        em.line("const int num_ctas = gridDim.x;")
    em.stmts(kernel.body)
    em.close_guard()
    body = em.lines

    out = _header(kernel, em)
    out += ["", '#include "wsched.cuh"', "#include <cuda_bf16.h>", "#include <cuda_fp16.h>", ""]
    for text in em.wgmma.values():
        out += text.rstrip("\n").split("\n") + [""]
    helpers = [name for name in _HELPERS if name in em.helpers]
    if helpers:
        if "ceil_div" in em.helpers:
            out += [_HELPERS["ceil_div"], ""]
        rest = [h for h in helpers if h != "ceil_div"]
        if rest:
            out.append("namespace wsk {")
            for name in rest:
                out += [_HELPERS[name], ""]
            out[-1] = "}  // namespace wsk"
            out.append("")
    out.append(f'extern "C" __global__ void __launch_bounds__({kernel.threads}, 1) {kernel.name}(')
    decls = [_param_decl(em, p) for p in kernel.params]
    out += [f"    {d}{',' if i + 1 < len(decls) else ') {'}" for i, d in enumerate(decls)]
    if not decls:
        out[-1] += ") {"
    out += body
    out.append("}")
    return EmittedKernel(source="\n".join(out) + "\n", name=kernel.name, threads=kernel.threads,
                         smem_bytes=kernel.smem_bytes, params=tuple(kernel.params))
