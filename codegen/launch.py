"""Launch compiled cubins through the cuda-python driver API on torch's context and stream.

This is the host side of a generated kernel: checking the torch tensors a user passes in,
loading the cubin into torch's primary context (per device, on first launch), raising the
dynamic shared-memory limit, packing the parameter list and launching — with or without a
thread-block cluster. Every driver call goes through `check_cuda`, so a failure names the call
and the driver's error, never a bare integer.

Launches are asynchronous on torch's current stream; `LoadedKernel.last_error_check()`
synchronizes and turns a faulted kernel into a `CudaError` (tests use it).

The driver is only touched on first launch, so everything here that does not launch —
argument checks, parameter packing, grid and cluster checks, launch configs — runs on a
machine without a GPU.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Mapping, Sequence

import torch
from cuda.bindings import driver

__all__ = [
    "CudaError",
    "KernelParam",
    "LoadedKernel",
    "bind_kernel_args",
    "check_cuda",
    "check_tensor_args",
    "init_driver",
    "sm_count",
    "torch_context",
]


# ----------------------------------------------------------------------------- driver errors


class CudaError(RuntimeError):
    """A driver call failed. `call` names it; `error` is the CUresult; `name` its enum name."""

    def __init__(self, message: str, call: str = "", error: object = None, name: str = ""):
        super().__init__(message)
        self.call = call
        self.error = error
        self.name = name


def _error_name_and_text(error: object) -> tuple[str, str]:
    """(enum name, description) of a CUresult; the driver's strings when it can give them."""
    name = getattr(error, "name", None) or f"CUresult {int(error)}"
    text = ""
    # cuGetErrorName/String need libcuda; without a driver (CI) the enum name must do.
    try:
        err, driver_name = driver.cuGetErrorName(error)
        if err == driver.CUresult.CUDA_SUCCESS and driver_name:
            name = driver_name.decode() if isinstance(driver_name, bytes) else str(driver_name)
        err, driver_text = driver.cuGetErrorString(error)
        if err == driver.CUresult.CUDA_SUCCESS and driver_text:
            text = driver_text.decode() if isinstance(driver_text, bytes) else str(driver_text)
    except Exception:  # noqa: BLE001 - any failure here must not hide the original error
        pass
    return name, text


def check_cuda(result: object, what: str):
    """Unwrap a cuda-python result `(CUresult, *values)`; raise `CudaError` naming `what`.

    Returns None when the call returns no values, the value when it returns one, and the tuple
    of values otherwise.
    """
    if isinstance(result, tuple):
        error, values = result[0], result[1:]
    else:
        error, values = result, ()
    if error != driver.CUresult.CUDA_SUCCESS:
        name, text = _error_name_and_text(error)
        detail = f" ({text})" if text else ""
        raise CudaError(f"{what} failed: {name}{detail}", call=what, error=error, name=name)
    if not values:
        return None
    return values[0] if len(values) == 1 else values


# ----------------------------------------------------------------------------- devices


def _device_index(device: object = None) -> int:
    """CUDA device index of None (torch's current device), an int, a str or a torch.device."""
    if device is None:
        return torch.cuda.current_device()
    if isinstance(device, int):
        return device
    dev = torch.device(device)
    if dev.type != "cuda":
        raise ValueError(f"expected a CUDA device, got {dev}")
    return torch.cuda.current_device() if dev.index is None else dev.index


_initialized_devices: set[int] = set()


def init_driver(device: object = None) -> int:
    """Create torch's context on `device` (touching a CUDA tensor) and cuInit; return the index.

    torch creates its primary context lazily, and the driver calls that follow (module loads,
    tensor-map encodes) must land in the very context torch launches into.
    """
    index = _device_index(device)
    if index not in _initialized_devices:
        with torch.cuda.device(index):
            torch.empty(1, device=f"cuda:{index}")
        check_cuda(driver.cuInit(0), "cuInit(0)")
        _initialized_devices.add(index)
    return index


@contextlib.contextmanager
def torch_context(device: object = None) -> Iterator[int]:
    """Run driver calls in torch's primary context of `device`; yields the device index.

    torch.cuda.device makes the device current for the runtime, which normally makes its
    primary context current too; a thread that never made a runtime call may still have no
    context, so the primary context (the one torch uses) is bound explicitly then.
    """
    index = init_driver(device)
    with torch.cuda.device(index):
        context = check_cuda(driver.cuCtxGetCurrent(), "cuCtxGetCurrent")
        current = None
        if context is not None and int(context) != 0:
            current = int(check_cuda(driver.cuCtxGetDevice(), "cuCtxGetDevice"))
        if current != index:
            handle = check_cuda(driver.cuDeviceGet(index), f"cuDeviceGet({index})")
            primary = check_cuda(driver.cuDevicePrimaryCtxRetain(handle),
                                 f"cuDevicePrimaryCtxRetain(cuda:{index})")
            check_cuda(driver.cuCtxSetCurrent(primary), f"cuCtxSetCurrent(cuda:{index} primary)")
        yield index


@functools.cache
def _sm_count_of(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: object = None) -> int:
    """Number of SMs of `device` (default: torch's current device); sizes persistent grids."""
    return _sm_count_of(_device_index(device))


# ----------------------------------------------------------------------------- tensor checks

# TMA reads rows with 16-byte transactions from a 16-byte aligned base (DESIGN.md §6).
TMA_ALIGNMENT_BYTES = 16


def _shape_text(shape: Iterable[int]) -> str:
    return "(" + ", ".join(str(s) for s in shape) + ")"


def _dtype_text(dtype: object) -> str:
    if isinstance(dtype, (set, frozenset, tuple, list)):
        return " or ".join(sorted(str(d) for d in dtype))
    return str(dtype)


def check_tensor(
    name: str,
    tensor: object,
    dtype: object = None,
    rank: int | Sequence[int | None] | None = None,
    device: object = None,
    require_cuda: bool = True,
    alignment: bool = True,
) -> None:
    """Check one tensor argument of a kernel; raise ValueError/TypeError saying what to change.
    `alignment=False` skips the TMA rules (inner contiguity, 16-byte base and rows) for tensors
    the kernel reads with plain loads.

    Order: type, device, dtype, rank/shape, inner contiguity, base alignment, row strides — so
    each later check can be exercised on a CPU tensor with `require_cuda=False`.

    dtype: a torch.dtype, a set of them, or None (any).
    rank: an int, a shape whose entries are ints or None (any extent), or None (any).
    device: the CUDA device all arguments must be on; None accepts any CUDA device.
    """
    where = f"argument '{name}'"
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{where}: expected a torch.Tensor, got {type(tensor).__name__}")

    if require_cuda:
        if tensor.device.type != "cuda":
            target = "cuda" if device is None else f"cuda:{_device_index(device)}"
            raise ValueError(
                f"{where} is on {tensor.device}; the kernel runs on {target} — "
                f"move it with .to('{target}')"
            )
        if device is not None and tensor.device.index != _device_index(device):
            target = f"cuda:{_device_index(device)}"
            raise ValueError(
                f"{where} is on {tensor.device} but the kernel runs on {target}; all arguments "
                f"must be on one GPU — move it with .to('{target}')"
            )

    if dtype is not None:
        allowed = tuple(dtype) if isinstance(dtype, (set, frozenset, tuple, list)) else (dtype,)
        if tensor.dtype not in allowed:
            fix = f" (convert with .to({allowed[0]}))" if len(allowed) == 1 else ""
            raise ValueError(f"{where} has dtype {tensor.dtype}; required {_dtype_text(dtype)}{fix}")

    if rank is not None:
        shape = tuple(tensor.shape)
        if isinstance(rank, int):
            if len(shape) != rank:
                raise ValueError(
                    f"{where} has rank {len(shape)} (shape {_shape_text(shape)}); required rank {rank}"
                )
        else:
            expected = tuple(rank)
            matches = len(shape) == len(expected) and all(
                e is None or e == s for e, s in zip(expected, shape)
            )
            if not matches:
                wanted = "(" + ", ".join("*" if e is None else str(e) for e in expected) + ")"
                raise ValueError(f"{where} has shape {_shape_text(shape)}; required shape {wanted}")

    if tensor.dim() == 0 or not alignment:
        return
    if tensor.stride(-1) != 1 and tensor.shape[-1] != 1:
        raise ValueError(
            f"{where} is not contiguous in its innermost dimension (shape "
            f"{_shape_text(tensor.shape)}, strides {_shape_text(tensor.stride())}); TMA needs "
            "stride(-1) == 1 — call .contiguous() (a transposed view must be materialised)"
        )

    element = tensor.element_size()
    offset = tensor.data_ptr() % TMA_ALIGNMENT_BYTES
    if offset:
        raise ValueError(
            f"{where} has data_ptr {tensor.data_ptr():#x}, {offset} bytes past a 16-byte boundary; "
            "TMA needs a 16-byte aligned base address — a view that starts mid-row "
            "(e.g. t[:, 3:]) must be copied with .contiguous() or .clone()"
        )

    for dim in range(tensor.dim() - 1):
        if tensor.shape[dim] == 1:
            continue  # never stepped, so its stride is free (tensor_map_for normalises it)
        stride_bytes = tensor.stride(dim) * element
        if stride_bytes % TMA_ALIGNMENT_BYTES:
            row_elems = TMA_ALIGNMENT_BYTES // element
            raise ValueError(
                f"{where} has stride {tensor.stride(dim)} elements = {stride_bytes} bytes in dim "
                f"{dim} (shape {_shape_text(tensor.shape)}); TMA needs 16-byte aligned rows: "
                f"every stride but the innermost must be a multiple of 16 bytes — pad the inner "
                f"dimension to a multiple of {row_elems} {tensor.dtype} elements"
            )


def check_tensor_args(
    names: Sequence[str],
    tensors: Sequence[object],
    expected: Sequence[tuple[object, int | Sequence[int | None] | None]],
    device: object = None,
    require_cuda: bool = True,
) -> None:
    """Check every kernel argument; `expected[i]` is (dtype, rank or shape) for `tensors[i]`.

    `device` None means: the device of the first CUDA tensor; all must share it.
    """
    if not len(names) == len(tensors) == len(expected):
        raise TypeError(
            f"expected {len(expected)} tensor arguments ({', '.join(names)}), "
            f"got {len(tensors)}"
        )
    if require_cuda and device is None:
        device = next(
            (t.device for t in tensors if isinstance(t, torch.Tensor) and t.device.type == "cuda"),
            None,
        )
    for name, tensor, (dtype, rank) in zip(names, tensors, expected):
        check_tensor(name, tensor, dtype, rank, device, require_cuda)


# ----------------------------------------------------------------------------- parameters

PARAM_KINDS = ("tensor_map", "ptr", "i32", "f32")
_SWIZZLE_BYTES = (0, 32, 64, 128)


@dataclass(frozen=True)
class KernelParam:
    """One kernel parameter, in declaration order.

    kind "tensor_map": a `const __grid_constant__ CUtensorMap` over input `source`, with `box`
        (outermost first) and `swizzle` bytes;
    kind "ptr": the data pointer of input `source`;
    kind "i32" / "f32": a scalar named `name` (its value comes from the scalars at bind time).
    """

    name: str
    kind: str
    source: str | None = None
    box: tuple[int, ...] = ()
    swizzle: int = 0

    def __post_init__(self) -> None:
        where = f"kernel parameter '{self.name}'"
        if self.kind not in PARAM_KINDS:
            raise ValueError(f"{where}: kind must be one of {', '.join(PARAM_KINDS)}, got {self.kind!r}")
        if self.kind in ("tensor_map", "ptr") and not self.source:
            raise ValueError(f"{where}: a {self.kind} parameter needs source= (the input it reads)")
        if self.kind == "tensor_map":
            if not self.box:
                raise ValueError(f"{where}: a tensor_map parameter needs box= (tile extents)")
            if self.swizzle not in _SWIZZLE_BYTES:
                raise ValueError(f"{where}: swizzle must be one of 0, 32, 64, 128, got {self.swizzle}")
        elif self.box or self.swizzle:
            raise ValueError(f"{where}: box/swizzle only apply to tensor_map parameters, not {self.kind}")


def bind_kernel_args(
    params: Sequence[KernelParam],
    tensors: Mapping[str, torch.Tensor],
    scalars: Mapping[str, int | float] | None = None,
) -> list[tuple[str, object]]:
    """The `launch` argument list for `params`: tensor maps encoded, pointers and scalars read."""
    from .tma import tensor_map_for  # tma builds on this module's driver helpers

    scalars = scalars or {}
    args: list[tuple[str, object]] = []
    for param in params:
        if param.kind in ("tensor_map", "ptr"):
            if param.source not in tensors:
                raise KeyError(f"kernel parameter '{param.name}' reads input '{param.source}', "
                               f"which is not among the inputs ({', '.join(tensors)})")
            tensor = tensors[param.source]
            if param.kind == "tensor_map":
                args.append(("tensor_map", tensor_map_for(tensor, param.box, param.swizzle, param.name)))
            else:
                args.append(("ptr", tensor.data_ptr()))
        else:
            if param.name not in scalars:
                raise KeyError(f"kernel parameter '{param.name}' ({param.kind}) has no value among "
                               f"the scalars ({', '.join(scalars) or 'none'})")
            args.append((param.kind, scalars[param.name]))
    return args


_I32_MIN, _I32_MAX = -(2**31), 2**31 - 1


def _marshal_args(args: Sequence[tuple[str, object]]) -> tuple[tuple, tuple]:
    """(values, types) for cuda-python's kernelParams.

    A CUtensorMap goes with type None: cuda-python then passes its 128-byte storage by address
    and the driver copies it by value into the `__grid_constant__` parameter.
    """
    values: list[object] = []
    types: list[object] = []
    for position, arg in enumerate(args):
        if not (isinstance(arg, tuple) and len(arg) == 2 and isinstance(arg[0], str)):
            raise TypeError(f"kernel argument {position}: expected a (kind, value) pair, got {arg!r}")
        kind, value = arg
        where = f"kernel argument {position} ({kind})"
        if kind == "tensor_map":
            if not isinstance(value, driver.CUtensorMap):
                raise TypeError(f"{where}: expected a driver.CUtensorMap (from tensor_map_for), "
                                f"got {type(value).__name__}")
            values.append(value)
            types.append(None)
        elif kind == "ptr":
            if isinstance(value, torch.Tensor):
                raise TypeError(f"{where}: expected an int device address, got a torch.Tensor — "
                                "pass tensor.data_ptr()")
            if isinstance(value, driver.CUdeviceptr):
                value = int(value)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise TypeError(f"{where}: expected a non-negative int device address, got {value!r}")
            values.append(value)
            types.append(ctypes.c_void_p)
        elif kind == "i32":
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"{where}: expected an int, got {type(value).__name__} {value!r}")
            if not _I32_MIN <= value <= _I32_MAX:
                raise ValueError(f"{where}: {value} does not fit a 32-bit int "
                                 f"[{_I32_MIN}, {_I32_MAX}]")
            values.append(value)
            types.append(ctypes.c_int)
        elif kind == "f32":
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise TypeError(f"{where}: expected a float, got {type(value).__name__} {value!r}")
            values.append(float(value))
            types.append(ctypes.c_float)
        else:
            raise ValueError(f"kernel argument {position}: kind must be one of "
                             f"{', '.join(PARAM_KINDS)}, got {kind!r}")
    return tuple(values), tuple(types)


# ----------------------------------------------------------------------------- grid / cluster

_MAX_GRID = (2**31 - 1, 65535, 65535)
_MAX_PORTABLE_CLUSTER = 8
_MAX_THREADS = 1024


def _dim3(value: int | Sequence[int], what: str) -> tuple[int, int, int]:
    dims = (value,) if isinstance(value, int) else tuple(value) if isinstance(value, (tuple, list)) else ()
    if not 1 <= len(dims) <= 3 or not all(isinstance(d, int) and not isinstance(d, bool) for d in dims):
        raise ValueError(f"{what} must be an int or a tuple of 1 to 3 ints, got {value!r}")
    if any(d < 1 for d in dims):
        raise ValueError(f"{what} extents must be >= 1, got {value!r}")
    return tuple(dims) + (1,) * (3 - len(dims))  # type: ignore[return-value]


def _grid3(grid: int | Sequence[int]) -> tuple[int, int, int]:
    dims = _dim3(grid, "grid")
    for axis, (extent, limit) in enumerate(zip(dims, _MAX_GRID)):
        if extent > limit:
            raise ValueError(f"grid {'xyz'[axis]} extent {extent} exceeds the CUDA limit {limit}")
    return dims


def _check_cluster(grid: tuple[int, int, int], cluster: int | Sequence[int]) -> tuple[int, int, int]:
    dims = _dim3(cluster, "cluster")
    size = dims[0] * dims[1] * dims[2]
    if size > _MAX_PORTABLE_CLUSTER:
        raise ValueError(f"cluster {dims} has {size} CTAs; the portable limit is "
                         f"{_MAX_PORTABLE_CLUSTER} (non-portable sizes are not enabled)")
    for axis in range(3):
        if grid[axis] % dims[axis]:
            raise ValueError(f"grid {grid} is not divisible by cluster {dims} along "
                             f"{'xyz'[axis]}: round the grid up to a multiple of {dims[axis]}")
    return dims


def _launch_config(grid: tuple[int, int, int], threads: int, smem_bytes: int,
                   stream: driver.CUstream, cluster: tuple[int, int, int]) -> driver.CUlaunchConfig:
    """The cuLaunchKernelEx config for a cluster launch."""
    attribute = driver.CUlaunchAttribute()
    attribute.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
    attribute.value.clusterDim.x, attribute.value.clusterDim.y, attribute.value.clusterDim.z = cluster
    config = driver.CUlaunchConfig()
    config.gridDimX, config.gridDimY, config.gridDimZ = grid
    config.blockDimX, config.blockDimY, config.blockDimZ = threads, 1, 1
    config.sharedMemBytes = smem_bytes
    config.hStream = stream
    config.attrs = [attribute]
    config.numAttrs = 1
    return config


def _stream_handle(stream: object, device_index: int) -> driver.CUstream:
    if stream is None:
        return driver.CUstream(torch.cuda.current_stream(device_index).cuda_stream)
    if isinstance(stream, driver.CUstream):
        return stream
    if isinstance(stream, torch.cuda.Stream):
        return driver.CUstream(stream.cuda_stream)
    if isinstance(stream, int):
        return driver.CUstream(stream)
    raise TypeError(f"stream must be None, a torch.cuda.Stream, a driver.CUstream or an int "
                    f"handle, got {type(stream).__name__}")


# ----------------------------------------------------------------------------- loaded kernel


class LoadedKernel:
    """One `extern "C"` kernel of a cubin, loaded into torch's context of each device it runs on."""

    def __init__(self, cubin_path: Path, kernel_name: str, smem_bytes: int, threads: int):
        self.cubin_path = Path(cubin_path)
        self.kernel_name = kernel_name
        if not isinstance(threads, int) or not 1 <= threads <= _MAX_THREADS:
            raise ValueError(f"kernel '{kernel_name}': threads must be in [1, {_MAX_THREADS}], got {threads!r}")
        if not isinstance(smem_bytes, int) or smem_bytes < 0:
            raise ValueError(f"kernel '{kernel_name}': smem_bytes must be a non-negative int, got {smem_bytes!r}")
        if not self.cubin_path.is_file():
            raise FileNotFoundError(f"kernel '{kernel_name}': cubin {self.cubin_path} does not exist")
        self.smem_bytes = smem_bytes
        self.threads = threads
        self._image = self.cubin_path.read_bytes()
        self._modules: dict[int, object] = {}    # device index -> CUmodule (kept alive)
        self._functions: dict[int, object] = {}  # device index -> CUfunction
        self._last_device: int | None = None

    def __repr__(self) -> str:
        return (f"LoadedKernel({self.kernel_name!r}, cubin={str(self.cubin_path)!r}, "
                f"threads={self.threads}, smem_bytes={self.smem_bytes})")

    def _function_for(self, device_index: int):
        function = self._functions.get(device_index)
        if function is not None:
            return function
        where = f"kernel '{self.kernel_name}' ({self.cubin_path})"
        with torch_context(device_index):
            device = check_cuda(driver.cuDeviceGet(device_index), f"cuDeviceGet({device_index})")
            limit = check_cuda(
                driver.cuDeviceGetAttribute(
                    driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
                    device),
                "cuDeviceGetAttribute(MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)")
            if self.smem_bytes > limit:
                raise ValueError(f"{where} asks for {self.smem_bytes} bytes of dynamic shared "
                                 f"memory; cuda:{device_index} allows at most {limit} per block — "
                                 "use fewer stages or smaller tiles")
            module = check_cuda(driver.cuModuleLoadData(self._image),
                                f"cuModuleLoadData({self.cubin_path})")
            try:
                function = check_cuda(
                    driver.cuModuleGetFunction(module, self.kernel_name.encode()),
                    f"cuModuleGetFunction({self.kernel_name!r})")
            except CudaError as error:
                if error.error == driver.CUresult.CUDA_ERROR_NOT_FOUND:
                    raise CudaError(
                        f"{error} — {self.cubin_path} has no kernel named '{self.kernel_name}'; "
                        f"declare it extern \"C\" (`cuobjdump -symbols {self.cubin_path}` lists "
                        "the names)", call=error.call, error=error.error, name=error.name) from None
                raise
            check_cuda(
                driver.cuFuncSetAttribute(
                    function,
                    driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    self.smem_bytes),
                f"cuFuncSetAttribute({self.kernel_name}, MAX_DYNAMIC_SHARED_SIZE_BYTES, {self.smem_bytes})")
        self._modules[device_index] = module
        self._functions[device_index] = function
        return function

    def launch(self, grid: int | tuple[int, ...], args: list[tuple[str, object]],
               stream: object = None, cluster: int | tuple[int, ...] = (1, 1, 1)) -> None:
        """Launch asynchronously on `stream` (default: torch's current stream)."""
        grid3 = _grid3(grid)
        cluster3 = _check_cluster(grid3, cluster)
        params = _marshal_args(args)
        device_index = torch.cuda.current_device()
        function = self._function_for(device_index)
        handle = _stream_handle(stream, device_index)
        if cluster3 == (1, 1, 1):
            result = driver.cuLaunchKernel(function, *grid3, self.threads, 1, 1,
                                           self.smem_bytes, handle, params, 0)
        else:
            config = _launch_config(grid3, self.threads, self.smem_bytes, handle, cluster3)
            result = driver.cuLaunchKernelEx(config, function, params, 0)
        if result[0] != driver.CUresult.CUDA_SUCCESS:  # the message is built only on failure
            call = "cuLaunchKernel" if cluster3 == (1, 1, 1) else "cuLaunchKernelEx"
            check_cuda(result, f"{call}({self.kernel_name} grid={grid3} block=({self.threads}, 1, 1) "
                               f"cluster={cluster3} smem={self.smem_bytes} args={len(args)})")
        self._last_device = device_index

    def last_error_check(self) -> None:
        """Synchronize the device of the last launch; raise CudaError if the kernel faulted.

        A fault (illegal address, misaligned TMA, trap) is sticky: the context is unusable
        afterwards, so this is for tests and debugging, not the hot path.
        """
        if self._last_device is None:
            return
        with torch_context(self._last_device):
            check_cuda(driver.cuCtxSynchronize(),
                       f"cuCtxSynchronize after launching {self.kernel_name} on "
                       f"cuda:{self._last_device}")
