"""TMA tensor maps: every rule of cuTensorMapEncodeTiled is checked by us, with a message that
names the parameter, the rule, the value and the fix — the driver would only say
CUDA_ERROR_INVALID_VALUE. No GPU needed: the driver call itself is replaced where it matters."""
from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch
from cuda.bindings import driver

from wsched.codegen import tma
from wsched.codegen.tma import (
    TensorMapError,
    TensorMapSpec,
    describe_tensor_map,
    driver_arguments,
    encode_tensor_map,
    spec_for_tensor,
    validate_tensor_map,
)

ALIGNED = 0x7F00_0000_0000  # a plausible 16-byte aligned device address

# A 4096x4096 bf16 matrix read in 128x64 tiles with 128B swizzle: the matmul A operand.
GOOD = TensorMapSpec(name="a_map", dtype="bf16", shape=(4096, 4096), strides=(4096, 1),
                     box=(128, 64), swizzle=128)


def spec(**changes) -> TensorMapSpec:
    return dataclasses.replace(GOOD, **changes)


def rejected(bad: TensorMapSpec, data_ptr: int = ALIGNED) -> str:
    with pytest.raises(TensorMapError) as info:
        validate_tensor_map(bad, data_ptr)
    message = str(info.value)
    assert f"tensor map '{bad.name}'" in message, message
    return message


# ----------------------------------------------------------------------------- valid maps


@pytest.mark.parametrize("good", [
    GOOD,
    spec(swizzle=0, box=(64, 256)),                                  # no swizzle: any 16B multiple
    spec(swizzle=64, box=(64, 32)),                                  # 64 B inner box, 64B swizzle
    spec(swizzle=32, box=(64, 16)),
    spec(dtype="f16"),
    spec(dtype="f32", box=(128, 32)),                                # 128 B of f32
    spec(dtype="f32", swizzle=32, box=(8, 8)),
    spec(shape=(8, 16, 2048, 128), strides=(16 * 2048 * 128, 2048 * 128, 128, 1),
         box=(1, 1, 128, 64)),                                       # attention Q/K/V: (B, H, S, D)
    spec(shape=(64,), strides=(1,), box=(64,), swizzle=0),           # rank 1
    spec(shape=(1, 1, 1, 1, 64), strides=(64, 64, 64, 64, 1), box=(1, 1, 1, 1, 64)),  # rank 5
    spec(shape=(2**32, 64), strides=(64, 1)),                        # largest global dim
    spec(shape=(8, 8), strides=(2**39 // 2, 1)),                     # stride just under 2^40 B
    spec(box=(256, 64)),                                             # largest box dim
])
def test_valid_spec_passes(good):
    validate_tensor_map(good, ALIGNED)


def test_error_is_a_value_error():
    assert issubclass(TensorMapError, ValueError)


# ----------------------------------------------------------------------------- each rule


def test_unsupported_dtype():
    message = rejected(spec(dtype="fp8"))
    assert "dtype must be one of bf16, f16, f32" in message
    assert "'fp8'" in message


@pytest.mark.parametrize("shape", [(), (1, 1, 1, 1, 1, 64)])
def test_rank_between_1_and_5(shape):
    message = rejected(spec(shape=shape, strides=(1,) * len(shape), box=(1,) * len(shape)))
    assert "rank must be between 1 and 5" in message
    assert f"rank {len(shape)}" in message


def test_one_stride_and_box_extent_per_dimension():
    message = rejected(spec(box=(64,)))
    assert "shape, strides and box must have one entry per dimension" in message
    assert "box (64,)" in message
    assert "give 2 strides and 2 box extents" in message


def test_entries_are_ints():
    assert "box entries must be ints" in rejected(spec(box=(128, 64.0)))


@pytest.mark.parametrize("swizzle", [16, 96, 256, -1])
def test_swizzle_is_one_of_four_spans(swizzle):
    message = rejected(spec(swizzle=swizzle))
    assert "swizzle must be 0, 32, 64 or 128 bytes" in message
    assert f"got {swizzle}" in message


@pytest.mark.parametrize("offset", [2, 8])
def test_global_address_16_byte_aligned(offset):
    message = rejected(GOOD, ALIGNED + offset)
    assert "global address must be 16-byte aligned" in message
    assert f"{ALIGNED + offset:#x}" in message
    assert f"{offset} bytes past a boundary" in message
    assert ".contiguous()" in message


def test_global_address_not_null():
    assert "global address must not be null" in rejected(GOOD, 0)


def test_innermost_stride_is_one_element():
    message = rejected(spec(strides=(1, 4096)))  # a transposed view
    assert "innermost stride must be 1 element" in message
    assert "strides (1, 4096)" in message


@pytest.mark.parametrize("shape", [(0, 64), (4096, 0), (2**32 + 1, 64)])
def test_global_dims_in_range(shape):
    message = rejected(spec(shape=shape, strides=(64, 1)))
    assert "global dims must be in [1, 2^32]" in message
    bad_dim = 0 if shape[0] != 64 and shape[0] != 4096 else 1
    assert f"shape[{bad_dim}] = {shape[bad_dim]}" in message


def test_global_strides_multiple_of_16_bytes():
    # 100 bf16 per row = 200 bytes: the next row does not start on a 16-byte boundary.
    message = rejected(spec(shape=(64, 100), strides=(100, 1), box=(64, 64)))
    assert "global strides must be multiples of 16 bytes" in message
    assert "strides[0] = 100 elements = 200 bytes" in message
    assert "pad that stride to 104 elements (208 bytes)" in message


def test_global_strides_checked_for_every_outer_dimension():
    message = rejected(spec(shape=(3, 64, 64), strides=(64 * 64 + 4, 64, 1), box=(1, 64, 64)))
    assert "strides[0] = 4100 elements = 8200 bytes" in message


def test_global_strides_below_2_to_40_bytes():
    message = rejected(spec(shape=(8, 8), strides=(2**39, 1)))  # 2^40 bytes of bf16
    assert "global strides must be below 2^40 bytes" in message
    assert f"{2**40} bytes" in message


def test_global_strides_positive():
    message = rejected(spec(strides=(0, 1)))  # an expanded (broadcast) tensor
    assert "global strides must be positive" in message


@pytest.mark.parametrize("box", [(0, 64), (257, 64), (128, 512)])
def test_box_dims_in_1_to_256(box):
    message = rejected(spec(box=box, swizzle=0))
    assert "box dims must be in [1, 256]" in message
    bad_dim = 0 if not 1 <= box[0] <= 256 else 1
    assert f"box[{bad_dim}] = {box[bad_dim]}" in message


def test_inner_box_multiple_of_16_bytes():
    message = rejected(spec(box=(128, 12), swizzle=0))  # 24 bytes of bf16
    assert "inner box extent must be a multiple of 16 bytes" in message
    assert "box[-1] = 12 bf16 = 24 bytes" in message
    assert "use a multiple of 8 elements, e.g. 16" in message


def test_inner_box_multiple_of_16_bytes_f32():
    message = rejected(spec(dtype="f32", box=(128, 6), swizzle=0))
    assert "use a multiple of 4 elements, e.g. 8" in message


@pytest.mark.parametrize("swizzle, inner, limit", [(128, 128, 64), (64, 64, 32), (32, 32, 16)])
def test_inner_box_within_swizzle_span(swizzle, inner, limit):
    # GPU.md: a 256-byte inner box with 128B swizzle is CUDA_ERROR_INVALID_VALUE from the driver.
    message = rejected(spec(box=(64, inner), swizzle=swizzle))
    assert "inner box extent must not exceed the swizzle span" in message
    assert f"box[-1] = {inner} bf16 = {inner * 2} bytes with {swizzle}B swizzle" in message
    assert f"use box[-1] <= {limit} bf16" in message


# ----------------------------------------------------------------------------- driver arguments


def test_driver_arguments_innermost_first_with_byte_strides():
    # (B, M, K) bf16 with a padded row: the driver wants [K, M, B], strides of M and B in bytes.
    three_d = TensorMapSpec(name="x", dtype="bf16", shape=(4, 100, 72), strides=(100 * 80, 80, 1),
                            box=(1, 64, 64), swizzle=128)
    args = driver_arguments(three_d)
    assert args["tensorDataType"] == driver.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
    assert args["tensorRank"] == 3
    assert args["globalDim"] == [72, 100, 4]
    assert args["globalStrides"] == [80 * 2, 100 * 80 * 2]
    assert args["boxDim"] == [64, 64, 1]
    assert args["elementStrides"] == [1, 1, 1]
    assert args["interleave"] == driver.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE
    assert args["swizzle"] == driver.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B
    # rows of 160 bytes: off a 64-byte boundary, so 128-byte L2 promotion (below)
    assert args["l2Promotion"] == driver.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_128B
    assert args["oobFill"] == driver.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE


@pytest.mark.parametrize("shape, strides, promotion", [
    ((4096, 4096), (4096, 1), "L2_256B"),           # 8192-byte rows
    ((4096, 4104), (4104, 1), "L2_128B"),           # 8208 bytes: 16 off a 64-byte boundary
    ((4096, 4112), (4112, 1), "L2_128B"),           # 32 off
    ((4096, 4128), (4128, 1), "L2_256B"),           # 64-byte aligned is enough
    ((1, 4104), (4104, 1), "L2_256B"),              # one row: its stride is never used
    ((3, 64, 128), (8200, 128, 1), "L2_128B"),      # an outer dim's stride counts too
])
def test_l2_promotion_follows_the_row_alignment(shape, strides, promotion):
    """256-byte L2 promotion where every row starts on a 64-byte boundary (TMA_FAST_ROW_ALIGNMENT),
    128-byte where one does not: on such rows 256-byte promotion slowed a matmul's loads further."""
    from wsched.target import TMA_FAST_ROW_ALIGNMENT

    assert TMA_FAST_ROW_ALIGNMENT == 64
    args = driver_arguments(TensorMapSpec(name="x", dtype="bf16", shape=shape, strides=strides,
                                          box=(1,) * (len(shape) - 2) + (64, 64), swizzle=128))
    assert args["l2Promotion"] == getattr(driver.CUtensorMapL2promotion, f"CU_TENSOR_MAP_L2_PROMOTION_{promotion}")


@pytest.mark.parametrize("dtype, enum, size", [
    ("bf16", driver.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2),
    ("f16", driver.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 2),
    ("f32", driver.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4),
])
def test_driver_arguments_data_types(dtype, enum, size):
    args = driver_arguments(spec(dtype=dtype))
    assert args["tensorDataType"] == enum
    assert args["globalStrides"] == [4096 * size]


@pytest.mark.parametrize("swizzle, name", [(0, "NONE"), (32, "32B"), (64, "64B"), (128, "128B")])
def test_driver_arguments_swizzle(swizzle, name):
    assert driver_arguments(spec(swizzle=swizzle))["swizzle"].name == f"CU_TENSOR_MAP_SWIZZLE_{name}"


def test_rank_1_has_no_strides():
    assert driver_arguments(spec(shape=(64,), strides=(1,), box=(64,), swizzle=0))["globalStrides"] == []


# ----------------------------------------------------------------------------- encode


class FakeEncode:
    """Stands in for cuTensorMapEncodeTiled: records the call, answers with `error`."""

    def __init__(self, error=driver.CUresult.CUDA_SUCCESS):
        self.error = error
        self.calls = []

    def __call__(self, *args):
        self.calls.append(args)
        if self.error == driver.CUresult.CUDA_SUCCESS:
            return self.error, driver.CUtensorMap()
        return self.error, None


@pytest.fixture
def fake_encode(monkeypatch):
    fake = FakeEncode()
    monkeypatch.setattr(tma, "torch_context", lambda device=None: contextlib.nullcontext(0))
    monkeypatch.setattr(tma.driver, "cuTensorMapEncodeTiled", fake)
    return fake


def test_encode_validates_before_the_driver(fake_encode):
    with pytest.raises(TensorMapError, match="inner box extent must not exceed the swizzle span"):
        encode_tensor_map(spec(box=(64, 128)), ALIGNED)
    assert fake_encode.calls == []


def test_encode_wraps_sizes_for_cuda_python(fake_encode):
    result = encode_tensor_map(GOOD, ALIGNED)
    assert isinstance(result, driver.CUtensorMap)
    (dtype, rank, address, dims, strides, box, element_strides,
     interleave, swizzle, l2, oob), = fake_encode.calls
    assert rank == 2 and address == ALIGNED
    # plain ints raise "Cannot convert int to cuuint32_t" in cuda-python (GPU.md)
    assert all(isinstance(x, driver.cuuint64_t) for x in dims + strides)
    assert all(isinstance(x, driver.cuuint32_t) for x in box + element_strides)
    assert [int(x) for x in dims] == [4096, 4096]
    assert [int(x) for x in strides] == [8192]
    assert [int(x) for x in box] == [64, 128]
    assert [int(x) for x in element_strides] == [1, 1]
    assert swizzle == driver.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B


def test_encode_refused_by_driver_dumps_every_parameter(fake_encode):
    fake_encode.error = driver.CUresult.CUDA_ERROR_INVALID_VALUE
    with pytest.raises(TensorMapError) as info:
        encode_tensor_map(GOOD, ALIGNED)
    message = str(info.value)
    assert "tensor map 'a_map': the driver refused a map that passed wsched's checks" in message
    assert "CUDA_ERROR_INVALID_VALUE" in message
    for expected in ("globalAddress = 0x7f0000000000", "globalDim = [4096, 4096]",
                     "globalStrides = [8192]", "boxDim = [64, 128]", "elementStrides = [1, 1]",
                     "swizzle = CU_TENSOR_MAP_SWIZZLE_128B",
                     "l2Promotion = CU_TENSOR_MAP_L2_PROMOTION_L2_256B",
                     "oobFill = CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE",
                     "interleave = CU_TENSOR_MAP_INTERLEAVE_NONE",
                     "shape=(4096, 4096) strides=(4096, 1) box=(128, 64) swizzle=128"):
        assert expected in message, expected


def test_describe_survives_a_broken_spec():
    text = describe_tensor_map(spec(dtype="fp8"), ALIGNED)
    assert "dtype=fp8" in text and "driver arguments unavailable" in text


# ----------------------------------------------------------------------------- from torch tensors


@pytest.mark.parametrize("dtype, name", [(torch.bfloat16, "bf16"), (torch.float16, "f16"),
                                         (torch.float32, "f32")])
def test_spec_for_tensor(dtype, name):
    t = torch.empty(256, 128, dtype=dtype)
    box = (64, 64 if dtype != torch.float32 else 32)
    built = spec_for_tensor(t, box, 128, "b_map", require_cuda=False)
    assert built == TensorMapSpec("b_map", name, (256, 128), (128, 1), box, 128)


def test_spec_for_tensor_needs_cuda_first():
    with pytest.raises(ValueError, match="argument 'b_map' is on cpu; the kernel runs on cuda"):
        spec_for_tensor(torch.empty(64, 64, dtype=torch.int32), (64, 64), 0, "b_map")


def test_spec_for_tensor_rejects_unsupported_dtype():
    with pytest.raises(ValueError, match="argument 'b_map' has dtype torch.int32; required"):
        spec_for_tensor(torch.empty(64, 64, dtype=torch.int32), (64, 64), 0, "b_map",
                        require_cuda=False)


def test_spec_for_tensor_rejects_transposed_view():
    t = torch.empty(64, 128, dtype=torch.bfloat16).t()
    with pytest.raises(ValueError, match="not contiguous in its innermost dimension"):
        spec_for_tensor(t, (64, 64), 128, "b_map", require_cuda=False)


def test_spec_for_tensor_applies_tma_rules():
    t = torch.empty(64, 64, dtype=torch.bfloat16)
    with pytest.raises(TensorMapError, match="inner box extent must not exceed the swizzle span"):
        spec_for_tensor(t, (64, 128), 128, "b_map", require_cuda=False)


def test_spec_for_tensor_normalises_strides_of_unit_dimensions():
    # A single row of 7 f32: torch's row stride is 7 elements = 28 bytes, which the driver would
    # refuse, but TMA never steps a dimension of extent 1, so a valid stride is substituted.
    row = torch.empty(1, 7, dtype=torch.float32)
    assert spec_for_tensor(row, (1, 4), 0, "m", require_cuda=False).strides == (8, 1)
    odd = torch.empty(40, dtype=torch.float32).as_strided((1, 1, 40), (3, 5, 1))
    assert spec_for_tensor(odd, (1, 1, 8), 0, "m", require_cuda=False).strides == (40, 40, 1)


def test_spec_for_tensor_keeps_real_strides():
    padded = torch.empty(64, 72, dtype=torch.bfloat16)[:, :64]  # rows padded to 144 bytes
    assert spec_for_tensor(padded, (64, 64), 128, "m", require_cuda=False).strides == (72, 1)
