"""Launch compiled cubins through the cuda-python driver API on torch's context and stream.

This is the host side of a generated kernel: checking the torch tensors a user passes in,
loading the cubin into torch's primary context (per device, on first launch), raising the
dynamic shared-memory limit, packing the argument list and launching — with or without a
thread-block cluster. Every driver call goes through `check_cuda` (`cuda_driver.py`), so a
failure names the call and the driver's error, never a bare integer.

Multi-GPU: a launch names the device of its tensors (`launch(..., device=)`), and everything
is that device's, whatever the thread's current device is: the module and function (a cubin
loaded in one context is not valid in another), the context the launch is made in, and the
stream (torch's current stream *of that device*). Threads may drive different devices at once.

Launches are asynchronous on torch's current stream; `LoadedKernel.last_error_check()`
synchronizes and turns a faulted kernel into a `CudaError` (tests use it).

The eager call's hot path (`LoadedKernel.launch_packed`) takes `PackedArguments`: the argument
storage and the `void**` array the driver reads, built once per argument layout, with only the
data pointers and tensor maps re-set per call; it switches context only when the thread's
current one is not the device's primary context.

The driver is only touched on first launch, so everything here that does not launch —
argument checks, argument packing, grid and cluster checks, launch configs — runs on a
machine without a GPU.
"""
from __future__ import annotations

import ctypes
import functools
import threading
from pathlib import Path
from typing import Iterable, Sequence

import torch
from cuda.bindings import driver

from wsched.target import INT_MAX, INT_MIN
from wsched.target import (MAX_GRID, MAX_PORTABLE_CLUSTER, MAX_THREADS, TMA_GLOBAL_ADDRESS_ALIGNMENT,
                           TMA_STRIDE_ALIGNMENT)

from .cuda_driver import CudaError, check_cuda, device_index, is_current, torch_context

__all__ = ["ARG_TYPES", "LoadedKernel", "PackedArguments", "TmaLayoutError", "check_base_alignment", "check_tensor",
           "current_stream_handle", "sm_count", "tma_aligned_empty", "tma_layout_problem",
           "tma_ready"]


@functools.cache
def _sm_count_of(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: object = None) -> int:
    """Number of SMs of `device` (default: torch's current device); sizes persistent grids."""
    return _sm_count_of(device_index(device))


# ----------------------------------------------------------------------------- tensor checks


def _shape_text(shape: Iterable[int]) -> str:
    return "(" + ", ".join(str(s) for s in shape) + ")"


def _dtype_text(dtype: object) -> str:
    if isinstance(dtype, (set, frozenset, tuple, list)):
        return " or ".join(sorted(str(d) for d in dtype))
    return str(dtype)


class TmaLayoutError(ValueError):
    """A tensor TMA cannot address as it is: an inner stride other than 1, a base address or a
    row stride that is not a multiple of 16 bytes. The eager call copies such a tensor into an
    aligned buffer instead (`CompiledKernel._run_staged`); `name` is the argument."""

    def __init__(self, name: str, message: str, address: bool = False):
        super().__init__(message)
        self.name = name
        self.address = address   # the base address's fault: another call of the layout may be fine


def _tma_fault(tensor: torch.Tensor) -> tuple[str, int] | None:
    """The first of TMA's layout rules `tensor` breaks, in check order: ("inner", its innermost
    stride), ("base", bytes past the alignment) or ("stride", the dim); None where it breaks none.
    A dim of extent 1 is never stepped, so its stride is free (tensor_map_for normalises it)."""
    if tensor.dim() == 0:
        return None
    if tensor.stride(-1) != 1 and tensor.shape[-1] != 1:
        return "inner", tensor.stride(-1)
    offset = tensor.data_ptr() % TMA_GLOBAL_ADDRESS_ALIGNMENT
    if offset:
        return "base", offset
    element = tensor.element_size()
    for dim in range(tensor.dim() - 1):
        if tensor.shape[dim] != 1 and tensor.stride(dim) * element % TMA_STRIDE_ALIGNMENT:
            return "stride", dim
    return None


def tma_layout_problem(tensor: torch.Tensor) -> str | None:
    """Why TMA cannot address `tensor` as it is (check_tensor's rules, in a few words), or None."""
    fault = _tma_fault(tensor)
    if fault is None:
        return None
    rule, value = fault
    if rule == "inner":
        return f"innermost stride {value}"
    if rule == "base":
        return f"base {value} bytes past a {TMA_GLOBAL_ADDRESS_ALIGNMENT}-byte boundary"
    return f"a stride of {tensor.stride(value) * tensor.element_size()} bytes in dim {value}"


def tma_ready(tensor: torch.Tensor) -> bool:
    """Whether TMA can address `tensor` as it is."""
    return tma_layout_problem(tensor) is None


def tma_aligned_empty(tensor: torch.Tensor) -> torch.Tensor:
    """An uninitialised tensor of `tensor`'s shape, dtype and device that TMA can address: its
    last dim padded to a multiple of 16 bytes in memory (a view of the first shape[-1] columns;
    a TMA map's extents are the shape, so the padding is never read or written)."""
    if tensor.dim() == 0:
        return torch.empty((), dtype=tensor.dtype, device=tensor.device)
    per_row = TMA_STRIDE_ALIGNMENT // tensor.element_size()
    *outer, last = tensor.shape
    padded = torch.empty((*outer, -(-last // per_row) * per_row), dtype=tensor.dtype, device=tensor.device)
    return padded[..., :last]


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
            target = "cuda" if device is None else f"cuda:{device_index(device)}"
            raise ValueError(
                f"{where} is on {tensor.device}; the kernel runs on {target} — "
                f"move it with .to('{target}')"
            )
        if device is not None and tensor.device.index != device_index(device):
            target = f"cuda:{device_index(device)}"
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

    fault = _tma_fault(tensor) if alignment else None
    if fault is None:
        return
    rule, value = fault
    if rule == "inner":
        raise TmaLayoutError(
            name,
            f"{where} is not contiguous in its innermost dimension (shape "
            f"{_shape_text(tensor.shape)}, strides {_shape_text(tensor.stride())}); TMA needs "
            "stride(-1) == 1 — call .contiguous() (a transposed view must be materialised)"
        )
    if rule == "base":
        check_base_alignment(name, tensor.data_ptr())
    element = tensor.element_size()
    raise TmaLayoutError(
        name,
        f"{where} has stride {tensor.stride(value)} elements = {tensor.stride(value) * element} bytes in dim "
        f"{value} (shape {_shape_text(tensor.shape)}); TMA needs {TMA_STRIDE_ALIGNMENT}-byte "
        f"aligned rows: every stride but the innermost must be a multiple of "
        f"{TMA_STRIDE_ALIGNMENT} bytes — pad the inner dimension to a multiple of "
        f"{TMA_STRIDE_ALIGNMENT // element} {tensor.dtype} elements"
    )


def check_base_alignment(name: str, data_ptr: int) -> None:
    """TMA's base address rule, checked on every call (a tensor of a seen layout may start anywhere)."""
    offset = data_ptr % TMA_GLOBAL_ADDRESS_ALIGNMENT
    if offset:
        raise TmaLayoutError(
            name,
            f"argument '{name}' has data_ptr {data_ptr:#x}, {offset} bytes past a "
            f"{TMA_GLOBAL_ADDRESS_ALIGNMENT}-byte boundary; TMA needs a "
            f"{TMA_GLOBAL_ADDRESS_ALIGNMENT}-byte aligned base address — a view that starts mid-row "
            "(e.g. t[:, 3:]) must be copied with .contiguous() or .clone()",
            address=True,
        )


# ----------------------------------------------------------------------------- arguments

# The argument types a kernel takes, as `launch` receives them: (type, value) pairs.
ARG_TYPES = ("tensor_map", "ptr", "i32", "f32")
_I32_MIN, _I32_MAX = INT_MIN, INT_MAX   # the kernel's `int` parameters


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
        arg_type, value = arg
        where = f"kernel argument {position} ({arg_type})"
        if arg_type == "tensor_map":
            if not isinstance(value, driver.CUtensorMap):
                raise TypeError(f"{where}: expected a driver.CUtensorMap (from tensor_map_for), "
                                f"got {type(value).__name__}")
            values.append(value)
            types.append(None)
        elif arg_type == "ptr":
            if isinstance(value, torch.Tensor):
                raise TypeError(f"{where}: expected an int device address, got a torch.Tensor — "
                                "pass tensor.data_ptr()")
            if isinstance(value, driver.CUdeviceptr):
                value = int(value)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise TypeError(f"{where}: expected a non-negative int device address, got {value!r}")
            values.append(value)
            types.append(ctypes.c_void_p)
        elif arg_type == "i32":
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"{where}: expected an int, got {type(value).__name__} {value!r}")
            if not _I32_MIN <= value <= _I32_MAX:
                raise ValueError(f"{where}: {value} does not fit a 32-bit int "
                                 f"[{_I32_MIN}, {_I32_MAX}]")
            values.append(value)
            types.append(ctypes.c_int)
        elif arg_type == "f32":
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise TypeError(f"{where}: expected a float, got {type(value).__name__} {value!r}")
            values.append(float(value))
            types.append(ctypes.c_float)
        else:
            raise ValueError(f"kernel argument {position}: kind must be one of "
                             f"{', '.join(ARG_TYPES)}, got {arg_type!r}")
    return tuple(values), tuple(types)


# Bytes the driver copies for each argument type: a CUtensorMap is an opaque 128-byte struct.
PARAM_BYTES = {"tensor_map": 128, "ptr": 8, "i32": 4, "f32": 4}


class PackedArguments:
    """A kernel's argument list packed for cuLaunchKernel once: one slot of storage per parameter
    (a pointer, an int, a float, or the CUtensorMap itself) and the `void**` array of the slots'
    addresses that the driver reads. A call re-sets only what changes — data pointers
    (`set_pointer`) and tensor maps (`set_tensor_map`) — and hands the driver `address`, so
    nothing is packed per call. The driver copies the values at launch, so the slots may change
    right after it returns; one buffer must not be patched by two threads at once (the eager
    call keeps one per thread).

    Built from the (type, value) pairs `LoadedKernel.launch` takes, with the same checks.
    """

    def __init__(self, args: Sequence[tuple[str, object]]):
        values, types = _marshal_args(args)
        self.types = tuple(arg_type for arg_type, _ in args)   # "tensor_map" | "ptr" | "i32" | "f32"
        # a CUtensorMap is its own storage; every other value gets a ctypes cell
        self._slots = [value if ctype is None else ctype(value) for value, ctype in zip(values, types)]
        self._pointers = (ctypes.c_void_p * max(1, len(values)))(
            *[slot.getPtr() if ctype is None else ctypes.addressof(slot)
              for slot, ctype in zip(self._slots, types)])
        self.address = ctypes.addressof(self._pointers) if values else 0   # 0: NULL, no parameters

    def __len__(self) -> int:
        return len(self.types)

    def set_pointer(self, position: int, address: int) -> None:
        self._slots[position].value = address

    def set_tensor_map(self, position: int, tensor_map: driver.CUtensorMap) -> None:
        if self._slots[position] is not tensor_map:
            self._slots[position] = tensor_map   # kept alive: the driver reads it at launch
            self._pointers[position] = tensor_map.getPtr()

    def copy(self) -> "PackedArguments":
        """An independent buffer with the same values (tensor maps shared: they are not edited)."""
        return PackedArguments(self.pairs())

    def pairs(self) -> list[tuple[str, object]]:
        """The arguments as (type, value) pairs, as `LoadedKernel.launch` takes them."""
        return [(arg_type, slot if arg_type == "tensor_map" else
                 (slot.value or 0) if arg_type == "ptr" else slot.value)   # a NULL c_void_p reads None
                for arg_type, slot in zip(self.types, self._slots)]

    def raw(self) -> list[bytes]:
        """The bytes the driver copies for each parameter, in order."""
        return [ctypes.string_at(self._pointers[i], PARAM_BYTES[arg_type])
                for i, arg_type in enumerate(self.types)]


# ----------------------------------------------------------------------------- grid / cluster


def _dim3(value: int | Sequence[int], what: str) -> tuple[int, int, int]:
    dims = (value,) if isinstance(value, int) else tuple(value) if isinstance(value, (tuple, list)) else ()
    if not 1 <= len(dims) <= 3 or not all(isinstance(d, int) and not isinstance(d, bool) for d in dims):
        raise ValueError(f"{what} must be an int or a tuple of 1 to 3 ints, got {value!r}")
    if any(d < 1 for d in dims):
        raise ValueError(f"{what} extents must be >= 1, got {value!r}")
    return tuple(dims) + (1,) * (3 - len(dims))  # type: ignore[return-value]


def _grid3(grid: int | Sequence[int]) -> tuple[int, int, int]:
    dims = _dim3(grid, "grid")
    for axis, (extent, limit) in enumerate(zip(dims, MAX_GRID)):
        if extent > limit:
            raise ValueError(f"grid {'xyz'[axis]} extent {extent} exceeds the CUDA limit {limit}")
    return dims


def _check_cluster(grid: tuple[int, int, int], cluster: int | Sequence[int]) -> tuple[int, int, int]:
    dims = _dim3(cluster, "cluster")
    size = dims[0] * dims[1] * dims[2]
    if size > MAX_PORTABLE_CLUSTER:
        raise ValueError(f"cluster {dims} has {size} CTAs; the portable limit is "
                         f"{MAX_PORTABLE_CLUSTER} (non-portable sizes are not enabled)")
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


def _current_stream_handle(device_index: int) -> int:
    return torch.cuda.current_stream(device_index).cuda_stream


# current_stream_handle(device_index): the handle of torch's current stream of that device. Read
# without building a torch.cuda.Stream where torch has the raw call (Triton's launcher reads the
# stream the same way); through the public route where this torch build lacks it.
current_stream_handle = getattr(torch._C, "_cuda_getCurrentRawStream", _current_stream_handle)


def _stream_handle(stream: object, device_index: int) -> driver.CUstream:
    if stream is None:
        return driver.CUstream(current_stream_handle(device_index))
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
        if not isinstance(threads, int) or not 1 <= threads <= MAX_THREADS:
            raise ValueError(f"kernel '{kernel_name}': threads must be in [1, {MAX_THREADS}], got {threads!r}")
        if not isinstance(smem_bytes, int) or smem_bytes < 0:
            raise ValueError(f"kernel '{kernel_name}': smem_bytes must be a non-negative int, got {smem_bytes!r}")
        if not self.cubin_path.is_file():
            raise FileNotFoundError(f"kernel '{kernel_name}': cubin {self.cubin_path} does not exist")
        self.smem_bytes = smem_bytes
        self.threads = threads
        self._image = self.cubin_path.read_bytes()
        self._modules: dict[int, object] = {}    # device index -> CUmodule (kept alive)
        self._functions: dict[int, object] = {}  # device index -> CUfunction
        self._load_lock = threading.Lock()       # one load per device, also from many threads

    def __repr__(self) -> str:
        return (f"LoadedKernel({self.kernel_name!r}, cubin={str(self.cubin_path)!r}, "
                f"threads={self.threads}, smem_bytes={self.smem_bytes})")

    def _function_for(self, device_index: int):
        """The kernel's CUfunction in the primary context of `device_index`, loaded on first use
        (call inside `torch_context(device_index)`)."""
        function = self._functions.get(device_index)
        if function is not None:
            return function
        with self._load_lock:
            function = self._functions.get(device_index)
            if function is None:
                function = self._load(device_index)
        return function

    def _load(self, device_index: int):
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

    def cluster_sms(self, device_index: int, cluster_size: int) -> int:
        """The SMs that clusters of `cluster_size` CTAs of this kernel can hold at once on the device
        (cuOccupancyMaxActiveClusters x cluster_size): a cluster lies within one GPC, so a GPC whose
        SM count the size does not divide leaves some idle; a persistent grid sized by the SM count
        alone would run its last clusters in a second wave."""
        with torch_context(device_index) as index:
            function = self._function_for(index)
            config = _launch_config((cluster_size, 1, 1), self.threads, self.smem_bytes, driver.CUstream(0),
                                    (cluster_size, 1, 1))
            clusters = check_cuda(driver.cuOccupancyMaxActiveClusters(function, config),
                                  f"cuOccupancyMaxActiveClusters({self.kernel_name}, cluster {cluster_size})")
        if clusters < 1:
            raise CudaError(f"{self.kernel_name}: no cluster of {cluster_size} CTAs ({self.threads} threads, "
                            f"{self.smem_bytes} bytes of shared memory each) fits on cuda:{device_index}; use a "
                            f"smaller cluster", call="cuOccupancyMaxActiveClusters")
        return clusters * cluster_size

    def launch(self, grid: int | tuple[int, ...], args: list[tuple[str, object]] | PackedArguments,
               stream: object = None, cluster: int | tuple[int, ...] = (1, 1, 1),
               device: object = None) -> None:
        """Launch asynchronously on `device` (default: torch's current device; pass the device
        the arguments live on) and `stream` (default: torch's current stream of `device`)."""
        grid3 = _grid3(grid)
        cluster3 = _check_cluster(grid3, cluster)
        params = args.address if isinstance(args, PackedArguments) else _marshal_args(args)
        with torch_context(device) as index:
            function = self._function_for(index)
            handle = _stream_handle(stream, index)
            if cluster3 == (1, 1, 1):
                result = driver.cuLaunchKernel(function, *grid3, self.threads, 1, 1,
                                               self.smem_bytes, handle, params, 0)
            else:
                config = _launch_config(grid3, self.threads, self.smem_bytes, handle, cluster3)
                result = driver.cuLaunchKernelEx(config, function, params, 0)
        if result[0]:   # not CUDA_SUCCESS (0); the message is built only on failure
            self._launch_failed(result, grid3, cluster3, len(args), index)

    def launch_packed(self, grid: int, args: PackedArguments, device_index: int) -> None:
        """The eager call's launch: `grid` CTAs (an int the caller has checked against the
        limit), packed arguments, torch's current stream of device `device_index`, no cluster.
        Once the module is loaded and the device's primary context is current — a call from a
        thread that already works on that device — this is one context query and the launch."""
        function = self._functions.get(device_index)
        if function is not None and is_current(device_index):
            result = driver.cuLaunchKernel(function, grid, 1, 1, self.threads, 1, 1, self.smem_bytes,
                                           current_stream_handle(device_index), args.address, 0)
        else:   # first launch on the device, or another context current: switch, then restore
            with torch_context(device_index):
                function = self._function_for(device_index)
                result = driver.cuLaunchKernel(function, grid, 1, 1, self.threads, 1, 1, self.smem_bytes,
                                               current_stream_handle(device_index), args.address, 0)
        if result[0]:
            self._launch_failed(result, (grid, 1, 1), (1, 1, 1), len(args), device_index)

    def _launch_failed(self, result, grid3, cluster3, arg_count: int, index: int) -> None:
        call = "cuLaunchKernel" if cluster3 == (1, 1, 1) else "cuLaunchKernelEx"
        check_cuda(result, f"{call}({self.kernel_name} grid={grid3} block=({self.threads}, 1, 1) "
                           f"cluster={cluster3} smem={self.smem_bytes} args={arg_count} on cuda:{index})")

    def last_error_check(self, device: object = None) -> None:
        """Synchronize `device` (default: every device the kernel is loaded on, so also those
        the native launch path launched on without passing here); raise CudaError if the
        kernel faulted.

        A fault (illegal address, misaligned TMA, trap) is sticky: the context is unusable
        afterwards, so this is for tests and debugging, not the hot path.
        """
        for index in sorted(self._functions) if device is None else [device_index(device)]:
            with torch_context(index):
                check_cuda(driver.cuCtxSynchronize(),
                           f"cuCtxSynchronize after launching {self.kernel_name} on cuda:{index}")
