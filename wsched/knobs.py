"""Every environment knob of wsched, read in one place (typed, with its default)."""

from __future__ import annotations

import os
from pathlib import Path


def _flag(name: str, default: bool = False) -> bool:
    value = os.environ.get(name)
    if value is None:
        return default
    return value.strip().lower() not in ("", "0", "false", "no", "off")


def debug() -> bool:
    """WSCHED_DEBUG=1: run the verifier after every lowering pass (the final IR is always verified)."""
    return _flag("WSCHED_DEBUG")


def check_values() -> bool:
    """WSCHED_CHECK_INPUTS=1: every GPU call checks the values of the small inputs a kernel
    indexes with (a paged cache's block table, per-sequence key lengths) on the host first: a copy
    to the host and a wait per call, for debugging (the simulator always checks them). Read when a
    kernel is compiled."""
    return _flag("WSCHED_CHECK_INPUTS")


def native_launch() -> bool:
    """WSCHED_NATIVE_LAUNCH=0: every GPU call takes the Python launch path, not the native one
    (codegen/native.py); default on where the extension is built. Read when a kernel is compiled."""
    return _flag("WSCHED_NATIVE_LAUNCH", default=True)


def print_ir_after() -> frozenset[str]:
    """WSCHED_PRINT_IR=pass1,pass2 | all: print the IR after those passes to stderr."""
    return frozenset(p.strip() for p in os.environ.get("WSCHED_PRINT_IR", "").split(",") if p.strip())


def nvcc() -> str | None:
    """WSCHED_NVCC: the nvcc to build with (default: nvcc on PATH, then /usr/local/cuda/bin)."""
    return os.environ.get("WSCHED_NVCC") or None


def cache_dir() -> Path:
    """WSCHED_CACHE_DIR: where compiled kernels are cached (default ~/.cache/wsched). Set but
    empty counts as unset: an empty path would put the cache in the current directory."""
    value = os.environ.get("WSCHED_CACHE_DIR", "").strip()
    if not value:
        return Path.home() / ".cache" / "wsched"
    return Path(value).expanduser()
