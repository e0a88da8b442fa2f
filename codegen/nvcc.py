"""The nvcc driver: which nvcc, its flags, running it, and the repro command of a failure.

Flags (NVCC_FLAGS): ``-gencode=arch=compute_90a,code=sm_90a -cubin -O3 -std=c++17 -lineinfo
-Xptxas -v``, plus ``-I<codegen/include>`` added to every command (not part of the cache key;
the headers' *contents* are).  No ``--use_fast_math``: it silently changes division, sqrt and
denormal handling in every epilogue; the fast paths we want are spelled out explicitly in the
headers (``wsp::ex2_approx``).  ``-lineinfo`` does not change the generated code, it only lets
the profiler map SASS to the .cu lines.

Every toolchain failure is a ``BuildError`` whose message carries the .cu path and a
copy-pasteable repro command (``repro_lines``); an nvcc failure adds the tail of nvcc's output.

The toolchain fingerprint is the resolved path, size and mtime of ``nvcc`` (and of the target of
a small ``#!`` wrapper script's ``exec``, as /usr/local/bin/nvcc is on CI), not ``nvcc
--version``: a warm cache hit then runs no subprocess at all.  ``nvcc_version()`` runs once per
process, on a miss.  Re-installing a different nvcc at the same path with the same size and
mtime would alias; ``extra_key`` or a new cache dir is the escape hatch.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from functools import lru_cache
from pathlib import Path

from wsched import knobs
from wsched.target import ARCH

__all__ = [
    "BuildError",
    "INCLUDE_DIR",
    "NVCC_FLAGS",
    "PTX_FLAGS",
    "command",
    "failure",
    "nvcc_path",
    "nvcc_version",
    "output_name",
    "repro_lines",
    "run",
    "sass",
    "toolchain_fingerprint",
]

INCLUDE_DIR = Path(__file__).resolve().parent / "include"

NVCC_FLAGS: tuple[str, ...] = (
    f"-gencode=arch=compute_{ARCH[3:]},code={ARCH}",
    "-cubin",
    "-O3",
    "-std=c++17",
    "-lineinfo",
    "-Xptxas",
    "-v",
)
# Same front end, stops at PTX (for inspecting what the emitter + headers produced).
PTX_FLAGS: tuple[str, ...] = tuple(f for f in NVCC_FLAGS if f not in ("-cubin",)) + ("-ptx",)

_NVCC_TIMEOUT_S = 900
_LOG_TAIL_LINES = 40


class BuildError(RuntimeError):
    """nvcc/ptxas failed, or produced something we treat as an error (C7508, spills)."""

    def __init__(self, message: str, *, cu_path: Path | None = None,
                 command: tuple[str, ...] = (), log: str = "", kernel: str | None = None,
                 spills: bool = False):
        super().__init__(message)
        self.cu_path = cu_path
        self.command = tuple(command)
        self.log = log
        self.kernel = kernel
        self.spills = spills   # the build succeeded but ptxas spilled registers (check_resources)


@lru_cache(maxsize=None)
def nvcc_path() -> str:
    """``$WSCHED_NVCC``, else ``nvcc`` on PATH, else /usr/local/cuda/bin/nvcc (cached)."""
    env = knobs.nvcc()
    if env:
        return env
    found = shutil.which("nvcc")
    if found:
        return found
    fallback = "/usr/local/cuda/bin/nvcc"
    if os.path.exists(fallback):
        return fallback
    raise BuildError("nvcc not found: put it on PATH or set WSCHED_NVCC")


def nvcc_available() -> bool:
    """Whether `nvcc_path` finds an nvcc (the rule `ws.compile(build=None)` builds by)."""
    try:
        nvcc_path()
    except BuildError:
        return False
    return True


@lru_cache(maxsize=None)
def nvcc_version() -> str:
    """E.g. ``'13.0.88 (cuda_13.0.r13.0/compiler.36424714_0)'``; runs ``nvcc --version`` once."""
    out = subprocess.run([nvcc_path(), "--version"], capture_output=True, text=True, check=False)
    text = out.stdout + out.stderr
    m = re.search(r"release [\d.]+, V([\d.]+)", text)
    b = re.search(r"Build (\S+)", text)
    if not m:
        return text.strip().splitlines()[-1] if text.strip() else "unknown"
    return m.group(1) + (f" ({b.group(1)})" if b else "")


def _stat_id(path: str) -> str:
    real = os.path.realpath(path)
    st = os.stat(real)
    return f"{real}:{st.st_size}:{st.st_mtime_ns}"


@lru_cache(maxsize=None)
def toolchain_fingerprint() -> str:
    """Identity of the nvcc in use without running it (see module docstring)."""
    path = nvcc_path()
    parts = [_stat_id(path)]
    real = os.path.realpath(path)
    try:
        if os.path.getsize(real) < 4096:
            with open(real, "rb") as f:
                head = f.read()
            if head.startswith(b"#!"):
                # A wrapper script (e.g. `exec /usr/local/cuda-13.0/bin/nvcc "$@"`).
                for target in re.findall(rb"exec\s+(/\S+)", head):
                    t = target.decode(errors="replace").strip("'\"")
                    if os.path.exists(t):
                        parts.append(_stat_id(t))
    except OSError:
        pass
    return "|".join(parts)


def output_name(flags: tuple[str, ...]) -> str:
    """The file name of what `flags` make nvcc produce."""
    if "-ptx" in flags or "--ptx" in flags:
        return "kernel.ptx"
    if "-fatbin" in flags or "--fatbin" in flags:
        return "kernel.fatbin"
    return "kernel.cubin"


def command(flags: tuple[str, ...], cu_path: Path, out_path: Path) -> tuple[str, ...]:
    """The nvcc argv compiling `cu_path` into `out_path` (headers from INCLUDE_DIR)."""
    return (nvcc_path(), *flags, f"-I{INCLUDE_DIR}", str(cu_path), "-o", str(out_path))


def run(argv: tuple[str, ...], cwd: Path) -> tuple[str, int | None]:
    """Run nvcc: (its output, stdout and stderr together; exit status, None if it timed out)."""
    try:
        proc = subprocess.run(argv, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, timeout=_NVCC_TIMEOUT_S, check=False)
        return proc.stdout, proc.returncode
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        return out + f"\n[wsched] nvcc timed out after {_NVCC_TIMEOUT_S} s\n", None


def repro_lines(cu_path: Path | None, command: tuple[str, ...]) -> list[str]:
    """The lines every toolchain error ends with: the source and the command that rebuilds it."""
    out = []
    if cu_path is not None:
        out.append(f"  source: {cu_path}")
    if command:
        out.append(f"  repro:  {shlex.join(command)}")
    return out


def failure(name: str, cu_path: Path, command: tuple[str, ...], log: str, rc: int | None) -> BuildError:
    """The BuildError of a failed nvcc run: source, repro command and the tail of its output."""
    tail = log.rstrip().splitlines()[-_LOG_TAIL_LINES:]
    status = "timed out" if rc is None else f"exit status {rc}"
    message = "\n".join([
        f"nvcc failed ({status}) compiling {name!r}",
        *repro_lines(cu_path, command),
        f"  --- nvcc output (last {len(tail)} lines) ---",
        *(f"  {ln}" for ln in tail),
    ])
    return BuildError(message, cu_path=cu_path, command=command, log=log)


def sass(cubin_path: Path | str) -> str:
    """SASS of a cubin via cuobjdump (or nvdisasm); raises BuildError when neither exists."""
    bindir = os.path.dirname(os.path.realpath(nvcc_path()))
    for tool, args in (("cuobjdump", ["-sass"]), ("nvdisasm", [])):
        exe = shutil.which(tool) or (os.path.join(bindir, tool) if os.path.exists(os.path.join(bindir, tool)) else None)
        if exe:
            out = subprocess.run([exe, *args, str(cubin_path)], capture_output=True, text=True, check=False)
            if out.returncode == 0:
                return out.stdout
            raise BuildError(f"{tool} failed on {cubin_path}:\n{out.stderr[-4000:]}")
    raise BuildError("neither cuobjdump nor nvdisasm found next to nvcc or on PATH")
