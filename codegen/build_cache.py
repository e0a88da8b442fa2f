"""The content-addressed on-disk build cache: keys, entries, atomic publishing, corruption.

key = sha256("wsched-build-v1", source, flags, toolchain fingerprint, header contents,
extra_key).  The toolchain fingerprint (`nvcc.toolchain_fingerprint`) identifies nvcc without
running it, so a warm hit runs no subprocess at all.

Layout: ``<cache_dir>/<key>/`` holding kernel.cu (the source after a first line
``#line 1 "<that file's own path>"``, so -lineinfo names a file that exists and the cubin does
not depend on the temporary build dir), kernel.cubin (or kernel.ptx for ``-ptx``),
ptxas.log, meta.json (with the sha256 of the output) and ``artifacts/<name>``.  Default cache
dir: ``$WSCHED_CACHE_DIR`` or ``~/.cache/wsched``.

Concurrency: an entry is built in ``<cache_dir>/.tmp-<host>-<pid>-*`` and published with one
``os.rename``; if the target already exists the other process won and its entry is used.  A
corrupt entry (missing/short output, checksum mismatch, unreadable meta.json, or meta.json of the
wrong shape) is moved aside and rebuilt.  Failed builds are kept under
``<cache_dir>/failed/<key>/`` so the paths in the error message stay valid.

Faults (``usable_root``): a cache path that is a file is a `CacheError` naming the path and
``WSCHED_CACHE_DIR``; a cache directory this user cannot write, or does not own (its cubins are
loaded and run, so another user's are not trusted), is replaced by a private temporary cache
for the process, with a one-line `CacheWarning`.  A build killed midway leaves its ``.tmp-``
directory behind; the next build removes those whose process is gone, or which are older than
any build can take (`sweep_stale`).  Entries get the read permissions the cache directory
gives: a cache the group can read has entries the group can read.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import hashlib
import json
import os
import re
import shlex
import shutil
import socket
import stat
import tempfile
import time
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from wsched import knobs

from . import nvcc
from .ptxas_report import KernelResources, ResourceTable

__all__ = [
    "SOURCE",
    "BuildResult",
    "CacheError",
    "CacheWarning",
    "build_dir",
    "cache_key",
    "check_artifact_names",
    "default_cache_dir",
    "keep_failed",
    "lookup",
    "publish",
    "sweep_stale",
    "usable_root",
    "write_source",
]

_CACHE_FORMAT = 1
SOURCE = "kernel.cu"
_META = "meta.json"
_LOG = "ptxas.log"
_ARTIFACTS = "artifacts"
_ARTIFACT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_OUTPUT_NAMES = ("kernel.cubin", "kernel.ptx", "kernel.fatbin")  # nvcc.output_name's answers
# Scratch directories: ``<prefix><host>-<pid>-<random>``, so a later build can tell a live one
# from the leftovers of a killed one.
_SCRATCH_PREFIXES = (".tmp-", ".trash-")
# A scratch directory older than this belongs to no live build (nvcc is stopped after
# nvcc._NVCC_TIMEOUT_S = 15 minutes); it is the rule for one of another host or an old name.
STALE_SECONDS = 30 * 60


class CacheError(nvcc.BuildError):
    """The build cache cannot be used as configured (e.g. its path is a file)."""


class CacheWarning(UserWarning):
    """The configured build cache is not usable; builds go to a private temporary cache."""


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


# --------------------------------------------------------------------------------------------
# the cache directory under faults


def _not_a_directory(root: Path, what: Path) -> CacheError:
    where = "is a file" if what == root else f"lies under {what}, which is a file"
    return CacheError(f"build cache {root} {where}, not a directory: remove {what}, or point "
                      "WSCHED_CACHE_DIR (or cache_dir=) at a directory")


def _file_on_path(root: Path) -> Path | None:
    """`root` or the first of its parents that exists as something other than a directory."""
    for path in (root, *root.parents):
        if path.exists() or path.is_symlink():
            return None if path.is_dir() else path
    return None


def _why_unusable(root: Path) -> str | None:
    """Why this process must not build into the directory `root`, or None when it may."""
    info = root.stat()
    if info.st_uid != os.geteuid():
        return f"is owned by uid {info.st_uid}, not by this user (uid {os.geteuid()})"
    mode = os.W_OK | os.X_OK
    writable = (os.access(root, mode, effective_ids=True) if os.access in os.supports_effective_ids
                else os.access(root, mode))
    if not writable:
        return "is not writable"
    return None


def usable_root(root: Path) -> Path:
    """The directory to build into for the cache `root`: `root` itself (created if missing);
    a private temporary cache, with one `CacheWarning`, when `root` is read-only or another
    user's; `CacheError` when `root` (or a parent) is a file."""
    root = Path(root)
    blocking = _file_on_path(root)
    if blocking is not None:
        raise _not_a_directory(root, blocking)
    try:
        root.mkdir(parents=True, exist_ok=True)
        reason = _why_unusable(root)
    except (FileExistsError, NotADirectoryError):  # replaced by a file meanwhile
        raise _not_a_directory(root, _file_on_path(root) or root) from None
    except OSError as error:
        reason = f"cannot be created ({error.strerror or error})"
    if reason is None:
        return root
    return fallback_root(root, reason)


_warned: set[Path] = set()


def fallback_root(root: Path, reason: str) -> Path:
    """The private temporary cache used instead of `root`, warning once per `root`."""
    private = _private_cache()
    if root not in _warned:
        _warned.add(root)
        warnings.warn(f"wsched build cache {root} {reason}; building in the private temporary "
                      f"cache {private} instead (set WSCHED_CACHE_DIR to a directory you own)",
                      CacheWarning, stacklevel=3)
    return private


@lru_cache(maxsize=None)
def _host() -> str:
    return re.sub(r"[^A-Za-z0-9_.]", "_", socket.gethostname())[:64] or "host"


def _scratch_tag() -> str:
    return f"{_host()}-{os.getpid()}-"


@lru_cache(maxsize=None)
def _private_cache_of(pid: int) -> Path:
    base = Path(tempfile.gettempdir())
    sweep_stale(base, prefixes=("wsched-cache-",))  # those of killed processes
    path = Path(tempfile.mkdtemp(prefix="wsched-cache-" + _scratch_tag(), dir=base))

    def remove() -> None:
        if os.getpid() == pid:  # not from a forked child that inherited the handler
            shutil.rmtree(path, ignore_errors=True)

    atexit.register(remove)
    return path


def _private_cache() -> Path:
    """A cache directory of this process alone (mode 0700), removed when it exits."""
    return _private_cache_of(os.getpid())


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # e.g. EPERM: it exists, as another user's
        return True
    return True


def _is_stale(path: Path, prefix: str, now: float) -> bool:
    match = re.match(re.escape(prefix) + r"(?P<host>[A-Za-z0-9_.]+)-(?P<pid>\d+)-", path.name)
    if match and match["host"] == _host():
        return not _pid_alive(int(match["pid"]))
    try:
        return now - path.lstat().st_mtime > STALE_SECONDS
    except OSError:
        return False


def sweep_stale(root: Path, prefixes: tuple[str, ...] = _SCRATCH_PREFIXES) -> list[Path]:
    """Remove the scratch directories in `root` that no live build owns: those of this host
    whose process is gone, and any older than `STALE_SECONDS`. Returns what was removed."""
    now = time.time()
    removed = []
    try:
        children = list(os.scandir(root))
    except OSError:
        return removed
    for child in children:
        prefix = next((p for p in prefixes if child.name.startswith(p)), None)
        if prefix is None or not child.is_dir(follow_symlinks=False):
            continue
        path = Path(child.path)
        try:
            if path.lstat().st_uid != os.geteuid():
                continue  # another user's: not ours to judge or remove
        except OSError:
            continue
        if _is_stale(path, prefix, now):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _scratch_dir(root: Path, prefix: str) -> Path:
    return Path(tempfile.mkdtemp(prefix=prefix + _scratch_tag(), dir=root))


# --------------------------------------------------------------------------------------------
# permissions: entries readable by whoever can read the cache


def _modes(root: Path) -> tuple[int, int]:
    """(directory mode, file mode) of entries in `root`: the owner's rw(x), plus the read (and
    search) bits `root` gives its group and others."""
    readers = stat.S_IMODE(root.stat().st_mode) & 0o055
    return 0o700 | readers, 0o600 | (readers & 0o044)


def _share(path: Path, root: Path) -> None:
    """Give `path` (a file, or a directory and all it holds) the modes of `root`'s entries."""
    dir_mode, file_mode = _modes(root)
    if path.is_dir():
        os.chmod(path, dir_mode)
        for parent, dirs, files in os.walk(path):
            for name in dirs:
                os.chmod(os.path.join(parent, name), dir_mode)
            for name in files:
                os.chmod(os.path.join(parent, name), file_mode)
    else:
        os.chmod(path, file_mode)


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
    trash = _scratch_dir(root, ".trash-")
    try:
        os.rename(path, trash / "entry")
    except FileNotFoundError:
        pass  # someone else already removed it
    except OSError:
        shutil.rmtree(path, ignore_errors=True)
    shutil.rmtree(trash, ignore_errors=True)


_RESOURCE_FIELDS = frozenset(f.name for f in dataclasses.fields(KernelResources))


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_str_list(value: object) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def _meta_is_valid(meta: object, key: str) -> bool:
    """Whether meta.json has the shape `publish` writes: valid JSON of the wrong shape (a list,
    a string where an int belongs, an output path outside the entry) is a corrupt entry."""
    if not isinstance(meta, dict):
        return False
    resources = meta.get("resources")
    return (meta.get("format") == _CACHE_FORMAT and meta.get("key") == key
            and meta.get("output") in _OUTPUT_NAMES
            and _is_int(meta.get("output_size")) and isinstance(meta.get("output_sha256"), str)
            and _is_str_list(meta.get("flags")) and _is_str_list(meta.get("warnings", []))
            and isinstance(meta.get("nvcc_version", ""), str) and isinstance(meta.get("name", ""), str)
            and isinstance(resources, dict)
            and all(isinstance(kernel, str) and isinstance(r, dict) and set(r) == _RESOURCE_FIELDS
                    and all(_is_int(v) for v in r.values()) for kernel, r in resources.items()))


def _artifact_files(entry: Path) -> dict[str, Path]:
    """The entry's artifacts by name (not the scratch files of an interrupted write)."""
    art_dir = entry / _ARTIFACTS
    if not art_dir.is_dir():
        return {}
    return {p.name: p for p in sorted(art_dir.iterdir()) if _ARTIFACT_NAME.match(p.name) and p.is_file()}


def _load_entry(entry: Path, key: str, *, cache_hit: bool) -> BuildResult | None:
    """A BuildResult for a complete, checksum-valid entry; None when missing or corrupt."""
    try:
        meta = json.loads((entry / _META).read_text())
        if not _meta_is_valid(meta, key):
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
        artifacts = _artifact_files(entry)
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
    dir_mode, file_mode = _modes(directory)
    os.chmod(art_dir, dir_mode)
    for name, text in artifacts.items():
        target = art_dir / name
        if only_missing and target.exists():
            continue
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=art_dir)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, file_mode)  # mkstemp makes it 0600
        os.replace(tmp, target)


@contextlib.contextmanager
def build_dir(root: Path) -> Iterator[Path]:
    """A fresh directory under `root` to build an entry in; removed afterwards unless it was
    published (or kept as a failed build)."""
    tmp = _scratch_dir(root, ".tmp-")
    os.chmod(tmp, _modes(root)[0])  # mkdtemp makes it 0700; as readable as the cache
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
    _share(tmp, root)

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
        _share(tmp, root)
        os.rename(tmp, failed)
        return failed, log
    except OSError:
        # a concurrent failure of the same key (same source and flags) published an
        # equivalent copy first; point at that one (ours is removed by the caller)
        return (failed if (failed / SOURCE).is_file() else tmp), log
