"""The eager call's native launch path: argument layouts seen before are launched from C.

A Python call of a compiled kernel costs its checks, its output allocation and a cuda-python
launch: 15-20 µs of host time. Most calls repeat a layout already checked, so the second time the
Python path runs a layout it hands what it worked out to a `Launcher` (`codegen/native_launch.c`,
built as `wsched.codegen._native_launch` when the package is installed): a `Plan` holding the
layout of every tensor, the outputs to allocate, the packed parameters with the place of each data
pointer and TMA map, and the kernel's function, grid and context. `CompiledKernel.__call__` tries
the launcher first; a call that matches a plan exactly is launched without Python in between, and
anything else (a new layout, a misaligned base, another context, a tensor subclass) falls back to
the Python path, which checks everything and names what is wrong. A launcher keeps the plans of
its eight most recently used layouts; a dropped one is handed over again on its next Python-path
call. A layout used once (a decode step whose key count grows every step) is never planned. If
handing a plan over fails, the kernel warns and stays on the Python path; a build of the
extension from another version of the C source is not used (`ABI`).

What a plan repeats per call is exactly what `_LaunchPlan.pack` and `LoadedKernel.launch_packed`
do: data pointers into their slots, TMA maps encoded once per (parameter, address) and kept,
torch's current stream of the device, `cuLaunchKernel`. A kernel with a spans table (a document
mask's) has its helper launched first, as `_LaunchPlan.pack_spans` does, into a table allocated
per call (as the outputs are; released when the call returns, torch's allocator keeping stream
order, and from the graph's pool under CUDA graph capture). The driver's entry points are read from
libcuda by address (ctypes), so the extension links against nothing but Python.

`WSCHED_NATIVE_LAUNCH=0` turns the path off (every call takes the Python path); `native.available()`
says whether it is on, and `available.reason` why not.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from wsched import knobs

ABI = 3   # native_launch.c's NATIVE_ABI: what this module calls it with

try:
    from . import _native_launch
except ImportError as error:   # built by `pip install` where a C compiler is found (setup.py)
    _native_launch = None
    _IMPORT_ERROR = f"the extension wsched.codegen._native_launch is not built ({error}); reinstall with a C compiler"
else:
    _IMPORT_ERROR = ""
    if getattr(_native_launch, "ABI", None) != ABI:   # an in-place build older than the source
        _IMPORT_ERROR = (f"the extension wsched.codegen._native_launch ({_native_launch.__file__}) was built from "
                         f"another version of codegen/native_launch.c; rebuild it with `pip install -e .`")
        _native_launch = None

__all__ = ["CAPACITY", "MAX_PRE", "MAX_TENSORS", "available", "call", "launcher", "plan"]

CAPACITY = 8   # argument layouts a launcher keeps (the most recently used first)
MAX_TENSORS = _native_launch.MAX_TENSORS if _native_launch is not None else 0   # tensors a plan takes
MAX_PRE = _native_launch.MAX_PRE if _native_launch is not None else 0   # helper launches before its kernel
TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)   # exact types a native call takes


def available() -> bool:
    """Whether calls may take the native path (the extension is built and not turned off)."""
    if not knobs.native_launch():
        available.reason = "WSCHED_NATIVE_LAUNCH=0"
        return False
    available.reason = _IMPORT_ERROR
    return _native_launch is not None


available.reason = ""


@functools.cache
def _driver_entry_points() -> tuple[int, int, int]:
    """Addresses of cuLaunchKernel, cuCtxGetCurrent and cuTensorMapEncodeTiled in libcuda (the
    library cuda-python and torch have loaded already: a launch has run before a plan is made)."""
    lib = ctypes.CDLL("libcuda.so.1")
    return tuple(ctypes.cast(getattr(lib, name), ctypes.c_void_p).value
                 for name in ("cuLaunchKernel", "cuCtxGetCurrent", "cuTensorMapEncodeTiled"))


def launcher(entry_points: tuple[int, int, int] | None = None, stream=None, empty=None):
    """A new Launcher on the driver's entry points and torch's stream query and allocator (the
    tests give stand-ins for all three)."""
    from .launch import current_stream_handle

    return _native_launch.Launcher(*(entry_points or _driver_entry_points()),
                                   stream or current_stream_handle, empty or torch.empty,
                                   TENSOR_TYPES, CAPACITY)


def _enum(value) -> int:
    return int(getattr(value, "value", value))


def map_slot(position: int, tensor_index: int, spec) -> tuple:
    """A map parameter as the Plan takes it: cuTensorMapEncodeTiled's arguments but the address."""
    from .tma import driver_arguments

    a = driver_arguments(spec)
    return (position, tensor_index, _enum(a["tensorDataType"]), tuple(a["globalDim"]),
            tuple(a["globalStrides"]), tuple(a["boxDim"]), tuple(a["elementStrides"]),
            _enum(a["interleave"]), _enum(a["swizzle"]), _enum(a["l2Promotion"]), _enum(a["oobFill"]))


def plan(launch_plan, packed, tensors: tuple, n_alloc: int, function: int, context: int,
         threads: int, smem: int):
    """The Plan of one call the Python path has checked and launched: `tensors` are
    (*given, *allocated) — the call's tensors (inputs, then the out= tensors if any) and the
    outputs it allocated — and `packed` its packed arguments. A spans table (a document mask's)
    becomes a scratch tensor the plan allocates per call and a launch of its helper before the
    kernel's (`spans_launches`)."""
    from .tma import spec_for_tensor

    given = tensors[:len(tensors) - n_alloc]
    alloc = launch_plan.outputs[len(launch_plan.outputs) - n_alloc:]
    maps = []
    for position, source, p, _ in launch_plan.map_slots:
        t = tensors[source]
        shape = launch_plan.views[p.name]
        view = t.view(shape) if tuple(t.shape) != shape else t
        maps.append(map_slot(position, source,   # the call has checked the tensor (device too)
                              spec_for_tensor(view, p.box, p.swizzle, p.name, require_cuda=False)))
    scratch, pre, table_slots = spans_launches(launch_plan, len(tensors))
    return _native_launch.Plan(
        tuple(tuple(t.shape) for t in given), tuple(t.stride() for t in given),
        tuple(t.dtype for t in given), tuple(t.device for t in given),
        # torch.empty(*shape, ...): sizes as separate ints parse faster than one tuple
        tuple(tuple(shape) if shape else (shape,) for _, shape, _ in alloc),
        tuple({"dtype": dtype, "device": launch_plan.device} for _, _, dtype in alloc),
        len(launch_plan.outputs), function, context, launch_plan.grid, threads, smem,
        launch_plan.device_index, tuple(packed.raw()), launch_plan.pointer_slots + table_slots, tuple(maps),
        tuple((tuple(shape), {"dtype": torch.int32, "device": launch_plan.device}) for shape in scratch), pre)


def spans_launches(launch_plan, first_scratch: int) -> tuple[list, tuple, tuple]:
    """(the shapes of the spans tables, the helper's launches that fill them, the kernel's pointer
    slots of the tables) for a plan whose tensors (*given, *allocated) number `first_scratch`:
    table i is tensor first_scratch + i. The helper must have run on the device (the Python
    path's calls of the layout launched it)."""
    from . import block_spans

    if not launch_plan.span_slots:
        return [], (), ()
    function = block_spans._loaded()._functions.get(launch_plan.device_index)
    if function is None:
        raise RuntimeError("the spans helper is not loaded on the device")
    shapes, pre, slots = [], [], []
    for i, (position, query, key, _) in enumerate(launch_plan.span_slots):
        launch = launch_plan.span_launches[position]
        assert launch.ctas, "CompiledKernel._install plans no spans table of no rows or keys"
        table = first_scratch + i
        shapes.append(launch.shape)
        pre.append((int(function), launch.ctas, block_spans.THREADS, 0, tuple(launch.raw()),
                    ((0, query), (1, key), (2, table))))
        slots.append((position, table))
    return shapes, tuple(pre), tuple(slots)


def call(kernel, tensors: tuple, out):
    """The call launched from C by `kernel`'s launcher of `out`'s names (a CompiledKernel's or a
    ShapeDispatchKernel's `_natives`; None: no out=), or None where the path is off for the
    kernel or its launcher holds no plan for the call's layout: the Python path runs it then."""
    if not kernel._native:
        return None
    launchers = kernel._natives
    if out is None:
        launcher = launchers.get(None)
        return None if launcher is None else launcher(tensors)
    if type(out) is dict:
        launcher = launchers.get(tuple(out))
        return None if launcher is None else launcher((*tensors, *out.values()))
    return None
