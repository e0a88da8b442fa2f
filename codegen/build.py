"""nvcc driver with a content-addressed on-disk cache.

    result = compile_cuda(source, name="matmul", artifacts={"loop_ir.txt": ir_text})
    result.cubin_path            # load with cuModuleLoadData / cuLibraryLoadFromFile
    result.resources["kernel"]   # KernelResources by mangled, qualified or short name
    result.artifact_text("loop_ir.txt")

Flags (NVCC_FLAGS): ``-gencode=arch=compute_90a,code=sm_90a -cubin -O3 -std=c++17 -lineinfo
-Xptxas -v``, plus ``-I<codegen/include>`` added to every command (not part of the cache key;
the headers' *contents* are).  No ``--use_fast_math``: it silently changes division, sqrt and
denormal handling in every epilogue; the fast paths we want are spelled out explicitly in the
headers (``wsp::ex2_approx``).  ``-lineinfo`` does not change the generated code, it only lets
the profiler map SASS to the .cu lines.

Errors are ``BuildError``: an nvcc failure (message has the .cu path, a copy-pasteable repro
command and the tail of nvcc's output), ptxas warning C7508 ("setmaxnreg ignored"), and — through
``check_resources``, which ``compile_cuda`` calls unless ``allow_spills=True`` — any register
spill or stack frame.

Cache
-----
key = sha256("wsched-build-v1", source, flags, toolchain fingerprint, header contents,
extra_key).  The toolchain fingerprint is the resolved path, size and mtime of ``nvcc`` (and of
the target of a small ``#!`` wrapper script's ``exec``, as /usr/local/bin/nvcc is on CI), not
``nvcc --version``: a warm hit then runs no subprocess at all.  ``nvcc_version()`` is computed
only on a miss (cached per process) and recorded in meta.json.  Re-installing a different nvcc
at the same path with the same size and mtime would alias; ``extra_key`` or a new cache dir is
the escape hatch.

Layout: ``<cache_dir>/<key>/`` holding kernel.cu (the source after a first line
``#line 1 "<that file's own path>"``, so -lineinfo names a file that exists and the cubin does
not depend on the temporary build dir), kernel.cubin (or kernel.ptx for ``-ptx``),
ptxas.log, meta.json (with the sha256 of the output) and ``artifacts/<name>``.  Default cache
dir: ``$WSCHED_CACHE_DIR`` or ``~/.cache/wsched``.  An entry is built in
``<cache_dir>/.tmp-*`` and published with one ``os.rename``; if the target already exists the
other process won and its entry is used.  A corrupt entry (missing/short output, checksum
mismatch, unreadable meta.json) is moved aside and rebuilt.  Failed builds are kept under
``<cache_dir>/failed/<key>/`` so the paths in the error message stay valid.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from wsched import knobs

__all__ = [
    "BuildError",
    "BuildResult",
    "KernelResources",
    "ResourceTable",
    "NVCC_FLAGS",
    "PTX_FLAGS",
    "INCLUDE_DIR",
    "ERROR_WARNING_CODES",
    "nvcc_path",
    "nvcc_version",
    "toolchain_fingerprint",
    "default_cache_dir",
    "cache_key",
    "compile_cuda",
    "compile_ptx",
    "parse_ptxas_log",
    "ptxas_warnings",
    "check_ptxas_log",
    "check_resources",
    "wgmma_serialization",
    "short_kernel_name",
    "sass",
]

INCLUDE_DIR = Path(__file__).resolve().parent / "include"

NVCC_FLAGS: tuple[str, ...] = (
    "-gencode=arch=compute_90a,code=sm_90a",
    "-cubin",
    "-O3",
    "-std=c++17",
    "-lineinfo",
    "-Xptxas",
    "-v",
)
# Same front end, stops at PTX (for inspecting what the emitter + headers produced).
PTX_FLAGS: tuple[str, ...] = tuple(f for f in NVCC_FLAGS if f not in ("-cubin",)) + ("-ptx",)

# ptxas diagnostics that fail the build even though ptxas produced a cubin.
ERROR_WARNING_CODES: tuple[str, ...] = ("C7508",)  # setmaxnreg ignored

_CACHE_FORMAT = 1
_META = "meta.json"
_SOURCE = "kernel.cu"
_LOG = "ptxas.log"
_ARTIFACTS = "artifacts"
_ARTIFACT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_NVCC_TIMEOUT_S = 900
_LOG_TAIL_LINES = 40


class BuildError(RuntimeError):
    """nvcc/ptxas failed, or produced something we treat as an error (C7508, spills)."""

    def __init__(self, message: str, *, cu_path: Path | None = None,
                 command: tuple[str, ...] = (), log: str = "", kernel: str | None = None):
        super().__init__(message)
        self.cu_path = cu_path
        self.command = tuple(command)
        self.log = log
        self.kernel = kernel


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


class ResourceTable(Mapping):
    """Kernel name -> KernelResources.

    Iterates over mangled names (what ptxas prints, what cuModuleGetFunction wants); lookups
    also accept the qualified (``ns::kernel``) and short (``kernel``) names when unambiguous,
    and the full demangled signature when a demangler was available at build time.
    """

    def __init__(self, by_mangled: Mapping[str, KernelResources],
                 demangled: Mapping[str, str] | None = None):
        self._by_mangled = dict(by_mangled)
        self._demangled = dict(demangled or {})
        aliases: dict[str, str | None] = {}

        def add(alias: str, mangled: str) -> None:
            if not alias or alias in self._by_mangled:
                return
            if alias in aliases and aliases[alias] != mangled:
                aliases[alias] = None  # ambiguous
            else:
                aliases[alias] = mangled

        for mangled in self._by_mangled:
            qual = _qualified_name(mangled)
            if qual:
                add(qual, mangled)
                add(qual.rsplit("::", 1)[-1], mangled)
            full = self._demangled.get(mangled)
            if full:
                add(full, mangled)
        self._aliases = aliases

    def mangled_name(self, name: str) -> str:
        if name in self._by_mangled:
            return name
        if name in self._aliases:
            target = self._aliases[name]
            if target is None:
                matches = sorted(m for m in self._by_mangled if name in self._names_of(m))
                raise KeyError(f"kernel name {name!r} is ambiguous; use one of the mangled names {matches}")
            return target
        raise KeyError(f"no kernel named {name!r}; kernels: {sorted(self._by_mangled)}")

    def _names_of(self, mangled: str) -> set[str]:
        qual = _qualified_name(mangled) or ""
        return {mangled, qual, qual.rsplit("::", 1)[-1], self._demangled.get(mangled, "")}

    def demangled(self, mangled: str) -> str:
        return self._demangled.get(mangled) or _qualified_name(mangled) or mangled

    def __getitem__(self, name: str) -> KernelResources:
        return self._by_mangled[self.mangled_name(name)]

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and (
            name in self._by_mangled or self._aliases.get(name) is not None)

    def __iter__(self) -> Iterator[str]:
        return iter(self._by_mangled)

    def __len__(self) -> int:
        return len(self._by_mangled)

    def __repr__(self) -> str:
        return f"ResourceTable({self._by_mangled!r})"


@dataclass(frozen=True)
class BuildResult:
    cubin_path: Path  # the output file (kernel.cubin; kernel.ptx when built with -ptx)
    cu_path: Path
    resources: ResourceTable  # Mapping[str, KernelResources]
    log: str  # nvcc + ptxas output
    command: tuple[str, ...]  # argv that reproduces the build (paths inside the cache entry)
    cache_hit: bool
    key: str = ""
    entry_dir: Path | None = None
    artifacts: Mapping[str, Path] = field(default_factory=dict)
    warnings: tuple[str, ...] = ()  # ptxas/nvcc warning lines
    nvcc_version: str = ""
    name: str = ""

    @property
    def repro(self) -> str:
        """The build command as one copy-pasteable shell line."""
        return shlex.join(self.command)

    def artifact_text(self, name: str) -> str:
        try:
            path = self.artifacts[name]
        except KeyError:
            raise KeyError(f"no artifact {name!r} in cache entry {self.entry_dir}; "
                           f"have {sorted(self.artifacts)}") from None
        return path.read_text()


# --------------------------------------------------------------------------------------------
# toolchain


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


def _headers_digest() -> str:
    h = hashlib.sha256()
    for p in sorted(INCLUDE_DIR.glob("*.cuh")):
        h.update(p.name.encode() + b"\0")
        h.update(p.read_bytes() + b"\0")
    return h.hexdigest()


def default_cache_dir() -> Path:
    return knobs.cache_dir()


def cache_key(source: str, flags: tuple[str, ...] = NVCC_FLAGS, extra_key: str = "") -> str:
    h = hashlib.sha256()
    for part in ("wsched-build-v1", source, "\x1f".join(flags), toolchain_fingerprint(),
                 _headers_digest(), extra_key):
        data = part.encode()
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()


# --------------------------------------------------------------------------------------------
# ptxas log


_RE_ENTRY = re.compile(r"Compiling entry function '([^']+)' for '([^']+)'")
_RE_PROPS = re.compile(r"Function properties for (\S+)")
_RE_FRAME = re.compile(
    r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_RE_USED = re.compile(r"Used (\d+) registers")
_RE_BARRIERS = re.compile(r"used (\d+) barriers")
_RE_SMEM = re.compile(r"(\d+) bytes smem")
_RE_DIAG_CODE = re.compile(r"\(C\d{4}\)")
_RE_WGMMA_SERIAL = re.compile(r"wgmma\S* instructions are serialized")


def parse_ptxas_log(log: str) -> dict[str, KernelResources]:
    """Per-entry resources (keyed by mangled name) from ``-Xptxas -v`` output."""
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
    out = {}
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
    lines += _where(cu_path, command)
    raise BuildError("\n".join(lines), cu_path=cu_path, command=command, log=log)


def check_resources(result: BuildResult, allow_spills: bool = False) -> BuildResult:
    """Raise BuildError if any kernel spills (spill stores/loads or a stack frame > 0)."""
    if allow_spills:
        return result
    bad = []
    for mangled, r in result.resources.items():
        if r.spills:
            bad.append((mangled, r))
    if not bad:
        return result
    lines = [f"register spills{f' in {result.name!r}' if result.name else ''} "
             "(spills are an error; allow_spills=True to accept them):"]
    for mangled, r in bad:
        shown = result.resources.demangled(mangled) if isinstance(result.resources, ResourceTable) else mangled
        lines.append(f"  kernel {shown!r} ({mangled}): {r.registers} registers, "
                     f"{r.spill_stores} bytes spill stores, {r.spill_loads} bytes spill loads, "
                     f"{r.stack_bytes} bytes stack frame")
    lines += _where(result.cu_path, result.command)
    raise BuildError("\n".join(lines), cu_path=result.cu_path, command=result.command,
                     log=result.log, kernel=bad[0][0])


def _where(cu_path: Path | None, command: tuple[str, ...]) -> list[str]:
    out = []
    if cu_path is not None:
        out.append(f"  source: {cu_path}")
    if command:
        out.append(f"  repro:  {shlex.join(command)}")
    return out


# --------------------------------------------------------------------------------------------
# names


def _parse_source_name(s: str, i: int) -> tuple[str, int]:
    j = i
    while j < len(s) and s[j].isdigit():
        j += 1
    if j == i:
        raise ValueError
    n = int(s[i:j])
    return s[j:j + n], j + n


def _skip_template_args(s: str, i: int) -> int:
    """s[i] == 'I': index just past the matching 'E' (names only need to be skipped)."""
    depth = 0
    while i < len(s):
        c = s[i]
        if c in "IN":
            depth += 1
            i += 1
        elif c == "L":  # literal L<type><value>E (or L_Z<encoding>E): skip to its E
            i = s.index("E", i) + 1
        elif c == "E":
            depth -= 1
            i += 1
            if depth == 0:
                return i
        elif c.isdigit():
            _, i = _parse_source_name(s, i)
        else:
            i += 1
    raise ValueError


def _qualified_name(mangled: str) -> str | None:
    """``_ZN3foo6kernelEPf`` -> ``foo::kernel``; ``_Z1tILi3EEvPf`` -> ``t``; C names as is."""
    if not mangled.startswith("_Z"):
        return mangled
    s, i = mangled, 2
    try:
        if s[i] == "L":
            i += 1
        if s[i] == "N":
            i += 1
            parts = []
            while s[i] != "E":
                if s[i] in "KVr":  # cv-qualifiers of member functions
                    i += 1
                    continue
                if s[i] == "I":
                    i = _skip_template_args(s, i)
                    continue
                if s[i:i + 2] == "St":
                    parts.append("std")
                    i += 2
                    continue
                name, i = _parse_source_name(s, i)
                parts.append(name)
            return "::".join(parts) if parts else None
        name, _ = _parse_source_name(s, i)
        return name
    except (ValueError, IndexError):
        return None


def short_kernel_name(mangled: str) -> str:
    q = _qualified_name(mangled)
    return q.rsplit("::", 1)[-1] if q else mangled


def _demangle_all(names: list[str]) -> dict[str, str]:
    """Full demangled signatures via cu++filt / c++filt when available (miss path only)."""
    mangled = [n for n in names if n.startswith("_Z")]
    if not mangled:
        return {}
    tool = None
    cand = os.path.join(os.path.dirname(os.path.realpath(nvcc_path())), "cu++filt")
    for t in (cand, shutil.which("cu++filt"), shutil.which("c++filt")):
        if t and os.path.exists(t):
            tool = t
            break
    if tool is None:
        return {}
    try:
        out = subprocess.run([tool], input="\n".join(mangled) + "\n", capture_output=True,
                             text=True, timeout=30, check=False)
    except (OSError, subprocess.SubprocessError):
        return {}
    lines = out.stdout.splitlines()
    if out.returncode != 0 or len(lines) != len(mangled):
        return {}
    return {m: d for m, d in zip(mangled, lines) if d != m}


# --------------------------------------------------------------------------------------------
# cache


def _output_name(flags: tuple[str, ...]) -> str:
    if "-ptx" in flags or "--ptx" in flags:
        return "kernel.ptx"
    if "-fatbin" in flags or "--fatbin" in flags:
        return "kernel.fatbin"
    return "kernel.cubin"


def _command(flags: tuple[str, ...], directory: Path, out_name: str) -> tuple[str, ...]:
    return (nvcc_path(), *flags, f"-I{INCLUDE_DIR}", str(directory / _SOURCE), "-o",
            str(directory / out_name))


def _sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _discard(path: Path, root: Path) -> None:
    """Move a (corrupt) entry aside atomically, then delete it."""
    trash = Path(tempfile.mkdtemp(prefix=".trash-", dir=root))
    try:
        os.rename(path, trash / "entry")
    except FileNotFoundError:
        pass  # someone else already removed it
    except OSError:
        shutil.rmtree(path, ignore_errors=True)
    shutil.rmtree(trash, ignore_errors=True)


def _load_entry(entry: Path, key: str, *, cache_hit: bool) -> BuildResult | None:
    """A BuildResult for a complete, checksum-valid entry; None when missing or corrupt."""
    try:
        meta = json.loads((entry / _META).read_text())
        if not isinstance(meta, dict) or meta.get("format") != _CACHE_FORMAT or meta.get("key") != key:
            return None
        out_path = entry / meta["output"]
        data = out_path.read_bytes()
        if not data or len(data) != meta["output_size"] or _sha256_bytes(data) != meta["output_sha256"]:
            return None
        cu_path = entry / _SOURCE
        log = (entry / _LOG).read_text()
        if not cu_path.is_file():
            return None
        resources = ResourceTable(
            {k: KernelResources(**v) for k, v in meta["resources"].items()}, meta.get("demangled", {}))
        art_dir = entry / _ARTIFACTS
        artifacts = {}
        if art_dir.is_dir():
            artifacts = {p.name: p for p in sorted(art_dir.iterdir()) if p.is_file()}
        return BuildResult(
            cubin_path=out_path, cu_path=cu_path, resources=resources, log=log,
            command=_command(tuple(meta["flags"]), entry, meta["output"]), cache_hit=cache_hit,
            key=key, entry_dir=entry, artifacts=artifacts, warnings=tuple(meta.get("warnings", ())),
            nvcc_version=meta.get("nvcc_version", ""), name=meta.get("name", ""))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _write_artifacts(directory: Path, artifacts: Mapping[str, str], *, only_missing: bool) -> None:
    if not artifacts:
        return
    art_dir = directory / _ARTIFACTS
    art_dir.mkdir(exist_ok=True)
    for name, text in artifacts.items():
        target = art_dir / name
        if only_missing and target.exists():
            continue
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=art_dir)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, target)


def _check_artifact_names(artifacts: Mapping[str, str]) -> None:
    for name, text in artifacts.items():
        if not isinstance(name, str) or not _ARTIFACT_NAME.match(name):
            raise ValueError(f"artifact name {name!r} must match {_ARTIFACT_NAME.pattern} "
                             "(a plain file name)")
        if not isinstance(text, str):
            raise TypeError(f"artifact {name!r} must be text (str), got {type(text).__name__}")


def _post_checks(result: BuildResult, allow_spills: bool, error_codes: tuple[str, ...],
                 allow_wgmma_serialization: bool) -> BuildResult:
    check_ptxas_log(result.log, cu_path=result.cu_path, command=result.command, name=result.name,
                    error_codes=error_codes, allow_wgmma_serialization=allow_wgmma_serialization)
    return check_resources(result, allow_spills=allow_spills)


def compile_cuda(
    source: str,
    *,
    name: str,
    extra_key: str = "",
    cache_dir: Path | str | None = None,
    flags: tuple[str, ...] = NVCC_FLAGS,
    artifacts: Mapping[str, str] | None = None,
    allow_spills: bool = False,
    error_codes: tuple[str, ...] = ERROR_WARNING_CODES,
    allow_wgmma_serialization: bool = True,
) -> BuildResult:
    """Compile `source` (a whole .cu; ``#include "wsched.cuh"`` resolves) through the cache.

    `name` labels the build in messages and meta.json (not part of the key).  `artifacts`
    (file name -> text, e.g. per-pass IR dumps) are stored in the entry; on a hit, names the
    entry lacks are added.  Raises BuildError on nvcc failure, on any ptxas line with one of
    `error_codes` (C7508), on spills unless `allow_spills`, and on ptxas serializing wgmma
    (C7511 and kin) unless `allow_wgmma_serialization` (default: allowed; it stays visible in
    ``result.warnings``).  A cached entry is re-checked on every hit, so it fails the same way.
    """
    flags = tuple(flags)
    artifacts = dict(artifacts or {})
    _check_artifact_names(artifacts)
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    key = cache_key(source, flags, extra_key)
    entry = root / key

    if entry.exists():
        hit = _load_entry(entry, key, cache_hit=True)
        if hit is not None:
            if artifacts and any(n not in hit.artifacts for n in artifacts):
                _write_artifacts(entry, artifacts, only_missing=True)
                hit = _load_entry(entry, key, cache_hit=True) or hit
            return _post_checks(hit, allow_spills, error_codes, allow_wgmma_serialization)
        _discard(entry, root)

    result = _build(source, name=name, key=key, root=root, flags=flags, artifacts=artifacts)
    return _post_checks(result, allow_spills, error_codes, allow_wgmma_serialization)


def _line_directive(path: Path) -> str:
    quoted = str(path).replace("\\", "\\\\").replace('"', '\\"')
    return f'#line 1 "{quoted}"\n'


def _build(source: str, *, name: str, key: str, root: Path, flags: tuple[str, ...],
           artifacts: Mapping[str, str]) -> BuildResult:
    entry = root / key
    out_name = _output_name(flags)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=root))
    os.chmod(tmp, 0o755)  # mkdtemp makes it 0700; a shared cache should stay readable
    try:
        # The #line names the file where it will live once published: -lineinfo then points
        # the profiler at a file that exists, and the cubin does not depend on the temp dir.
        (tmp / _SOURCE).write_text(_line_directive(entry / _SOURCE) + source)
        argv = _command(flags, tmp, out_name)
        t0 = time.monotonic()
        try:
            proc = subprocess.run(argv, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True, timeout=_NVCC_TIMEOUT_S, check=False)
            log, rc = proc.stdout, proc.returncode
        except subprocess.TimeoutExpired as e:
            out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
            log, rc = out + f"\n[wsched] nvcc timed out after {_NVCC_TIMEOUT_S} s\n", None
        seconds = time.monotonic() - t0
        out_path = tmp / out_name
        if rc != 0 or not out_path.is_file() or out_path.stat().st_size == 0:
            _raise_failed(source, name=name, key=key, root=root, tmp=tmp, flags=flags,
                          out_name=out_name, log=log, rc=rc)

        data = out_path.read_bytes()
        parsed = parse_ptxas_log(log)
        demangled = _demangle_all(list(parsed))
        meta = {
            "format": _CACHE_FORMAT,
            "key": key,
            "name": name,
            "flags": list(flags),
            "output": out_name,
            "output_size": len(data),
            "output_sha256": _sha256_bytes(data),
            "nvcc": nvcc_path(),
            "nvcc_version": nvcc_version(),
            "toolchain": toolchain_fingerprint(),
            "include_dir": str(INCLUDE_DIR),
            "compile_seconds": round(seconds, 3),
            "created": time.time(),
            "resources": {k: vars(v) for k, v in parsed.items()},
            "demangled": demangled,
            "warnings": ptxas_warnings(log),
        }
        (tmp / _LOG).write_text(log)
        _write_artifacts(tmp, artifacts, only_missing=False)
        (tmp / _META).write_text(json.dumps(meta, indent=1, sort_keys=True))

        for _attempt in range(3):
            try:
                os.rename(tmp, entry)
                tmp = None
                break
            except OSError:
                # Another process published this key first: use theirs if it is valid.
                other = _load_entry(entry, key, cache_hit=False)
                if other is not None:
                    if artifacts:
                        _write_artifacts(entry, artifacts, only_missing=True)
                        other = _load_entry(entry, key, cache_hit=False) or other
                    return other
                if entry.exists():
                    _discard(entry, root)
        result = _load_entry(entry, key, cache_hit=False)
        if result is None:
            raise BuildError(f"could not publish cache entry {entry} for {name!r}")
        return result
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def _raise_failed(source: str, *, name: str, key: str, root: Path, tmp: Path,
                  flags: tuple[str, ...], out_name: str, log: str, rc: int | None) -> None:
    failed = root / "failed" / key
    failed.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(failed, ignore_errors=True)
    # diagnostics name the file by its #line path (the entry it would have become)
    log = log.replace(str(root / key / _SOURCE), str(failed / _SOURCE))
    try:
        (tmp / _SOURCE).write_text(_line_directive(failed / _SOURCE) + source)
        (tmp / "nvcc.log").write_text(log)
        os.rename(tmp, failed)
        where = failed
    except OSError:
        # a concurrent failure of the same key (same source and flags) published an
        # equivalent copy first; point at that one (ours is removed by the caller)
        where = failed if (failed / _SOURCE).is_file() else tmp
    command = _command(flags, where, out_name)
    cu_path = where / _SOURCE
    tail = log.rstrip().splitlines()[-_LOG_TAIL_LINES:]
    status = "timed out" if rc is None else f"exit status {rc}"
    msg = "\n".join([
        f"nvcc failed ({status}) compiling {name!r}",
        f"  source: {cu_path}",
        f"  repro:  {shlex.join(command)}",
        f"  --- nvcc output (last {len(tail)} lines) ---",
        *(f"  {ln}" for ln in tail),
    ])
    raise BuildError(msg, cu_path=cu_path, command=command, log=log)


def compile_ptx(source: str, *, name: str, cache_dir: Path | str | None = None,
                extra_key: str = "", flags: tuple[str, ...] = PTX_FLAGS) -> str:
    """PTX text for `source` (cached like compile_cuda); for inspecting emitted asm."""
    res = compile_cuda(source, name=name, extra_key=extra_key, cache_dir=cache_dir, flags=flags,
                       allow_spills=True)
    return res.cubin_path.read_text()


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
