"""The Hopper (sm_90a) target: every hardware limit, shape rule, element-type and op table the
compiler relies on, in one module.

The schedule, the partition, the verifier, the simulator, the emitter and the launcher import
these names; none of them writes a limit or a table of its own. Sources: the PTX ISA
(wgmma, setmaxnreg, mbarrier, cp.async.bulk.tensor), the CUDA driver API
(`cuTensorMapEncodeTiled`), and the sm_90 occupancy limits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .dtypes import DTYPES, DType

if TYPE_CHECKING:
    import torch as _torch

ARCH = "sm_90a"

INT_MIN, INT_MAX = -2**31, 2**31 - 1   # the CUDA `int` every IR integer is emitted as

# --- one streaming multiprocessor / one CTA ----------------------------------------------------
SMEM_LIMIT = 232448          # bytes of dynamic shared memory one CTA may use (227 KB)
SMEM_ALIGN = 1024            # every buffer starts on this boundary (128-byte swizzle atoms need it)
SMEM_BASE_SLACK = 1024       # bytes spent aligning the dynamic shared memory base itself
BARRIER_BYTES = 8            # one mbarrier
REGISTER_FILE = 65536        # 32-bit registers per SM
MAX_THREADS = 1024           # threads per CTA
WARP_THREADS = 32
WARPGROUP_THREADS = 128      # four warps: the unit of wgmma, setmaxnreg and our roles
NAMED_BARRIERS = 16          # bar.sync ids 0..15 (0 is __syncthreads)

# --- setmaxnreg ----------------------------------------------------------------------------------
SETMAXNREG_MIN = 24
SETMAXNREG_MAX = 256
SETMAXNREG_STEP = 8

# --- wgmma ---------------------------------------------------------------------------------------
WGMMA_M = 64                             # rows of one wgmma (one warpgroup)
WGMMA_K = 16                             # k extent of one bf16/f16 wgmma
WGMMA_N = tuple(range(8, 257, 8))        # the n extents wgmma.mma_async accepts
WGMMA_OPERAND_DTYPES = ("bf16", "f16")   # A and B element types (accumulating in f32)
WGMMA_ACCUMULATOR_DTYPE = "f32"
FRAGMENT_COLUMN_GROUP = 8                # accumulator columns 8j .. 8j+7 of a row: one thread quad's pairs

# --- TMA (cp.async.bulk.tensor and cuTensorMapEncodeTiled, interleave NONE) ------------------------
TMA_MAX_RANK = 5
TMA_GLOBAL_ADDRESS_ALIGNMENT = 16        # bytes
TMA_STRIDE_ALIGNMENT = 16                # bytes, global strides of dims 1..rank-1
TMA_MAX_GLOBAL_DIM = 2**32
TMA_MAX_STRIDE_BYTES = 2**40             # exclusive
TMA_MAX_BOX_DIM = 256
TMA_INNER_BOX_ALIGNMENT = 16             # bytes of the innermost box extent
TMA_SMEM_ALIGNMENT = 128                 # bytes, the shared-memory address of a tensor copy
TMA_SWIZZLES = (0, 32, 64, 128)          # swizzle spans in bytes; the inner box row must fit in it
# Rows (byte strides of dims 1..rank-1) on a multiple of this are read by TMA at full speed; rows
# only 16- or 32-byte aligned are not. H100, 4096^3 bf16 matmul with row strides padded by 8 / 16 /
# 32 elements (16 / 32 / 64 bytes off a 128-byte boundary), cuBLAS 181-188 us throughout: the default
# kernel 321 / 212 / 184 us with 256-byte L2 promotion, 269 / 199 / 184 with 128-byte promotion,
# and 192 / 189 / 183 in clusters of 2 CTAs along M sharing B by multicast (2026-11-24; the map's
# promotion: codegen/tma.py, the per-call choice: MatmulWorkload.variants).
TMA_FAST_ROW_ALIGNMENT = 64              # bytes
SWIZZLE_ROW_BYTES = 128                  # the 128-byte swizzle the operand layouts use
# wgmma operand layouts in shared memory: rows (or column chunks) of one swizzle span, swizzled
# with it; 128 bytes where the extent allows (64 x 16-bit), 64 bytes where it is a multiple of
# 32 values only (attention's head dim 96: three chunks of 32).
OPERAND_SWIZZLES = (SWIZZLE_ROW_BYTES, 64)
# A swizzle pattern repeats every 8 rows (its atom: 8 x the span), so a TMA box that fills part of
# a swizzled operand tile (a paged cache's page) starts, and spans, a multiple of 8 rows.
PAGE_ROWS_ALIGN = 8


# --- element types -------------------------------------------------------------------------------
@dataclass(frozen=True)
class ElementType:
    """What every stage of the compiler needs to know about one element type.

    `cuda` is the C++ scalar type, `cuda_pair` the two-element vector type (None where the
    emitter never packs), `to_float` / `from_float` / `pack` the C++ conversions (format strings),
    `tma` the `CU_TENSOR_MAP_DATA_TYPE_*` member name (None: TMA maps are not built for it)."""

    dtype: DType
    cuda: str
    cuda_pair: str | None
    to_float: str | None
    from_float: str | None
    pack: str | None
    tma: str | None

    @property
    def name(self) -> str:
        return self.dtype.name

    @property
    def bytes(self) -> int:
        return self.dtype.itemsize

    @property
    def torch(self) -> _torch.dtype:
        return self.dtype.torch_dtype


_BY_NAME = {d.name: d for d in DTYPES}
ELEMENT_TYPES: dict[str, ElementType] = {
    "bf16": ElementType(_BY_NAME["bf16"], "__nv_bfloat16", "__nv_bfloat162", "__bfloat162float({})",
                        "__float2bfloat16_rn({})", "__floats2bfloat162_rn({}, {})",
                        "CU_TENSOR_MAP_DATA_TYPE_BFLOAT16"),
    "f16": ElementType(_BY_NAME["f16"], "__half", "__half2", "__half2float({})", "__float2half_rn({})",
                       "__floats2half2_rn({}, {})", "CU_TENSOR_MAP_DATA_TYPE_FLOAT16"),
    "f32": ElementType(_BY_NAME["f32"], "float", "float2", "{}", "{}", "make_float2({}, {})",
                       "CU_TENSOR_MAP_DATA_TYPE_FLOAT32"),
    # i32: ids and positions of attention score functions (document ids, per-key positions), read
    # into i32 register tiles (exact integers: docs/ir.md "Integer tiles") or converted into f32 ones;
    # a float written into an i32 tile is truncated toward zero (C's conversion); never stored
    "i32": ElementType(_BY_NAME["i32"], "int", "int2", "static_cast<float>({})", "__float2int_rz({})", None, None),
}
DTYPE_NAMES = tuple(ELEMENT_TYPES)                                   # IR element types
DTYPE_BYTES = {name: t.bytes for name, t in ELEMENT_TYPES.items()}
TORCH_DTYPES = {name: t.torch for name, t in ELEMENT_TYPES.items()}
FLOAT_DTYPES = tuple(n for n, t in ELEMENT_TYPES.items() if t.dtype.is_float)   # tensors a kernel stores
REGISTER_DTYPES = FLOAT_DTYPES + ("i32",)                          # register tiles (i32: INT_TILE_OPS)
TMA_DTYPES = tuple(n for n, t in ELEMENT_TYPES.items() if t.tma)
DTYPE_OF_TORCH = {t.torch: name for name, t in ELEMENT_TYPES.items()}

# --- ops a consumer warpgroup runs on register tiles ------------------------------------------------
# Elementwise ops computed in fp32 and rounded to the destination tile's dtype: the DSL ops a
# matmul epilogue fuses are exactly these, and the IR's tile.<op> spellings are their names.
UNARY_OPS = ("neg", "exp", "exp2", "log", "relu", "gelu", "silu", "sigmoid", "tanh", "cast")
# Unary tile ops the compiler emits but the DSL does not offer: exp2_ftz, 2^x with a result below
# 2^-126 flushed to 0 (one ex2.approx.ftz on the GPU: the softmax's exponential, docs/ir.md).
KERNEL_UNARY_OPS = ("exp2_ftz",)
TILE_UNARY_OPS = UNARY_OPS + KERNEL_UNARY_OPS
BINARY_OPS = ("add", "sub", "mul", "div", "maximum", "minimum")
# What computes into an i32 register tile, in 32-bit integer arithmetic (wrapping, as torch's
# int32): tile.fill, tile.iota, tile.select, tile.load of an i32 tensor and these ops.
INT_TILE_OPS = ("neg", "cast", "add", "sub", "mul", "maximum", "minimum")
ELEMENTWISE_OPS = UNARY_OPS + BINARY_OPS
# Comparisons and logic of attention score masks (`j <= i`, `(j <= i) & (i - j < W)`): tile ops
# like BINARY_OPS (`tile.le m, j_t, i_t`) whose result is 1.0 where true and 0.0 where false;
# `tile.select` picks by it.
COMPARE_OPS = ("lt", "le", "gt", "ge", "eq", "ne", "logical_and", "logical_or")
REDUCE_OPS = ("sum", "max")                 # row reductions of a register tile


def smem_round(nbytes: int) -> int:
    """`nbytes` rounded up to the shared-memory buffer alignment."""
    return -(-nbytes // SMEM_ALIGN) * SMEM_ALIGN


# --- kernel launch (cuLaunchKernel / cuLaunchKernelEx) ------------------------------------------------
MAX_GRID = (2**31 - 1, 65535, 65535)     # grid extents x, y, z
HOPPER_SMS = 132                         # SMs of an H100 / H200 SXM: a wave of a persistent grid
                                         # (compile-time heuristics; launches use the device's count)
MAX_PORTABLE_CLUSTER = 8                 # CTAs in a cluster without the non-portable-size opt-in

# --- mbarrier (mbarrier.init / mbarrier.expect_tx) ------------------------------------------------
MBARRIER_MAX_ARRIVALS = 2**20 - 1        # the arrival count of one phase, set by mbarrier.init
MBARRIER_MAX_TX_BYTES = 2**20 - 1        # the transaction count (bytes) one phase may expect

# --- registers at launch (__launch_bounds__(threads, 1): one CTA per SM) ------------------------------
MAX_THREAD_REGISTERS = 255               # registers one thread can address


def launch_registers(threads: int) -> int:
    """Per-thread registers each warp holds when a CTA of `threads` threads starts: its share of
    the register file, in setmaxnreg's steps (384 threads: 168). setmaxnreg.dec lowers a warp from
    there and setmaxnreg.inc raises it; ptxas starts a kernel lower, at its largest .inc target,
    when that target is below this share."""
    return min(REGISTER_FILE // threads, MAX_THREAD_REGISTERS) // SETMAXNREG_STEP * SETMAXNREG_STEP


def register_pool(threads: int) -> int:
    """The registers a CTA of `threads` threads holds: its launch share per thread x threads (384
    threads: 168 x 384 = 64512, not the 65536 of the register file). setmaxnreg moves registers
    within this per-CTA pool: .dec returns a warp's registers to it, .inc takes from it and blocks
    until it holds enough (PTX ISA, setmaxnreg). Budgets that add up to more than the pool leave
    the consumers' .inc waiting forever: the kernel hangs (128 x 32 + 256 x 240 = 65536 did, on an
    H100)."""
    return launch_registers(threads) * threads
