"""Checked CUDA driver calls in torch's context: what the launcher and the tensor maps share.

Every driver call goes through `check_cuda`, so a failure names the call and the driver's
error, never a bare integer. `torch_context(device)` makes the driver calls that follow (module
loads, tensor-map encodes, launches) land in the very context torch uses on that device — the
primary context of the device the tensors live on, whatever the thread's current device is.

The driver is only touched when one of these is called, so importing this module (and the
modules built on it) works on a machine without a GPU.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Iterator

import torch
from cuda.bindings import driver

__all__ = ["CudaError", "check_cuda", "device_index", "init_driver", "is_current", "torch_context"]


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


def device_index(device: object = None) -> int:
    """CUDA device index of None (torch's current device), an int, a str or a torch.device."""
    if device is None:
        return torch.cuda.current_device()
    if isinstance(device, int):
        return device
    dev = torch.device(device)
    if dev.type != "cuda":
        raise ValueError(f"expected a CUDA device, got {dev}")
    return torch.cuda.current_device() if dev.index is None else dev.index


_primary_contexts: dict[int, driver.CUcontext] = {}  # device index -> torch's (primary) context
_primary_handles: dict[int, int] = {}                # the same contexts as ints (for is_current)
_init_lock = threading.Lock()


def init_driver(device: object = None) -> int:
    """Create torch's context on `device` (touching a CUDA tensor) and cuInit; return the index.

    torch creates its primary context lazily, and the driver calls that follow (module loads,
    tensor-map encodes, launches) must land in the very context torch launches into.
    """
    index = device_index(device)
    if index not in _primary_contexts:
        with _init_lock:
            if index not in _primary_contexts:
                with torch.cuda.device(index):
                    torch.empty(1, device=f"cuda:{index}")
                check_cuda(driver.cuInit(0), "cuInit(0)")
                handle = check_cuda(driver.cuDeviceGet(index), f"cuDeviceGet({index})")
                # retained once and never released: torch holds the same context for the
                # life of the process
                primary = check_cuda(driver.cuDevicePrimaryCtxRetain(handle),
                                     f"cuDevicePrimaryCtxRetain(cuda:{index})")
                _primary_handles[index] = int(primary)
                _primary_contexts[index] = primary
    return index


def _current_context() -> int:
    """The thread's current context as an int (0: none)."""
    context = check_cuda(driver.cuCtxGetCurrent(), "cuCtxGetCurrent")
    return 0 if context is None else int(context)


def is_current(index: int) -> bool:
    """Whether torch's primary context of device `index` is the thread's current context: the
    launch's quick test (one driver call) before it falls back to `torch_context`. False before
    `init_driver(index)` and on any driver error (the fallback reports it)."""
    primary = _primary_handles.get(index)
    if primary is None:
        return False
    error, context = driver.cuCtxGetCurrent()
    return not error and context is not None and int(context) == primary


@contextlib.contextmanager
def torch_context(device: object = None) -> Iterator[int]:
    """Run driver calls in torch's primary context of `device`; yields the device index.

    A CUmodule, the CUfunctions in it and a launch belong to one context, so everything a
    kernel does on a device happens in that device's primary context — the one torch allocates
    the device's tensors in and runs its streams on. The thread's current device (and context)
    is what it was before once the block is left.
    """
    index = init_driver(device)
    primary = _primary_contexts[index]
    if torch.cuda.current_device() == index and _current_context() == int(primary):
        yield index  # the common case: already there
        return
    with torch.cuda.device(index):
        # torch.cuda.device normally binds the primary context too; a thread that never made
        # a runtime call on this device may still have none (or another) current.
        previous = _current_context()
        if previous != int(primary):
            check_cuda(driver.cuCtxSetCurrent(primary), f"cuCtxSetCurrent(cuda:{index} primary)")
        try:
            yield index
        finally:
            if previous not in (0, int(primary)):
                check_cuda(driver.cuCtxSetCurrent(driver.CUcontext(previous)),
                           "cuCtxSetCurrent(previous context)")
