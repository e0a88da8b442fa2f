"""The content-addressed on-disk build cache: keys, entries, atomic publishing, corruption.

key = sha256("wsched-build-v1", source, flags, toolchain fingerprint, header contents,
extra_key).  The toolchain fingerprint (`nvcc.toolchain_fingerprint`) identifies nvcc without
running it, so a warm hit runs no subprocess at all.

Layout: ``<cache_dir>/<key>/`` holding kernel.cu (the source after a first line
``#line 1 "<that file's own path>"``, so -lineinfo names a file that exists and the cubin does
not depend on the temporary build dir), kernel.cubin (or kernel.ptx for ``-ptx``),
ptxas.log, meta.json (with the sha256 of the output) and ``artifacts/<name>``.  Default cache
dir: ``$WSCHED_CACHE_DIR`` or ``~/.cache/wsched``.

Concurrency: an entry is built in ``<cache_dir>/.tmp-*`` and published with one ``os.rename``;
if the target already exists the other process won and its entry is used.  A corrupt entry
(missing/short output, checksum mismatch, unreadable meta.json) is moved aside and rebuilt.
Failed builds are kept under ``<cache_dir>/failed/<key>/`` so the paths in the error message
stay valid.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shlex
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from wsched import knobs

from . import nvcc
from .ptxas_report import KernelResources, ResourceTable

__all__ = [
    "SOURCE",
    "BuildResult",
    "build_dir",
    "cache_key",
    "check_artifact_names",
    "default_cache_dir",
    "keep_failed",
    "lookup",
    "publish",
    "write_source",
]

_CACHE_FORMAT = 1
SOURCE = "kernel.cu"
_META = "meta.json"
_LOG = "ptxas.log"
_ARTIFACTS = "artifacts"
_ARTIFACT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


@dataclass(frozen=True)
class BuildResult:
    cubin_path: Path  # the output file (kernel.cubin; kernel.ptx when built with -ptx)
    cu_path: Path
    resources: ResourceTable  # kernel name -> KernelResources
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
# keys


def _headers_digest() -> str:
    h = hashlib.sha256()
    for p in sorted(nvcc.INCLUDE_DIR.glob("*.cuh")):
        h.update(p.name.encode() + b"\0")
        h.update(p.read_bytes() + b"\0")
    return h.hexdigest()


def default_cache_dir() -> Path:
    return knobs.cache_dir()


def cache_key(source: str, flags: tuple[str, ...] = nvcc.NVCC_FLAGS, extra_key: str = "") -> str:
    h = hashlib.sha256()
    for part in ("wsched-build-v1", source, "\x1f".join(flags), nvcc.toolchain_fingerprint(),
                 _headers_digest(), extra_key):
        data = part.encode()
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()


# --------------------------------------------------------------------------------------------
# reading entries


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
        cu_path = entry / SOURCE
        log = (entry / _LOG).read_text()
        if not cu_path.is_file():
            return None
        resources = ResourceTable({k: KernelResources(**v) for k, v in meta["resources"].items()})
        art_dir = entry / _ARTIFACTS
        artifacts = {}
        if art_dir.is_dir():
            artifacts = {p.name: p for p in sorted(art_dir.iterdir()) if p.is_file()}
        return BuildResult(
            cubin_path=out_path, cu_path=cu_path, resources=resources, log=log,
            command=nvcc.command(tuple(meta["flags"]), cu_path, out_path), cache_hit=cache_hit,
            key=key, entry_dir=entry, artifacts=artifacts, warnings=tuple(meta.get("warnings", ())),
            nvcc_version=meta.get("nvcc_version", ""), name=meta.get("name", ""))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def lookup(root: Path, key: str, artifacts: Mapping[str, str]) -> BuildResult | None:
    """The valid entry `root/key` (given the `artifacts` it lacks), or None: a miss, or a corrupt
    entry, which is removed so that it is rebuilt."""
    entry = root / key
    if not entry.exists():
        return None
    hit = _load_entry(entry, key, cache_hit=True)
    if hit is None:
        _discard(entry, root)
        return None
    if artifacts and any(n not in hit.artifacts for n in artifacts):
        _write_artifacts(entry, artifacts, only_missing=True)
        hit = _load_entry(entry, key, cache_hit=True) or hit
    return hit


# --------------------------------------------------------------------------------------------
# writing entries


def check_artifact_names(artifacts: Mapping[str, str]) -> None:
    for name, text in artifacts.items():
        if not isinstance(name, str) or not _ARTIFACT_NAME.match(name):
            raise ValueError(f"artifact name {name!r} must match {_ARTIFACT_NAME.pattern} "
                             "(a plain file name)")
        if not isinstance(text, str):
            raise TypeError(f"artifact {name!r} must be text (str), got {type(text).__name__}")


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


@contextlib.contextmanager
def build_dir(root: Path) -> Iterator[Path]:
    """A fresh directory under `root` to build an entry in; removed afterwards unless it was
    published (or kept as a failed build)."""
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=root))
    os.chmod(tmp, 0o755)  # mkdtemp makes it 0700; a shared cache should stay readable
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _line_directive(path: Path) -> str:
    quoted = str(path).replace("\\", "\\\\").replace('"', '\\"')
    return f'#line 1 "{quoted}"\n'


def write_source(directory: Path, source: str, lives_in: Path) -> Path:
    """Write `source` as `directory`'s kernel.cu, its #line naming the file in `lives_in` (the
    entry it becomes): -lineinfo then points the profiler at a file that exists, and the cubin
    does not depend on the temporary build dir."""
    path = directory / SOURCE
    path.write_text(_line_directive(lives_in / SOURCE) + source)
    return path


def publish(tmp: Path, root: Path, key: str, *, meta: Mapping[str, object], log: str,
            artifacts: Mapping[str, str]) -> BuildResult:
    """Complete the entry built in `tmp` (the log, the artifacts and meta.json with the output's
    checksum; `meta["output"]` names the output) and publish it as `root/key` with one rename.
    When another process published the key first, its entry is used if valid, replaced if not."""
    entry = root / key
    data = (tmp / str(meta["output"])).read_bytes()
    meta = {**meta, "format": _CACHE_FORMAT, "key": key, "output_size": len(data),
            "output_sha256": _sha256_bytes(data)}
    (tmp / _LOG).write_text(log)
    _write_artifacts(tmp, artifacts, only_missing=False)
    (tmp / _META).write_text(json.dumps(meta, indent=1, sort_keys=True))

    for _attempt in range(3):
        try:
            os.rename(tmp, entry)
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
        raise nvcc.BuildError(f"could not publish cache entry {entry} for {meta.get('name', '')!r}")
    return result


def keep_failed(tmp: Path, root: Path, key: str, source: str, log: str) -> tuple[Path, str]:
    """Keep a failed build (source and nvcc.log) as ``failed/<key>``; return where it lies and
    the log with the source named by that path."""
    failed = root / "failed" / key
    failed.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(failed, ignore_errors=True)
    # diagnostics name the file by its #line path (the entry it would have become)
    log = log.replace(str(root / key / SOURCE), str(failed / SOURCE))
    try:
        write_source(tmp, source, failed)
        (tmp / "nvcc.log").write_text(log)
        os.rename(tmp, failed)
        return failed, log
    except OSError:
        # a concurrent failure of the same key (same source and flags) published an
        # equivalent copy first; point at that one (ours is removed by the caller)
        return (failed if (failed / SOURCE).is_file() else tmp), log
