"""The ptxas report (``-Xptxas -v``): registers, shared memory, spills and warnings per kernel.

    resources = parse_ptxas_log(log)          # {"matmul": KernelResources(registers=168, ...)}
    check_ptxas_log(log, cu_path=..., command=...)         # BuildError on C7508
    check_resources(resources, cu_path=..., command=...)   # BuildError on a spill or stack frame

Two kinds of "warnings" fail a build although ptxas produced a cubin: C7508 (setmaxnreg
ignored: the register budget of every role is silently lost) and any register spill or stack
frame (the generated kernels are sized never to spill). ptxas serializing wgmma (C7511 and kin)
is a large silent slowdown too; it fails only on request. Kernels are `extern "C"`, so ptxas
names them by their plain names.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from .nvcc import BuildError, repro_lines

__all__ = [
    "ERROR_WARNING_CODES",
    "KernelResources",
    "ResourceTable",
    "check_ptxas_log",
    "check_resources",
    "parse_ptxas_log",
    "ptxas_warnings",
    "wgmma_serialization",
]

# ptxas diagnostics that fail the build even though ptxas produced a cubin.
ERROR_WARNING_CODES: tuple[str, ...] = ("C7508",)  # setmaxnreg ignored


@dataclass(frozen=True)
class KernelResources:
    registers: int
    smem_bytes: int  # static shared memory (dynamic smem is a launch parameter)
    spill_stores: int
    spill_loads: int
    stack_bytes: int
    barriers: int = 0  # named barriers the kernel uses (bar.sync ids)

    @property
    def spills(self) -> bool:
        return self.spill_stores > 0 or self.spill_loads > 0 or self.stack_bytes > 0


class ResourceTable(dict):
    """Kernel name -> KernelResources, in the order ptxas compiled them; a missing name says
    which kernels there are."""

    def __missing__(self, name: str) -> KernelResources:
        raise KeyError(f"no kernel named {name!r}; kernels: {sorted(self)}")


_RE_ENTRY = re.compile(r"Compiling entry function '([^']+)' for '([^']+)'")
_RE_PROPS = re.compile(r"Function properties for (\S+)")
_RE_FRAME = re.compile(
    r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_RE_USED = re.compile(r"Used (\d+) registers")
_RE_BARRIERS = re.compile(r"used (\d+) barriers")
_RE_SMEM = re.compile(r"(\d+) bytes smem")
_RE_DIAG_CODE = re.compile(r"\(C\d{4}\)")
_RE_WGMMA_SERIAL = re.compile(r"wgmma\S* instructions are serialized")


def parse_ptxas_log(log: str) -> ResourceTable:
    """Per-entry resources (keyed by kernel name) from ``-Xptxas -v`` output."""
    frames: dict[str, tuple[int, int, int]] = {}
    used: dict[str, tuple[int, int, int]] = {}
    entries: list[str] = []
    current_entry: str | None = None
    props_for: str | None = None
    for line in log.splitlines():
        m = _RE_ENTRY.search(line)
        if m:
            current_entry = m.group(1)
            if current_entry not in entries:
                entries.append(current_entry)
            continue
        m = _RE_PROPS.search(line)
        if m:
            props_for = m.group(1)
            continue
        m = _RE_FRAME.search(line)
        if m and props_for is not None:
            frames[props_for] = (int(m.group(1)), int(m.group(2)), int(m.group(3)))
            props_for = None
            continue
        m = _RE_USED.search(line)
        if m and current_entry is not None:
            b = _RE_BARRIERS.search(line)
            s = _RE_SMEM.search(line)
            used[current_entry] = (int(m.group(1)), int(s.group(1)) if s else 0,
                                   int(b.group(1)) if b else 0)
    out = ResourceTable()
    for e in entries:
        stack, st, ld = frames.get(e, (0, 0, 0))
        regs, smem, bars = used.get(e, (0, 0, 0))
        out[e] = KernelResources(registers=regs, smem_bytes=smem, spill_stores=st,
                                 spill_loads=ld, stack_bytes=stack, barriers=bars)
    return out


def ptxas_warnings(log: str) -> list[str]:
    """Warning lines of an nvcc/ptxas log, and any ptxas '(Cxxxx)' diagnostic (some, like
    C7515 'wgmma serialized', come as 'ptxas info' lines)."""
    out = []
    for line in log.splitlines():
        if "warning" in line.lower() or _RE_DIAG_CODE.search(line):
            out.append(line.strip())
    return out


def wgmma_serialization(log: str) -> list[str]:
    """ptxas lines saying wgmma was serialized (e.g. C7511) -- a silent large slowdown."""
    return [ln.strip() for ln in log.splitlines() if _RE_WGMMA_SERIAL.search(ln)]


def check_ptxas_log(log: str, *, cu_path: Path | None = None, command: tuple[str, ...] = (),
                    name: str = "", error_codes: tuple[str, ...] = ERROR_WARNING_CODES,
                    allow_wgmma_serialization: bool = True) -> None:
    """Raise BuildError if the log has a diagnostic we treat as an error: any line with one of
    `error_codes` (default C7508, setmaxnreg ignored), and, unless
    `allow_wgmma_serialization`, ptxas saying wgmma.mma_async was serialized."""
    bad = [ln.strip() for ln in log.splitlines() if any(c in ln for c in error_codes)]
    if not allow_wgmma_serialization:
        bad += [ln for ln in wgmma_serialization(log) if ln not in bad]
    if not bad:
        return
    lines = [f"ptxas reported an error-level warning{f' for {name!r}' if name else ''}:"]
    lines += [f"  {b}" for b in bad]
    if any("C7508" in b for b in bad):
        lines.append("  (C7508: setmaxnreg was ignored; it needs __launch_bounds__(threads, 1) and each "
                     "warpgroup role in one branch of a single if/else)")
    lines += repro_lines(cu_path, command)
    raise BuildError("\n".join(lines), cu_path=cu_path, command=command, log=log)


def check_resources(resources: Mapping[str, KernelResources], *, cu_path: Path | None = None,
                    command: tuple[str, ...] = (), name: str = "", log: str = "") -> None:
    """Raise BuildError if any kernel spills (spill stores/loads or a stack frame > 0)."""
    bad = [(kernel, r) for kernel, r in resources.items() if r.spills]
    if not bad:
        return
    lines = [f"register spills{f' in {name!r}' if name else ''} "
             "(spills are an error; allow_spills=True to accept them):"]
    for kernel, r in bad:
        lines.append(f"  kernel {kernel!r}: {r.registers} registers, "
                     f"{r.spill_stores} bytes spill stores, {r.spill_loads} bytes spill loads, "
                     f"{r.stack_bytes} bytes stack frame")
    lines += repro_lines(cu_path, command)
    raise BuildError("\n".join(lines), cu_path=cu_path, command=command, log=log, kernel=bad[0][0], spills=True)
