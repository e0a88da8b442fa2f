"""Compile a generated .cu with nvcc through the on-disk cache, and check what ptxas reports.

    result = compile_cuda(source, name="matmul", artifacts={"loop_ir.txt": ir_text})
    result.cubin_path            # load with cuModuleLoadData / cuLibraryLoadFromFile
    result.resources["matmul"]   # KernelResources of the extern "C" kernel
    result.artifact_text("loop_ir.txt")

This module composes three of one concern each:

    nvcc.py          the nvcc driver: flags, running nvcc, the repro command of a failure
    build_cache.py   the content-addressed on-disk cache: keys, atomic publishing, corruption
    ptxas_report.py  the ptxas report: registers, smem, spills, warnings; C7508 and spills fail

Errors are ``BuildError``: an nvcc failure (message has the .cu path, a copy-pasteable repro
command and the tail of nvcc's output), ptxas warning C7508 ("setmaxnreg ignored"), and — unless
``allow_spills=True`` — any register spill or stack frame; a cache path that is a file is a
``CacheError`` (a BuildError).  A cache this process cannot write (read-only, another user's,
or failing with an OS error midway) is not an error: the build goes to a private temporary
cache, with a one-line ``CacheWarning`` (``build_cache.usable_root``).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path

from . import build_cache, nvcc
from .build_cache import SOURCE, BuildResult, CacheError, CacheWarning
from .nvcc import NVCC_FLAGS, PTX_FLAGS, BuildError
from .ptxas_report import (ERROR_WARNING_CODES, check_ptxas_log, check_resources, parse_ptxas_log,
                           ptxas_warnings)

__all__ = ["BuildError", "BuildResult", "CacheError", "CacheWarning", "compile_cuda", "compile_ptx"]


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
    build_cache.check_artifact_names(artifacts)
    configured = Path(cache_dir) if cache_dir is not None else build_cache.default_cache_dir()
    root = build_cache.usable_root(configured)
    key = build_cache.cache_key(source, flags, extra_key)
    try:
        result = _lookup_or_build(source, name=name, key=key, root=root, flags=flags, artifacts=artifacts)
    except OSError as error:
        # The cache failed midway (a full disk, an entry someone else made unreadable...):
        # build once more where nothing else writes.
        private = build_cache.fallback_root(configured, f"failed ({error})")
        if private == root:
            raise BuildError(f"building {name!r} in the build cache {root} failed: {error}") from error
        result = _lookup_or_build(source, name=name, key=key, root=private, flags=flags, artifacts=artifacts)
    # A hit is checked again, so a cached build fails the same way as a fresh one.
    check_ptxas_log(result.log, cu_path=result.cu_path, command=result.command, name=result.name,
                    error_codes=error_codes, allow_wgmma_serialization=allow_wgmma_serialization)
    if not allow_spills:
        check_resources(result.resources, cu_path=result.cu_path, command=result.command,
                        name=result.name, log=result.log)
    return result


def _lookup_or_build(source: str, *, name: str, key: str, root: Path, flags: tuple[str, ...],
                     artifacts: Mapping[str, str]) -> BuildResult:
    result = build_cache.lookup(root, key, artifacts)
    if result is None:
        build_cache.sweep_stale(root)  # scratch dirs of builds killed midway
        result = _build(source, name=name, key=key, root=root, flags=flags, artifacts=artifacts)
    return result


def _build(source: str, *, name: str, key: str, root: Path, flags: tuple[str, ...],
           artifacts: Mapping[str, str]) -> BuildResult:
    """A cache miss: run nvcc in a fresh build dir and publish it as the entry of `key`."""
    out_name = nvcc.output_name(flags)
    with build_cache.build_dir(root) as tmp:
        cu_path = build_cache.write_source(tmp, source, lives_in=root / key)
        t0 = time.monotonic()
        argv = nvcc.command(flags, cu_path, tmp / out_name)
        try:
            log, rc = nvcc.run(argv, cwd=root)
        except OSError as error:  # not an OSError of the cache: do not retry elsewhere
            raise BuildError(f"could not run nvcc ({error}) compiling {name!r}",
                             cu_path=cu_path, command=argv) from None
        seconds = time.monotonic() - t0
        out_path = tmp / out_name
        if rc != 0 or not out_path.is_file() or out_path.stat().st_size == 0:
            where, log = build_cache.keep_failed(tmp, root, key, source, log)
            command = nvcc.command(flags, where / SOURCE, where / out_name)
            raise nvcc.failure(name, where / SOURCE, command, log, rc)
        meta = {
            "name": name,
            "flags": list(flags),
            "output": out_name,
            "nvcc": nvcc.nvcc_path(),
            "nvcc_version": nvcc.nvcc_version(),
            "toolchain": nvcc.toolchain_fingerprint(),
            "include_dir": str(nvcc.INCLUDE_DIR),
            "compile_seconds": round(seconds, 3),
            "created": time.time(),
            "resources": {k: vars(v) for k, v in parse_ptxas_log(log).items()},
            "warnings": ptxas_warnings(log),
        }
        return build_cache.publish(tmp, root, key, meta=meta, log=log, artifacts=artifacts)


def compile_ptx(source: str, *, name: str, cache_dir: Path | str | None = None,
                extra_key: str = "", flags: tuple[str, ...] = PTX_FLAGS) -> str:
    """PTX text for `source` (cached like compile_cuda); for inspecting emitted asm."""
    res = compile_cuda(source, name=name, extra_key=extra_key, cache_dir=cache_dir, flags=flags,
                       allow_spills=True)
    return res.cubin_path.read_text()
