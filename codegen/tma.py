"""TMA tensor maps: our own validation in front of cuTensorMapEncodeTiled.

The driver answers every broken tensor map with CUDA_ERROR_INVALID_VALUE and nothing else
(e.g. for a 256-byte inner box with 128B swizzle). So a `TensorMapSpec` — written the way torch
and the rest of wsched think, outermost dimension first, strides in elements — is checked here
against every rule of the driver documentation (the limits are `wsched.target`'s TMA_*; see
docs/architecture.md), and a failure names the kernel parameter, the rule, the offending value
and what would be right. Only then is it
turned around for the driver (innermost first, byte strides without the innermost one) and
encoded.

Fixed choices for every map: interleave NONE, element strides all 1, out-of-bounds fill NONE
(out-of-bounds elements read as zero — partial tiles rely on it). L2 promotion is 256B where every
row of the tensor starts on a `TMA_FAST_ROW_ALIGNMENT` (64-byte) boundary and 128B where rows do
not (`rows_aligned`: on such rows 256B promotion made a matmul's loads a fifth slower again).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from cuda.bindings import driver

from wsched.target import (DTYPE_BYTES, DTYPE_OF_TORCH, ELEMENT_TYPES, TMA_DTYPES, TMA_GLOBAL_ADDRESS_ALIGNMENT,
                           TMA_INNER_BOX_ALIGNMENT, TMA_MAX_BOX_DIM, TMA_MAX_GLOBAL_DIM, TMA_MAX_RANK,
                           TMA_FAST_ROW_ALIGNMENT, TMA_MAX_STRIDE_BYTES, TMA_STRIDE_ALIGNMENT, TMA_SWIZZLES,
                           TORCH_DTYPES)

from .cuda_driver import CudaError, check_cuda, torch_context
from .launch import check_tensor

__all__ = [
    "TensorMapError",
    "TensorMapSpec",
    "describe_tensor_map",
    "driver_arguments",
    "encode_tensor_map",
    "row_alignment",
    "spec_for_tensor",
    "tensor_map_for",
    "validate_tensor_map",
]


class TensorMapError(ValueError):
    """A tensor map breaks a TMA rule (or the driver refused one that passed our checks)."""


@dataclass(frozen=True)
class TensorMapSpec:
    name: str                 # kernel parameter name, used in messages
    dtype: str                # "bf16" | "f16" | "f32"
    shape: tuple[int, ...]    # global shape, outermost first (torch order)
    strides: tuple[int, ...]  # element strides, outermost first; innermost must be 1
    box: tuple[int, ...]      # box (tile) extents, outermost first
    swizzle: int              # 0, 32, 64 or 128 (bytes)


_SWIZZLES = {  # the driver's spelling of each swizzle span
    span: getattr(driver.CUtensorMapSwizzle, f"CU_TENSOR_MAP_SWIZZLE_{span}B" if span else
                  "CU_TENSOR_MAP_SWIZZLE_NONE")
    for span in TMA_SWIZZLES
}
_INTERLEAVE = driver.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE
_L2_PROMOTION = {True: driver.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,    # rows aligned
                 False: driver.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_128B}
_OOB_FILL = driver.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE


def _data_type(dtype: str) -> driver.CUtensorMapDataType:
    """The driver's data type of a TMA element type; KeyError for any other dtype."""
    if dtype not in TMA_DTYPES:
        raise KeyError(dtype)
    return getattr(driver.CUtensorMapDataType, ELEMENT_TYPES[dtype].tma)


def _fail(spec: TensorMapSpec, rule: str, got: str, fix: str) -> TensorMapError:
    return TensorMapError(f"tensor map '{spec.name}': {rule}; got {got} — {fix}")


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def validate_tensor_map(spec: TensorMapSpec, data_ptr: int) -> None:
    """Raise TensorMapError for the first TMA rule `spec` at `data_ptr` breaks."""
    if spec.dtype not in TMA_DTYPES:
        raise _fail(spec, f"dtype must be one of {', '.join(TMA_DTYPES)}", repr(spec.dtype),
                    "TMA maps are only built for these element types")
    element = DTYPE_BYTES[spec.dtype]

    rank = len(spec.shape)
    if not 1 <= rank <= TMA_MAX_RANK:
        raise _fail(spec, f"rank must be between 1 and {TMA_MAX_RANK}", f"rank {rank} (shape {spec.shape})",
                    f"merge or split dimensions so the tensor has 1 to {TMA_MAX_RANK}")
    if not len(spec.strides) == len(spec.box) == rank:
        raise _fail(spec, "shape, strides and box must have one entry per dimension",
                    f"shape {spec.shape}, strides {spec.strides}, box {spec.box}",
                    f"give {rank} strides and {rank} box extents, outermost first")
    for field in ("shape", "strides", "box"):
        values = getattr(spec, field)
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
            raise _fail(spec, f"{field} entries must be ints", repr(values), "pass plain Python ints")
    if spec.swizzle not in _SWIZZLES:
        raise _fail(spec, "swizzle must be 0, 32, 64 or 128 bytes", repr(spec.swizzle),
                    "pick one of the four swizzle spans")

    for dim, extent in enumerate(spec.shape):
        if not 1 <= extent <= TMA_MAX_GLOBAL_DIM:
            raise _fail(spec, "global dims must be in [1, 2^32]", f"shape[{dim}] = {extent}",
                        "empty tensors cannot be mapped; larger ones must be split")

    if not isinstance(data_ptr, int) or isinstance(data_ptr, bool):
        raise _fail(spec, "global address must be an int", type(data_ptr).__name__,
                    "pass tensor.data_ptr()")
    if data_ptr == 0:
        raise _fail(spec, "global address must not be null", "0x0", "pass the tensor's data_ptr()")
    if data_ptr % TMA_GLOBAL_ADDRESS_ALIGNMENT:
        raise _fail(spec, f"global address must be {TMA_GLOBAL_ADDRESS_ALIGNMENT}-byte aligned",
                    f"{data_ptr:#x} ({data_ptr % TMA_GLOBAL_ADDRESS_ALIGNMENT} bytes past a boundary)",
                    "a view starting mid-row must be copied (.contiguous() / .clone())")

    if spec.strides[-1] != 1:
        raise _fail(spec, "innermost stride must be 1 element", f"strides {spec.strides}",
                    "make the last dimension contiguous (.contiguous())")
    for dim in range(rank - 1):  # the innermost stride is implicit (one element)
        stride_bytes = spec.strides[dim] * element
        if stride_bytes <= 0:
            # The driver encodes a 0 stride, but what TMA loads from one is unverified: refuse.
            raise _fail(spec, "global strides must be positive", f"strides[{dim}] = {spec.strides[dim]}",
                        "wsched does not map broadcast (expanded) dimensions — call .contiguous()")
        if stride_bytes % TMA_STRIDE_ALIGNMENT:
            padded = _round_up(stride_bytes, TMA_STRIDE_ALIGNMENT)
            raise _fail(spec, f"global strides must be multiples of {TMA_STRIDE_ALIGNMENT} bytes",
                        f"strides[{dim}] = {spec.strides[dim]} elements = {stride_bytes} bytes",
                        f"pad that stride to {padded // element} elements ({padded} bytes)")
        if stride_bytes >= TMA_MAX_STRIDE_BYTES:
            raise _fail(spec, "global strides must be below 2^40 bytes",
                        f"strides[{dim}] = {spec.strides[dim]} elements = {stride_bytes} bytes",
                        "split the tensor into smaller pieces")

    for dim, extent in enumerate(spec.box):
        if not 1 <= extent <= TMA_MAX_BOX_DIM:
            raise _fail(spec, f"box dims must be in [1, {TMA_MAX_BOX_DIM}]", f"box[{dim}] = {extent}",
                        f"tile that dimension with several boxes of at most {TMA_MAX_BOX_DIM}")
    inner_bytes = spec.box[-1] * element
    if inner_bytes % TMA_INNER_BOX_ALIGNMENT:
        fixed = _round_up(inner_bytes, TMA_INNER_BOX_ALIGNMENT) // element
        raise _fail(spec, f"inner box extent must be a multiple of {TMA_INNER_BOX_ALIGNMENT} bytes",
                    f"box[-1] = {spec.box[-1]} {spec.dtype} = {inner_bytes} bytes",
                    f"use a multiple of {TMA_INNER_BOX_ALIGNMENT // element} elements, e.g. {fixed}")
    if spec.swizzle and inner_bytes > spec.swizzle:
        limit = spec.swizzle // element
        raise _fail(spec, "inner box extent must not exceed the swizzle span",
                    f"box[-1] = {spec.box[-1]} {spec.dtype} = {inner_bytes} bytes with {spec.swizzle}B swizzle",
                    f"use box[-1] <= {limit} {spec.dtype} and load the rest of the row with more boxes")


def row_alignment(shape: Sequence[int], strides: Sequence[int], element_bytes: int) -> int:
    """The largest power of two, up to 128 bytes, that divides every row of a tensor: each byte
    stride of its dims but the innermost, of the dims whose extent is above 1 (128 for one row)."""
    align = 128
    for size, stride in zip(shape[:-1], strides[:-1]):
        if size > 1:
            align = min(align, (stride * element_bytes) & -(stride * element_bytes) or 128)
    return align


def rows_aligned(spec: TensorMapSpec) -> bool:
    """Whether every row of the map starts on a TMA_FAST_ROW_ALIGNMENT boundary."""
    return row_alignment(spec.shape, spec.strides, DTYPE_BYTES[spec.dtype]) >= TMA_FAST_ROW_ALIGNMENT


def driver_arguments(spec: TensorMapSpec) -> dict[str, object]:
    """cuTensorMapEncodeTiled's arguments for `spec`, as plain ints: innermost dimension first,
    byte strides of dimensions 1..rank-1 only (the innermost one is implicitly one element)."""
    data_type, element = _data_type(spec.dtype), DTYPE_BYTES[spec.dtype]
    rank = len(spec.shape)
    return {
        "tensorDataType": data_type,
        "tensorRank": rank,
        "globalDim": list(reversed(spec.shape)),
        "globalStrides": [spec.strides[dim] * element for dim in reversed(range(rank - 1))],
        "boxDim": list(reversed(spec.box)),
        "elementStrides": [1] * rank,
        "interleave": _INTERLEAVE,
        "swizzle": _SWIZZLES[spec.swizzle],
        "l2Promotion": _L2_PROMOTION[rows_aligned(spec)],
        "oobFill": _OOB_FILL,
    }


def describe_tensor_map(spec: TensorMapSpec, data_ptr: int) -> str:
    """Every parameter of the encode, both in torch order and as the driver receives it."""
    lines = [
        f"  spec (outermost first): dtype={spec.dtype} shape={spec.shape} strides={spec.strides} "
        f"box={spec.box} swizzle={spec.swizzle}",
        f"  globalAddress = {data_ptr:#x}" if isinstance(data_ptr, int) else f"  globalAddress = {data_ptr!r}",
    ]
    try:
        arguments = driver_arguments(spec)
    except (KeyError, TypeError) as error:
        lines.append(f"  (driver arguments unavailable: {error!r})")
        return "\n".join(lines)
    for key, value in arguments.items():
        lines.append(f"  {key} = {getattr(value, 'name', value)}")
    return "\n".join(lines)


def encode_tensor_map(spec: TensorMapSpec, data_ptr: int, device: object = None) -> driver.CUtensorMap:
    """Validate `spec`, then encode it with cuTensorMapEncodeTiled in the primary context of
    `device`, the device `data_ptr` lives on (a map names one device's memory: callers cache
    maps per device, as CompiledKernel does by argument layout and device)."""
    validate_tensor_map(spec, data_ptr)
    a = driver_arguments(spec)
    with torch_context(device):
        result = driver.cuTensorMapEncodeTiled(
            a["tensorDataType"],
            a["tensorRank"],
            data_ptr,
            [driver.cuuint64_t(x) for x in a["globalDim"]],
            [driver.cuuint64_t(x) for x in a["globalStrides"]],
            [driver.cuuint32_t(x) for x in a["boxDim"]],
            [driver.cuuint32_t(x) for x in a["elementStrides"]],
            a["interleave"],
            a["swizzle"],
            a["l2Promotion"],
            a["oobFill"],
        )
    try:
        return check_cuda(result, f"cuTensorMapEncodeTiled for '{spec.name}'")
    except CudaError as error:
        raise TensorMapError(
            f"tensor map '{spec.name}': the driver refused a map that passed wsched's checks "
            f"({error.name}); a rule is missing from codegen/tma.py. Parameters:\n"
            + describe_tensor_map(spec, data_ptr)
        ) from error


def _normalised_strides(shape: Sequence[int], strides: Sequence[int], element: int) -> tuple[int, ...]:
    """Strides with those of extent-1 dimensions replaced by valid ones: TMA never steps such a
    dimension, but torch may give it any stride (e.g. 7 for a (1, 7) tensor), which the driver's
    16-byte rule would reject for nothing."""
    result = list(strides)
    for dim in reversed(range(len(shape))):
        if shape[dim] != 1:
            continue
        if dim == len(shape) - 1:
            result[dim] = 1
        else:
            span_bytes = shape[dim + 1] * result[dim + 1] * element
            stride_bytes = _round_up(max(span_bytes, TMA_STRIDE_ALIGNMENT), TMA_STRIDE_ALIGNMENT)
            result[dim] = stride_bytes // element
    return tuple(result)


def spec_for_tensor(tensor: torch.Tensor, box: Sequence[int], swizzle: int, name: str,
                    require_cuda: bool = True) -> TensorMapSpec:
    """The validated TensorMapSpec of `tensor` (device, dtype, inner contiguity checked first)."""
    check_tensor(name, tensor, dtype=tuple(TORCH_DTYPES[d] for d in TMA_DTYPES), device=None,
                 require_cuda=require_cuda)
    dtype = DTYPE_OF_TORCH[tensor.dtype]
    element = DTYPE_BYTES[dtype]
    shape = tuple(int(s) for s in tensor.shape)
    spec = TensorMapSpec(
        name=name,
        dtype=dtype,
        shape=shape,
        strides=_normalised_strides(shape, tensor.stride(), element),
        box=tuple(box),
        swizzle=swizzle,
    )
    validate_tensor_map(spec, tensor.data_ptr())
    return spec


def tensor_map_for(tensor: torch.Tensor, box: Sequence[int], swizzle: int,
                   name: str = "tensor") -> driver.CUtensorMap:
    """Encode a TMA map over a CUDA tensor with tiles of `box` (outermost first)."""
    spec = spec_for_tensor(tensor, box, swizzle, name)
    return encode_tensor_map(spec, tensor.data_ptr(), tensor.device)
