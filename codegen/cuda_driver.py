"""Checked CUDA driver calls in torch's context: what the launcher and the tensor maps share.

Every driver call goes through `check_cuda`, so a failure names the call and the driver's
error, never a bare integer. `torch_context` makes the driver calls that follow (module loads,
tensor-map encodes) land in the very context torch launches into.

The driver is only touched when one of these is called, so importing this module (and the
modules built on it) works on a machine without a GPU.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from cuda.bindings import driver

__all__ = ["CudaError", "check_cuda", "device_index", "init_driver", "torch_context"]


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


_initialized_devices: set[int] = set()


def init_driver(device: object = None) -> int:
    """Create torch's context on `device` (touching a CUDA tensor) and cuInit; return the index.

    torch creates its primary context lazily, and the driver calls that follow (module loads,
    tensor-map encodes) must land in the very context torch launches into.
    """
    index = device_index(device)
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
