"""The launcher's host side, without a GPU: tensor argument checks (each message names the
argument, what was given and what is required), kernel argument packing for cuda-python,
driver error reporting, grid/cluster checks and the cluster launch config."""
from __future__ import annotations

import ast
import contextlib
import functools
import ctypes
import warnings
import graphlib
import threading
from pathlib import Path

import pytest
import torch
from cuda.bindings import driver

from wsched.kernel import CompiledKernel
from wsched.codegen import cuda_driver, launch
from wsched.codegen.cuda_driver import CudaError, check_cuda
from wsched.codegen.launch import (
    PARAM_BYTES,
    LoadedKernel,
    PackedArguments,
    _check_cluster,
    _grid3,
    _launch_config,
    _marshal_args,
    check_tensor,
)

BF16_2D = (torch.bfloat16, 2)


def test_codegen_modules_import_each_other_without_cycles():
    # launch and tma share the driver helpers of cuda_driver; neither imports the other back
    folder = Path(launch.__file__).parent
    graph = {}
    for path in folder.glob("*.py"):
        tree = ast.parse(path.read_text())
        graph[path.stem] = {
            alias.name if node.module is None else node.module
            for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level == 1
            for alias in node.names}
    graphlib.TopologicalSorter(graph).prepare()  # raises CycleError on a cycle
    assert "tma" not in graph["launch"] and "launch" not in graph["cuda_driver"]


# ----------------------------------------------------------------------------- check_tensor


def test_valid_arguments_pass():
    check_tensor("a", torch.empty(128, 64, dtype=torch.bfloat16), *BF16_2D, require_cuda=False)
    check_tensor("b", torch.empty(2, 64, 64, dtype=torch.float32), torch.float32, (2, None, 64),
                 require_cuda=False)


def test_not_a_tensor():
    with pytest.raises(TypeError, match="argument 'a': expected a torch.Tensor, got list"):
        check_tensor("a", [1.0, 2.0], *BF16_2D, require_cuda=False)


def test_cpu_tensor_is_rejected_before_anything_else():
    # wrong dtype and rank too: the device is what the user must fix first
    cpu = torch.empty(3, dtype=torch.int8)
    with pytest.raises(ValueError) as info:
        check_tensor("a", cpu, *BF16_2D)
    message = str(info.value)
    assert "argument 'a' is on cpu; the kernel runs on cuda" in message
    assert ".to('cuda')" in message


def test_cpu_tensor_message_names_the_kernel_device():
    with pytest.raises(ValueError, match=r"argument 'b' is on cpu; the kernel runs on cuda:1 .*\.to\('cuda:1'\)"):
        check_tensor("b", torch.empty(8, 8, dtype=torch.bfloat16), *BF16_2D, device=1)


def test_wrong_dtype():
    t = torch.empty(64, 64, dtype=torch.float32)
    with pytest.raises(ValueError) as info:
        check_tensor("q", t, *BF16_2D, require_cuda=False)
    assert str(info.value) == ("argument 'q' has dtype torch.float32; required torch.bfloat16 "
                               "(convert with .to(torch.bfloat16))")


def test_wrong_rank():
    t = torch.empty(2, 64, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"argument 'a' has rank 3 \(shape \(2, 64, 64\)\); required rank 2"):
        check_tensor("a", t, *BF16_2D, require_cuda=False)


def test_wrong_shape():
    t = torch.empty(4, 16, 128, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"argument 'k' has shape \(4, 16, 128, 64\); required shape \(4, 16, \*, 128\)"):
        check_tensor("k", t, torch.bfloat16, (4, 16, None, 128), require_cuda=False)


def test_non_contiguous_inner_dimension():
    t = torch.empty(64, 128, dtype=torch.bfloat16).t()
    with pytest.raises(ValueError) as info:
        check_tensor("b", t, *BF16_2D, require_cuda=False)
    message = str(info.value)
    assert "argument 'b' is not contiguous in its innermost dimension" in message
    assert "strides (1, 128)" in message
    assert "stride(-1) == 1" in message and ".contiguous()" in message


def test_data_ptr_not_16_byte_aligned():
    base = torch.empty(64 * 64 + 8, dtype=torch.bfloat16)
    t = base[1:1 + 64 * 64].view(64, 64)  # starts 2 bytes into a 16-byte chunk
    with pytest.raises(ValueError) as info:
        check_tensor("a", t, *BF16_2D, require_cuda=False)
    message = str(info.value)
    assert f"argument 'a' has data_ptr {t.data_ptr():#x}, 2 bytes past a 16-byte boundary" in message
    assert "TMA needs a 16-byte aligned base address" in message


def test_row_stride_not_multiple_of_16_bytes():
    t = torch.empty(64, 100, dtype=torch.bfloat16)  # 200-byte rows
    with pytest.raises(ValueError) as info:
        check_tensor("a", t, *BF16_2D, require_cuda=False)
    message = str(info.value)
    assert "argument 'a' has stride 100 elements = 200 bytes in dim 0" in message
    assert "TMA needs 16-byte aligned rows" in message
    assert "pad the inner dimension to a multiple of 8 torch.bfloat16 elements" in message


def test_row_stride_of_an_outer_dimension():
    t = torch.empty(3 * 65 * 64, dtype=torch.float32).as_strided((3, 64, 64), (64 * 64 + 2, 64, 1))
    with pytest.raises(ValueError, match="stride 4098 elements = 16392 bytes in dim 0"):
        check_tensor("x", t, torch.float32, 3, require_cuda=False)


def test_unit_dimension_stride_is_ignored():
    check_tensor("row", torch.empty(1, 7 * 8 - 1, dtype=torch.bfloat16)[:, :48], *BF16_2D,
                 require_cuda=False)


def test_plain_loads_skip_the_tma_rules():
    check_tensor("bias", torch.empty(64, 100, dtype=torch.bfloat16)[:, 1:], *BF16_2D,
                 require_cuda=False, alignment=False)


# ----------------------------------------------------------------------------- _marshal_args


def test_marshal_arg_types_to_cuda_python_types():
    tensor_map = driver.CUtensorMap()
    values, types = _marshal_args([("tensor_map", tensor_map), ("ptr", 0x7F00_0000_0000),
                                   ("i32", -5), ("f32", 0.125), ("f32", 2)])
    assert isinstance(values, tuple) and isinstance(types, tuple)  # cuda-python insists on tuples
    assert values[0] is tensor_map
    assert values[1:] == (0x7F00_0000_0000, -5, 0.125, 2.0)
    assert types == (None, ctypes.c_void_p, ctypes.c_int, ctypes.c_float, ctypes.c_float)


def test_marshal_empty():
    assert _marshal_args([]) == ((), ())


def test_marshal_device_pointer_object():
    values, types = _marshal_args([("ptr", driver.CUdeviceptr(4096))])
    assert values == (4096,) and types == (ctypes.c_void_p,)


@pytest.mark.parametrize("arg, error, text", [
    (("tensor_map", 5), TypeError, "kernel argument 0 (tensor_map): expected a driver.CUtensorMap"),
    (("ptr", torch.empty(1)), TypeError, "pass tensor.data_ptr()"),
    (("ptr", -1), TypeError, "expected a non-negative int device address"),
    (("i32", 1.5), TypeError, "kernel argument 0 (i32): expected an int, got float 1.5"),
    (("i32", True), TypeError, "expected an int, got bool"),
    (("i32", 2**31), ValueError, "2147483648 does not fit a 32-bit int"),
    (("f32", "x"), TypeError, "expected a float, got str"),
    (("u64", 1), ValueError, "kind must be one of tensor_map, ptr, i32, f32, got 'u64'"),
    (("i32",), TypeError, "expected a (kind, value) pair"),
])
def test_marshal_rejects(arg, error, text):
    with pytest.raises(error) as info:
        _marshal_args([arg])
    assert text in str(info.value)


@pytest.mark.skipif(not hasattr(driver, "_HelperKernelParams"),
                    reason="cuda-python's private parameter packer moved")
def test_cuda_python_packs_marshalled_args_as_the_kernel_expects():
    # The packer cuLaunchKernel runs on (values, types), read back byte for byte: the map is
    # passed by the address of its 128-byte storage, the rest as 8/4/4-byte values.
    tensor_map = driver.CUtensorMap()
    packed = driver._HelperKernelParams(_marshal_args(
        [("tensor_map", tensor_map), ("ptr", 0x7F00_0000_1000), ("i32", -7), ("f32", 1.5)]))
    pointers = (ctypes.c_void_p * 4).from_address(packed.ckernelParams)
    assert pointers[0] == tensor_map.getPtr()
    assert ctypes.c_uint64.from_address(pointers[1]).value == 0x7F00_0000_1000
    assert ctypes.c_int32.from_address(pointers[2]).value == -7
    assert ctypes.c_float.from_address(pointers[3]).value == 1.5


# ----------------------------------------------------------------------------- PackedArguments


def _map_with(data: bytes) -> driver.CUtensorMap:
    tensor_map = driver.CUtensorMap()
    ctypes.memmove(tensor_map.getPtr(), data.ljust(PARAM_BYTES["tensor_map"], b"\0"), len(data))
    return tensor_map


def _driver_bytes(args) -> list[bytes]:
    """What the driver copies for each argument when cuda-python packs `_marshal_args(args)`:
    a ctypes value of each type, a CUtensorMap's 128 bytes of storage."""
    values, types = _marshal_args(args)
    return [ctypes.string_at(value.getPtr(), PARAM_BYTES["tensor_map"]) if ctype is None else bytes(ctype(value))
            for value, ctype in zip(values, types)]


def test_packed_arguments_hold_the_bytes_cuda_python_would_pack():
    args = [("tensor_map", _map_with(b"map of a")), ("ptr", 0x7F00_0000_0040), ("i32", -5),
            ("f32", 0.1), ("ptr", driver.CUdeviceptr(4096))]
    packed = PackedArguments(args)
    assert packed.raw() == _driver_bytes(args)
    assert len(packed) == 5 and packed.types == ("tensor_map", "ptr", "i32", "f32", "ptr")
    # the void** the driver reads: one address per parameter, each at its value's storage
    pointers = (ctypes.c_void_p * 5).from_address(packed.address)
    assert pointers[0] == args[0][1].getPtr()
    assert ctypes.c_int.from_address(pointers[2]).value == -5


def test_packed_arguments_patch_pointers_and_maps_in_place():
    first, second = _map_with(b"first"), _map_with(b"second")
    packed = PackedArguments([("tensor_map", first), ("ptr", 0), ("i32", 7)])
    address = packed.address
    packed.set_pointer(1, 0xABC0)
    packed.set_tensor_map(0, second)
    assert packed.address == address   # the same array: nothing packed anew
    assert packed.raw() == _driver_bytes([("tensor_map", second), ("ptr", 0xABC0), ("i32", 7)])
    assert packed.pairs() == [("tensor_map", second), ("ptr", 0xABC0), ("i32", 7)]


def test_packed_arguments_copy_is_independent():
    packed = PackedArguments([("ptr", 16), ("f32", 2.0)])
    copy = packed.copy()
    copy.set_pointer(0, 32)
    assert packed.pairs() == [("ptr", 16), ("f32", 2.0)] and copy.pairs() == [("ptr", 32), ("f32", 2.0)]


def test_packed_arguments_check_like_marshal():
    with pytest.raises(ValueError, match="2147483648 does not fit a 32-bit int"):
        PackedArguments([("i32", 2**31)])
    assert PackedArguments([]).address == 0   # NULL: a kernel without parameters


# ----------------------------------------------------------------------------- check_cuda


def test_check_cuda_returns_values():
    ok = driver.CUresult.CUDA_SUCCESS
    assert check_cuda((ok,), "cuInit(0)") is None
    assert check_cuda((ok, 7), "cuDeviceGet") == 7
    assert check_cuda((ok, 1, 2), "cuMemGetInfo") == (1, 2)
    assert check_cuda(ok, "cuCtxSynchronize") is None


def test_check_cuda_names_the_call_and_the_error():
    with pytest.raises(CudaError) as info:
        check_cuda((driver.CUresult.CUDA_ERROR_INVALID_VALUE, None), "cuTensorMapEncodeTiled for 'a'")
    message = str(info.value)
    assert message.startswith("cuTensorMapEncodeTiled for 'a' failed: CUDA_ERROR_INVALID_VALUE")
    assert info.value.call == "cuTensorMapEncodeTiled for 'a'"
    assert info.value.name == "CUDA_ERROR_INVALID_VALUE"
    assert info.value.error == driver.CUresult.CUDA_ERROR_INVALID_VALUE
    assert isinstance(info.value, RuntimeError)


def test_check_cuda_uses_the_driver_description(monkeypatch):
    ok = driver.CUresult.CUDA_SUCCESS
    monkeypatch.setattr(cuda_driver.driver, "cuGetErrorName", lambda e: (ok, b"CUDA_ERROR_ILLEGAL_ADDRESS"))
    monkeypatch.setattr(cuda_driver.driver, "cuGetErrorString",
                        lambda e: (ok, b"an illegal memory access was encountered"))
    with pytest.raises(CudaError, match=r"^cuCtxSynchronize failed: CUDA_ERROR_ILLEGAL_ADDRESS "
                                        r"\(an illegal memory access was encountered\)$"):
        check_cuda((driver.CUresult.CUDA_ERROR_ILLEGAL_ADDRESS,), "cuCtxSynchronize")


# ----------------------------------------------------------------------------- grid and cluster


@pytest.mark.parametrize("grid, expected", [(132, (132, 1, 1)), ((8, 4), (8, 4, 1)),
                                            ((2, 3, 4), (2, 3, 4))])
def test_grid3(grid, expected):
    assert _grid3(grid) == expected


@pytest.mark.parametrize("grid, text", [(0, "grid extents must be >= 1"),
                                        ((1, 2, 3, 4), "grid must be an int or a tuple of 1 to 3 ints"),
                                        ((1, 70000), "grid y extent 70000 exceeds the CUDA limit 65535"),
                                        (2.0, "grid must be an int or a tuple")])
def test_grid3_rejects(grid, text):
    with pytest.raises(ValueError, match=text.replace("(", r"\(")):
        _grid3(grid)


def test_cluster_divides_grid():
    assert _check_cluster((132, 1, 1), (2, 1, 1)) == (2, 1, 1)
    assert _check_cluster((132, 1, 1), 2) == (2, 1, 1)
    with pytest.raises(ValueError, match=r"grid \(131, 1, 1\) is not divisible by cluster \(2, 1, 1\) "
                                         r"along x: round the grid up to a multiple of 2"):
        _check_cluster((131, 1, 1), (2, 1, 1))


def test_cluster_portable_size():
    with pytest.raises(ValueError, match="cluster .* has 16 CTAs; the portable limit is 8"):
        _check_cluster((64, 1, 1), (16, 1, 1))


def test_cluster_launch_config():
    config = _launch_config((132, 2, 1), 384, 200_000, driver.CUstream(0x1234), (2, 1, 1))
    assert (config.gridDimX, config.gridDimY, config.gridDimZ) == (132, 2, 1)
    assert (config.blockDimX, config.blockDimY, config.blockDimZ) == (384, 1, 1)
    assert config.sharedMemBytes == 200_000
    assert int(config.hStream) == 0x1234
    assert config.numAttrs == 1
    attribute = config.attrs[0]
    assert attribute.id == driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
    cluster = attribute.value.clusterDim
    assert (cluster.x, cluster.y, cluster.z) == (2, 1, 1)


# ----------------------------------------------------------------------------- LoadedKernel


def test_loaded_kernel_is_lazy(tmp_path):
    cubin = tmp_path / "k.cubin"
    cubin.write_bytes(b"\x7fELF not really")
    kernel = LoadedKernel(cubin, "wsched_matmul", smem_bytes=200_000, threads=384)
    assert "wsched_matmul" in repr(kernel)
    kernel.last_error_check()  # nothing launched yet: no driver call


def test_loaded_kernel_missing_cubin(tmp_path):
    with pytest.raises(FileNotFoundError, match="kernel 'k': cubin .*missing.cubin does not exist"):
        LoadedKernel(tmp_path / "missing.cubin", "k", smem_bytes=0, threads=128)


@pytest.mark.parametrize("smem, threads, text", [(-1, 128, "smem_bytes must be a non-negative int"),
                                                 (0, 0, "threads must be in [1, 1024]"),
                                                 (0, 2048, "threads must be in [1, 1024]")])
def test_loaded_kernel_rejects_bad_launch_shape(tmp_path, smem, threads, text):
    cubin = tmp_path / "k.cubin"
    cubin.write_bytes(b"")
    with pytest.raises(ValueError) as info:
        LoadedKernel(cubin, "k", smem_bytes=smem, threads=threads)
    assert text in str(info.value)


class FakeDriver:
    """The driver calls LoadedKernel makes, recorded; answers as an H100 would (227 KB opt-in)."""

    OK = driver.CUresult.CUDA_SUCCESS

    def __init__(self, monkeypatch, get_function_error=None, launch_error=None):
        self.calls = []
        self.get_function_error = get_function_error
        self.launch_error = launch_error
        self.contexts = []  # the device of each torch_context entered
        self.current = None  # the device whose primary context is the thread's current one
        monkeypatch.setattr(launch, "torch_context", self._context)
        monkeypatch.setattr(launch, "is_current", lambda index: index == self.current)
        monkeypatch.setattr(launch.torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(launch, "current_stream_handle", lambda index: 0x500 + index)
        for name in ("cuDeviceGet", "cuDeviceGetAttribute", "cuModuleLoadData",
                     "cuModuleGetFunction", "cuFuncSetAttribute", "cuLaunchKernel", "cuLaunchKernelEx"):
            monkeypatch.setattr(launch.driver, name, self._recorder(name))

    def _recorder(self, name):
        def call(*args):
            self.calls.append((name, args))
            if name == "cuDeviceGetAttribute":
                return self.OK, 232448
            if name == "cuModuleGetFunction" and self.get_function_error is not None:
                return self.get_function_error, None
            if name.startswith("cuLaunchKernel") and self.launch_error is not None:
                return (self.launch_error,)
            if name in ("cuFuncSetAttribute",) or name.startswith("cuLaunchKernel"):
                return (self.OK,)
            if name in ("cuModuleLoadData", "cuModuleGetFunction") and self.contexts[-1]:
                return self.OK, f"<{name} on cuda:{self.contexts[-1]}>"
            return self.OK, f"<{name}>"
        return call

    def _context(self, device=None):
        index = cuda_driver.device_index(device)
        self.contexts.append(index)
        return contextlib.nullcontext(index)

    def names(self):
        return [name for name, _ in self.calls]


@pytest.fixture
def cubin(tmp_path):
    path = tmp_path / "matmul.cubin"
    path.write_bytes(b"\x7fELF fake cubin")
    return path


def test_launch_loads_once_then_launches(monkeypatch, cubin):
    fake = FakeDriver(monkeypatch)
    kernel = LoadedKernel(cubin, "wsched_matmul", smem_bytes=200_000, threads=384)
    tensor_map = driver.CUtensorMap()
    args = [("tensor_map", tensor_map), ("ptr", 4096), ("i32", 7)]
    kernel.launch(132, args, stream=0x55)
    kernel.launch((132,), args, stream=0x55)
    assert fake.names() == ["cuDeviceGet", "cuDeviceGetAttribute", "cuModuleLoadData",
                            "cuModuleGetFunction", "cuFuncSetAttribute",
                            "cuLaunchKernel", "cuLaunchKernel"]
    _, (image,) = fake.calls[2]
    assert image == b"\x7fELF fake cubin"
    _, (module, name) = fake.calls[3]
    assert module == "<cuModuleLoadData>" and name == b"wsched_matmul"
    _, (function, attribute, value) = fake.calls[4]
    assert attribute == driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    assert value == 200_000
    _, launch_args = fake.calls[5]
    function, gx, gy, gz, bx, by, bz, smem, stream, params, extra = launch_args
    assert function == "<cuModuleGetFunction>"
    assert (gx, gy, gz, bx, by, bz, smem) == (132, 1, 1, 384, 1, 1, 200_000)
    assert int(stream) == 0x55 and extra == 0
    assert params == ((tensor_map, 4096, 7), (None, ctypes.c_void_p, ctypes.c_int))


def test_cluster_launch_uses_launch_kernel_ex(monkeypatch, cubin):
    fake = FakeDriver(monkeypatch)
    kernel = LoadedKernel(cubin, "wsched_matmul", smem_bytes=1024, threads=384)
    kernel.launch(132, [("i32", 1)], stream=0, cluster=(2, 1, 1))
    name, (config, function, params, extra) = fake.calls[-1]
    assert name == "cuLaunchKernelEx"
    assert (config.gridDimX, config.blockDimX, config.sharedMemBytes) == (132, 384, 1024)
    assert config.attrs[0].value.clusterDim.x == 2
    assert params == ((1,), (ctypes.c_int,))


def test_launch_checks_grid_before_the_driver(monkeypatch, cubin):
    fake = FakeDriver(monkeypatch)
    kernel = LoadedKernel(cubin, "k", smem_bytes=0, threads=128)
    with pytest.raises(ValueError, match="not divisible by cluster"):
        kernel.launch(131, [], stream=0, cluster=2)
    with pytest.raises(TypeError, match="expected an int"):
        kernel.launch(1, [("i32", "x")], stream=0)
    assert fake.calls == []


def test_smem_beyond_the_opt_in_limit(monkeypatch, cubin):
    FakeDriver(monkeypatch)
    kernel = LoadedKernel(cubin, "k", smem_bytes=240_000, threads=384)
    with pytest.raises(ValueError, match="asks for 240000 bytes of dynamic shared memory; "
                                         "cuda:0 allows at most 232448 per block"):
        kernel.launch(1, [], stream=0)


def test_kernel_name_not_in_cubin(monkeypatch, cubin):
    FakeDriver(monkeypatch, get_function_error=driver.CUresult.CUDA_ERROR_NOT_FOUND)
    kernel = LoadedKernel(cubin, "wsched_matmul", smem_bytes=0, threads=128)
    with pytest.raises(CudaError) as info:
        kernel.launch(1, [], stream=0)
    message = str(info.value)
    assert "cuModuleGetFunction('wsched_matmul') failed: CUDA_ERROR_NOT_FOUND" in message
    assert 'declare it extern "C"' in message and "cuobjdump -symbols" in message


def test_launch_failure_names_the_launch(monkeypatch, cubin):
    FakeDriver(monkeypatch, launch_error=driver.CUresult.CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES)
    kernel = LoadedKernel(cubin, "wsched_matmul", smem_bytes=0, threads=384)
    with pytest.raises(CudaError, match=r"cuLaunchKernel\(wsched_matmul grid=\(132, 1, 1\) "
                                        r"block=\(384, 1, 1\) cluster=\(1, 1, 1\) smem=0 args=0 on cuda:0\) "
                                        r"failed: CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES"):
        kernel.launch(132, [], stream=0)


def test_launch_packed_goes_straight_to_the_driver_once_the_context_is_current(monkeypatch, cubin):
    fake = FakeDriver(monkeypatch)
    kernel = LoadedKernel(cubin, "wsched_matmul", smem_bytes=200_000, threads=384)
    packed = PackedArguments([("ptr", 4096), ("i32", 7)])
    kernel.launch_packed(132, packed, 1)   # first launch on cuda:1: load there, in its context
    fake.current = 1                       # the thread now works on cuda:1
    kernel.launch_packed(132, packed, 1)
    kernel.launch_packed(2, packed, 0)     # another device's context current: switch to cuda:0
    assert fake.contexts == [1, 1, 0, 0]   # launch and load on each device; the second launch none
    launches = [args for name, args in fake.calls if name == "cuLaunchKernel"]
    assert [(args[0], args[1], int(args[8]), args[9]) for args in launches] == [
        ("<cuModuleGetFunction on cuda:1>", 132, 0x501, packed.address),
        ("<cuModuleGetFunction on cuda:1>", 132, 0x501, packed.address),
        ("<cuModuleGetFunction>", 2, 0x500, packed.address)]
    assert launches[0][1:8] == (132, 1, 1, 384, 1, 1, 200_000)


def test_launch_packed_failure_names_the_launch(monkeypatch, cubin):
    FakeDriver(monkeypatch, launch_error=driver.CUresult.CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES)
    kernel = LoadedKernel(cubin, "wsched_matmul", smem_bytes=0, threads=384)
    with pytest.raises(CudaError, match=r"cuLaunchKernel\(wsched_matmul grid=\(132, 1, 1\) "
                                        r"block=\(384, 1, 1\) cluster=\(1, 1, 1\) smem=0 args=1 on cuda:0\) "
                                        r"failed: CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES"):
        kernel.launch_packed(132, PackedArguments([("i32", 1)]), 0)


def test_launch_takes_packed_arguments(monkeypatch, cubin):
    fake = FakeDriver(monkeypatch)
    kernel = LoadedKernel(cubin, "k", smem_bytes=0, threads=128)
    packed = PackedArguments([("i32", 3)])
    kernel.launch(4, packed, stream=0x55)
    name, args = fake.calls[-1]
    assert name == "cuLaunchKernel" and args[9] == packed.address


# ----------------------------------------------------------------------------- several devices


def test_each_device_gets_its_own_module_context_and_stream(monkeypatch, cubin):
    fake = FakeDriver(monkeypatch)   # torch's current device stays 0 throughout
    kernel = LoadedKernel(cubin, "wsched_matmul", smem_bytes=1024, threads=384)
    kernel.launch(1, [], device=1)
    kernel.launch(1, [], device=torch.device("cuda", 0))
    kernel.launch(1, [], device="cuda:1")
    loads = [args for name, args in fake.calls if name == "cuDeviceGet"]
    assert loads == [(1,), (0,)]                                  # one load per device, no more
    launches = [args for name, args in fake.calls if name == "cuLaunchKernel"]
    functions = [args[0] for args in launches]
    streams = [int(args[8]) for args in launches]
    assert functions == ["<cuModuleGetFunction on cuda:1>", "<cuModuleGetFunction>",
                         "<cuModuleGetFunction on cuda:1>"]
    assert streams == [0x501, 0x500, 0x501]                       # that device's current stream
    assert fake.contexts[-1] == 1


def test_threads_load_a_device_once(monkeypatch, cubin):
    fake = FakeDriver(monkeypatch)
    kernel = LoadedKernel(cubin, "k", smem_bytes=0, threads=128)
    start = threading.Barrier(8)

    def drive(device):
        start.wait()
        for _ in range(20):
            kernel.launch(1, [("i32", device)], device=device)

    threads = [threading.Thread(target=drive, args=(i % 2,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(args for name, args in fake.calls if name == "cuModuleLoadData") == [
        (b"\x7fELF fake cubin",)] * 2
    assert fake.names().count("cuLaunchKernel") == 160


class FakeContexts:
    """torch's current device and the driver's current context of one thread, faked."""

    def __init__(self, monkeypatch, device=0, context=0):
        self.device, self.context, self.log = device, context, []
        monkeypatch.setattr(cuda_driver, "_primary_contexts", {})
        monkeypatch.setattr(cuda_driver, "_primary_handles", {})
        monkeypatch.setattr(cuda_driver.torch, "empty", lambda *a, **k: None)
        monkeypatch.setattr(cuda_driver.torch.cuda, "current_device", lambda: self.device)
        monkeypatch.setattr(cuda_driver.torch.cuda, "device", self._torch_device)
        ok = driver.CUresult.CUDA_SUCCESS
        monkeypatch.setattr(cuda_driver.driver, "cuInit", lambda flags: (ok,))
        monkeypatch.setattr(cuda_driver.driver, "cuDeviceGet", lambda index: (ok, index))
        monkeypatch.setattr(cuda_driver.driver, "cuDevicePrimaryCtxRetain",
                            lambda handle: (ok, driver.CUcontext(0x1000 + handle)))
        monkeypatch.setattr(cuda_driver.driver, "cuCtxGetCurrent", lambda: (ok, driver.CUcontext(self.context)))
        monkeypatch.setattr(cuda_driver.driver, "cuCtxSetCurrent", self._set_context)

    def _set_context(self, context):
        self.log.append(("cuCtxSetCurrent", int(context)))
        self.context = int(context)
        return (driver.CUresult.CUDA_SUCCESS,)

    @contextlib.contextmanager
    def _torch_device(self, index):
        # like cudaSetDevice: the runtime binds the device's primary context, if it made one
        previous = self.device
        self.log.append(("set_device", index))
        self.device = index
        yield
        self.log.append(("set_device", previous))
        self.device = previous
        if self.context:
            self.context = 0x1000 + previous


def test_torch_context_binds_the_devices_primary_context_and_restores(monkeypatch):
    fake = FakeContexts(monkeypatch, device=0, context=0)   # a fresh thread: no context yet
    cuda_driver.init_driver(0), cuda_driver.init_driver(1)
    fake.log.clear()
    with cuda_driver.torch_context("cuda:1") as index:
        assert index == 1 and (fake.device, fake.context) == (1, 0x1001)
    assert fake.device == 0 and fake.context == 0x1000             # the thread's device is back
    assert fake.log[:2] == [("set_device", 1), ("cuCtxSetCurrent", 0x1001)]


def test_torch_context_fast_path_when_already_current(monkeypatch):
    fake = FakeContexts(monkeypatch, device=1, context=0x1001)
    cuda_driver.init_driver(1)
    fake.log.clear()
    with cuda_driver.torch_context(1):
        with cuda_driver.torch_context(None):
            pass
    assert fake.log == []                                           # nothing to switch


def test_is_current_compares_the_thread_context_with_the_primary(monkeypatch):
    fake = FakeContexts(monkeypatch, device=0, context=0)
    assert not cuda_driver.is_current(1)        # before init_driver: never
    cuda_driver.init_driver(1)
    assert not cuda_driver.is_current(1)        # a fresh thread: no context current
    fake.context = 0x1001
    assert cuda_driver.is_current(1) and not cuda_driver.is_current(0)


# ----------------------------------------------------------------------------- the eager call


class FakeGpu:
    """A compiled kernel's call on CPU tensors, down to the bytes the driver would copy: the plan
    takes them for cuda:0's (device checks off, every other check on), a tensor map is 128 bytes
    naming the parameter, address, shape and box, and the launch records the packed arguments."""

    def __init__(self, monkeypatch):
        from wsched.codegen import tma

        self.encoded = []    # (parameter, data_ptr) of each map encoded
        self.launches = []   # (grid, bytes per parameter, device index) of each launch
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(launch, "check_tensor", functools.partial(check_tensor, require_cuda=False))
        monkeypatch.setattr(launch, "sm_count", lambda device=None: 132)
        monkeypatch.setattr(tma, "tensor_map_for", self._encode)
        workspace = CompiledKernel._workspace   # scratch tensors (a tile counter) on the CPU
        monkeypatch.setattr(CompiledKernel, "_workspace", lambda k, p, scalars, device: workspace(k, p, scalars, "cpu"))

    def _encode(self, tensor, box, swizzle, name):
        self.encoded.append((name, tensor.data_ptr()))
        return _map_with(self.map_bytes(name, tensor.data_ptr(), tensor.shape, box))

    @staticmethod
    def map_bytes(name, data_ptr, shape, box) -> bytes:
        return f"{name} {data_ptr:#x} {tuple(shape)} {tuple(box)}".encode()

    def compile(self, fusion):
        import wsched as ws

        k = ws.compile(fusion, ws.schedule_for(fusion), build=False)   # one kernel, no per-shape choice
        k.__dict__["_loaded"] = self   # stands in for the LoadedKernel (a cached_property)
        k._native = False              # the Python path (test_native_launch.py drives the native one)
        return k

    def launch_packed(self, grid, packed, device_index):
        self.launches.append((grid, packed.raw(), device_index))


@pytest.fixture
def fake_gpu(monkeypatch):
    return FakeGpu(monkeypatch)


def _matmul_call():
    from fusions import inputs_for, matmul

    a, b = inputs_for(matmul, 200, 296, 72)
    return matmul, (a, b), {"out": torch.empty(200, 296, dtype=torch.bfloat16)}, {"M": 200, "N": 296, "K": 72}


def _attention_call():
    from attention_fusions import attention_inputs, make_attention

    f = make_attention(128, causal=True, lse=True)
    q, k, v = attention_inputs(2, 3, 150, 170, 128)
    out = {"o": torch.empty(2, 3, 150, 128, dtype=torch.bfloat16), "lse": torch.empty(2, 3, 150)}
    return f, (q, k, v), out, {"batch0": 2, "batch1": 3, "S": 150, "T": 170}


def _expected_bytes(k, tensors, out, sizes):
    """The arguments as the kernel declares them, each from its tensor or size: the oracle."""
    from wsched.lowering import ir
    from wsched.partition import param_name

    by_name = {param_name(node.id): t for node, t in zip(k.fusion.inputs, tensors)} | out
    expected = []
    for p in k.kernel.params:
        if isinstance(p, ir.TensorMapParam):
            t = by_name[p.name]
            shape = [s if isinstance(s, int) else sizes[s.name] for s in (getattr(e, "value", e) for e in p.shape)]
            expected.append(_map_with(FakeGpu.map_bytes(p.name, t.data_ptr(), shape, p.box)))
            expected[-1] = ctypes.string_at(expected[-1].getPtr(), PARAM_BYTES["tensor_map"])
        elif isinstance(p, ir.WorkspaceParam):   # the kernel's own scratch tensor (a causal tile counter)
            held = next(v[-1] for (name, _), v in k._workspaces.items() if name == p.name)
            expected.append(held.data_ptr().to_bytes(8, "little"))
        elif isinstance(p, ir.GlobalParam):
            expected.append(by_name[p.name].data_ptr().to_bytes(8, "little"))
        elif p.name in sizes:
            expected.append(sizes[p.name].to_bytes(4, "little", signed=True))
        else:
            expected.append(None)   # a host-computed scalar: compared with the slow path only
    return expected


@pytest.mark.parametrize("call", [_matmul_call, _attention_call], ids=["matmul", "attention_lse"])
def test_the_calls_packed_arguments_are_the_kernels_arguments(fake_gpu, call):
    fusion, tensors, out, sizes = call()
    k = fake_gpu.compile(fusion)
    k(*tensors, out=out)
    k(*tensors, out=out)   # the second call reuses the plan, the buffer and the maps
    grid, pairs, _ = k.launch_args(tensors, out=out)   # the (type, value) pairs of the slow path
    (grid1, raw1, index1), (grid2, raw2, _) = fake_gpu.launches
    assert raw1 == raw2 == _driver_bytes(pairs)
    assert grid1 == grid2 == grid and index1 == 0
    expected = _expected_bytes(k, tensors, out, sizes)
    assert [r for r, e in zip(raw1, expected) if e is not None] == [e for e in expected if e is not None]
    assert len({name for name, _ in fake_gpu.encoded}) == len(fake_gpu.encoded)   # each map once


def test_a_new_data_pointer_gets_its_own_map(fake_gpu):
    fusion, (a, b), out, sizes = _matmul_call()
    k = fake_gpu.compile(fusion)
    k(a, b, out=out)
    a2 = a.clone()   # the same layout at another address
    k(a2, b, out=out)
    k(a, b, out=out)   # the first address again: its map is cached
    assert fake_gpu.encoded == [("a", a.data_ptr()), ("b", b.data_ptr()), ("out", out["out"].data_ptr()),
                                ("a", a2.data_ptr())]
    raws = [raw for _, raw, _ in fake_gpu.launches]
    assert raws[1] == _expected_bytes(k, (a2, b), out, sizes) and raws[2] == raws[0] != raws[1]
    assert len(k._plans) == 1


def test_a_new_layout_gets_a_new_plan(fake_gpu, monkeypatch):
    from fusions import inputs_for

    fusion, (a, b), out, _ = _matmul_call()
    k = fake_gpu.compile(fusion)
    plans = []
    plan = k._plan
    monkeypatch.setattr(k, "_plan", lambda *args: plans.append(args) or plan(*args))
    for _ in range(3):
        k(a, b, out=out)
    a2, b2 = inputs_for(fusion, 100, 296, 72)
    k(a2, b2, out={"out": torch.empty(100, 296, dtype=torch.bfloat16)})    # another M
    strided = torch.empty(200, 80, dtype=torch.bfloat16)[:, :72]
    strided.copy_(a)
    k(strided, b, out=out)                                                # other strides
    assert len(plans) == len(k._plans) == 3 and len(fake_gpu.launches) == 5


def test_a_misaligned_base_of_a_known_layout_is_staged(fake_gpu):
    """A tensor of a planned layout whose base TMA cannot take is copied into an aligned buffer
    (the launch's map names the copy), with one warning that says why; bind() still refuses it."""
    fusion, (a, b), out, _ = _matmul_call()
    k = fake_gpu.compile(fusion)
    k(a, b, out=out)
    storage = torch.empty(200 * 72 + 8, dtype=torch.bfloat16)
    shifted = storage[1:1 + 200 * 72].view(200, 72)   # the plan's layout, 2 bytes past 16
    shifted.copy_(a)
    with pytest.warns(UserWarning, match=r"matmul: 'a' \(200, 72\): base 2 bytes past a 16-byte boundary — copied "
                                         r"to \(outputs: from\) a TMA-aligned buffer on every call"):
        assert k(shifted, b, out=out) is out["out"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        k(shifted, b, out=out)                          # warned once per layout
    assert len(k._plans) == 1 and len(fake_gpu.launches) == 3
    name, address = fake_gpu.encoded[-1]
    assert name == "a" and address % 16 == 0 and address != shifted.data_ptr()
    with pytest.raises(ValueError) as info:
        k.bind(shifted, b, out=out)
    assert str(info.value) == (
        f"argument 'a' has data_ptr {shifted.data_ptr():#x}, 2 bytes past a 16-byte boundary; TMA needs "
        "a 16-byte aligned base address — a view that starts mid-row (e.g. t[:, 3:]) must be copied "
        "with .contiguous() or .clone()")


def test_rows_tma_cannot_read_are_staged_both_ways(fake_gpu):
    """K = 100 and N = 257 (rows of 200 and 514 bytes): the inputs are copied into padded buffers,
    the kernel writes a padded output, copied into the given one (tests/test_gpu_matmul.py checks
    the numbers, and an output the call allocates)."""
    from fusions import matmul

    k = fake_gpu.compile(matmul)
    a, b = torch.randn(70, 100).bfloat16(), torch.randn(100, 257).bfloat16()
    out = {"out": torch.empty(70, 257, dtype=torch.bfloat16)}
    with pytest.warns(UserWarning) as caught:
        o = k(a, b, out=out)
    text = str(caught[0].message)
    for part in ("'a' (70, 100): a stride of 200 bytes in dim 0", "'b' (100, 257): a stride of 514 bytes in dim 0",
                 "'out' (70, 257): a stride of 514 bytes in dim 0"):
        assert part in text
    assert o is out["out"]
    maps = {name: address for name, address in fake_gpu.encoded}
    assert set(maps) == {"a", "b", "out"} and maps["out"] != o.data_ptr()
    assert maps["a"] != a.data_ptr() and maps["b"] != b.data_ptr()
    assert all(address % 16 == 0 for address in maps.values())


def test_bind_launches_its_own_arguments(fake_gpu):
    fusion, (a, b), out, _ = _matmul_call()
    k = fake_gpu.compile(fusion)
    bound = k.bind(a, b, out=out)
    k(a.clone(), b, out=out)   # another call of the layout: the thread's buffer, not the bound one
    assert bound() is out["out"] and bound.outputs is out and bound.device == torch.device("cuda", 0)
    eager, again = (raw for _, raw, _ in fake_gpu.launches)
    assert again == _expected_bytes(k, (a, b), out, {"M": 200, "N": 296, "K": 72}) != eager


def test_threads_pack_into_their_own_buffers(fake_gpu):
    fusion, (a, b), out, _ = _matmul_call()
    k = fake_gpu.compile(fusion)
    buffers = []

    def call():
        buffers.append(k._prepare((a, b), out)[1])

    threads = [threading.Thread(target=call) for _ in range(2)]
    for t in threads:
        t.start()
        t.join()
    call()
    call()
    assert buffers[0] is not buffers[1] and buffers[2] is buffers[3] not in buffers[:2]


def test_a_layout_first_seen_at_a_misaligned_base_is_planned_on_its_next_aligned_call(fake_gpu):
    """A misaligned base is that call's alone: the layout's later calls at aligned addresses are
    planned and launched directly (not staged for ever after)."""
    fusion, (a, b), out, _ = _matmul_call()
    k = fake_gpu.compile(fusion)
    storage = torch.empty(200 * 72 + 8, dtype=torch.bfloat16)
    shifted = storage[1:1 + 200 * 72].view(200, 72)
    shifted.copy_(a)
    with pytest.warns(UserWarning, match="base 2 bytes past a 16-byte boundary"):
        k(shifted, b, out=out)
    k(a, b, out=out)
    address = next(address for name, address in reversed(fake_gpu.encoded) if name == "a")
    assert address == a.data_ptr()                      # a's own address: no staged copy
    assert [type(p).__name__ for p in k._plans.values()] == ["_LaunchPlan"]
