"""nvcc driver, on-disk cache and ptxas report: keys, hits, corruption, concurrency, errors,
log parsing."""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
import uuid
import warnings
from pathlib import Path

import pytest

from wsched.codegen import build, build_cache, nvcc
from wsched.codegen.build import BuildError, BuildResult, compile_cuda
from wsched.codegen.build_cache import cache_key
from wsched.codegen.nvcc import NVCC_FLAGS
from wsched.codegen.ptxas_report import (
    KernelResources,
    ResourceTable,
    check_ptxas_log,
    check_resources,
    parse_ptxas_log,
)

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")


def small_source(tag: str = "") -> str:
    # a unique comment makes a fresh cache key per test
    return f"""\
// {tag or uuid.uuid4().hex}
#include "wsched.cuh"
extern "C" __global__ void scale(float* x, float s, int n) {{
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) x[i] = wsp::ex2_approx(x[i]) * s;
}}
extern "C" __global__ void add_k(float* x) {{ __shared__ float t[32]; t[threadIdx.x % 32] = 3;
  __syncthreads(); x[threadIdx.x] += t[(threadIdx.x + 1) % 32]; }}
"""


def _entries(cache: Path) -> list[Path]:
    return [p for p in cache.iterdir() if p.is_dir() and len(p.name) == 64]


# ------------------------------------------------------------------------------------------
# pure tests (no nvcc)

CANNED_LOG = """\
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'add_k' for 'sm_90a'
ptxas info    : Function properties for add_k
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 10 registers, used 1 barriers, 128 bytes smem
ptxas info    : Compile time = 1.702 ms
ptxas info    : Compiling entry function 'consumer_kernel' for 'sm_90a'
ptxas info    : Function properties for consumer_kernel
    24 bytes stack frame, 16 bytes spill stores, 8 bytes spill loads
ptxas info    : Used 232 registers, used 4 barriers
ptxas info    : Compile time = 20.066 ms
"""


def test_parse_ptxas_log():
    res = parse_ptxas_log(CANNED_LOG)
    assert isinstance(res, ResourceTable)
    assert list(res) == ["add_k", "consumer_kernel"]  # extern "C" kernels: plain names
    assert res["add_k"] == KernelResources(
        registers=10, smem_bytes=128, spill_stores=0, spill_loads=0, stack_bytes=0, barriers=1)
    assert res["consumer_kernel"] == KernelResources(
        registers=232, smem_bytes=0, spill_stores=16, spill_loads=8, stack_bytes=24, barriers=4)
    assert "add_k" in res and "nope" not in res
    with pytest.raises(KeyError, match=r"no kernel named 'nope'; kernels: \['add_k', 'consumer_kernel'\]"):
        res["nope"]


def test_c7508_in_log_raises():
    log = ("ptxas info    : (C7508) Potential Performance Loss: 'setmaxnreg' ignored; unable to "
           "determine register count at entry.\n" + CANNED_LOG)
    with pytest.raises(BuildError, match="C7508") as ei:
        check_ptxas_log(log, cu_path=Path("/x/kernel.cu"), command=("nvcc", "/x/kernel.cu"))
    assert "/x/kernel.cu" in str(ei.value) and "repro:  nvcc /x/kernel.cu" in str(ei.value)
    check_ptxas_log(CANNED_LOG)  # no C7508: fine
    serial = ("ptxas info    : (C7511) Potential Performance Loss: wgmma.mma_async instructions "
              "are serialized due to insufficient register resources for the wgmma pipeline\n")
    check_ptxas_log(serial)  # allowed by default
    with pytest.raises(BuildError, match="C7511"):
        check_ptxas_log(serial, allow_wgmma_serialization=False)


def test_spills_raise_via_check_resources():
    where = dict(cu_path=Path("/x/kernel.cu"), command=("nvcc", "/x/kernel.cu"), name="canned")
    with pytest.raises(BuildError) as ei:
        check_resources(parse_ptxas_log(CANNED_LOG), **where, log=CANNED_LOG)
    msg = str(ei.value)
    assert msg.startswith("register spills in 'canned' (spills are an error; allow_spills=True")
    assert "consumer_kernel" in msg and "16 bytes spill stores" in msg and "8 bytes spill loads" in msg
    assert "24 bytes stack frame" in msg and "/x/kernel.cu" in msg
    assert "add_k" not in msg and ei.value.kernel == "consumer_kernel"
    clean = CANNED_LOG.split("ptxas info    : Compiling entry function 'consumer")[0]
    check_resources(parse_ptxas_log(clean), **where)


def test_key_changes_with_source_flags_and_extra_key():
    k = cache_key("a", NVCC_FLAGS)
    assert k == cache_key("a", NVCC_FLAGS)
    assert k != cache_key("b", NVCC_FLAGS)
    assert k != cache_key("a", NVCC_FLAGS + ("-DFOO=1",))
    assert k != cache_key("a", NVCC_FLAGS, extra_key="schedule-2")
    assert len(k) == 64


# ------------------------------------------------------------------------------------------
# nvcc tests


@pytest.mark.nvcc
@needs_nvcc
def test_miss_then_hit_with_artifacts(tmp_path, monkeypatch):
    src = small_source()
    r1 = compile_cuda(src, name="scale", cache_dir=tmp_path, artifacts={"loop_ir.txt": "loop i {}\n"})
    assert not r1.cache_hit
    assert r1.cubin_path.read_bytes()[:4] == b"\x7fELF"
    assert r1.cu_path.read_text() == f'#line 1 "{r1.cu_path}"\n' + src
    assert r1.resources["scale"].registers > 0
    assert r1.resources["add_k"].smem_bytes == 128
    assert r1.resources["add_k"].barriers == 1
    assert r1.command[0] == nvcc.nvcc_path() and str(r1.cu_path) in r1.command
    meta = json.loads((r1.entry_dir / "meta.json").read_text())
    assert meta["nvcc_version"].startswith(("12.", "13."))

    # A hit must not run nvcc (nor `nvcc --version`) at all.
    def no_subprocess(*a, **k):
        raise AssertionError("subprocess on a cache hit")

    monkeypatch.setattr(nvcc.subprocess, "run", no_subprocess)
    monkeypatch.setattr(nvcc, "nvcc_version", no_subprocess)
    r2 = compile_cuda(src, name="scale", cache_dir=tmp_path)   # its time: benchmarks/compile_time.py
    assert r2.cache_hit
    assert r2.cubin_path == r1.cubin_path and r2.resources["scale"] == r1.resources["scale"]
    assert r2.artifact_text("loop_ir.txt") == "loop i {}\n"
    # a hit adds artifacts the entry lacks
    r3 = compile_cuda(src, name="scale", cache_dir=tmp_path, artifacts={"schedule.txt": "s"})
    assert r3.cache_hit and r3.artifact_text("schedule.txt") == "s"
    assert r3.artifact_text("loop_ir.txt") == "loop i {}\n"
    assert len(_entries(tmp_path)) == 1


@pytest.mark.nvcc
@needs_nvcc
def test_corrupt_entries_are_recompiled(tmp_path):
    src = small_source()
    r1 = compile_cuda(src, name="scale", cache_dir=tmp_path)
    good = r1.cubin_path.read_bytes()

    # truncated cubin -> checksum/size mismatch -> rebuilt
    r1.cubin_path.write_bytes(good[: len(good) // 2])
    r2 = compile_cuda(src, name="scale", cache_dir=tmp_path)
    assert not r2.cache_hit and r2.cubin_path.read_bytes() == good

    # garbage meta.json -> rebuilt
    (r2.entry_dir / "meta.json").write_text("{not json")
    r3 = compile_cuda(src, name="scale", cache_dir=tmp_path)
    assert not r3.cache_hit and r3.cubin_path.read_bytes() == good

    assert compile_cuda(src, name="scale", cache_dir=tmp_path).cache_hit
    assert len(_entries(tmp_path)) == 1
    assert not [p for p in tmp_path.iterdir() if p.name.startswith((".tmp-", ".trash-"))]


@pytest.mark.nvcc
@needs_nvcc
def test_two_processes_compile_same_key(tmp_path):
    src = small_source()
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(2) as pool:
        jobs = [pool.apply_async(compile_cuda, (src,), {"name": f"p{i}", "cache_dir": tmp_path})
                for i in range(2)]
        results = [j.get(timeout=120) for j in jobs]
    assert all(isinstance(r, BuildResult) for r in results)
    entries = _entries(tmp_path)
    assert len(entries) == 1
    assert results[0].cubin_path == results[1].cubin_path == entries[0] / "kernel.cubin"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith((".tmp-", ".trash-"))]
    hit = compile_cuda(src, name="scale", cache_dir=tmp_path)
    assert hit.cache_hit and hit.cubin_path.stat().st_size > 0


@pytest.mark.nvcc
@needs_nvcc
def test_syntax_error_raises_with_path_and_repro(tmp_path):
    src = small_source() + "\nthis is not C++;\n"
    with pytest.raises(BuildError) as ei:
        compile_cuda(src, name="broken", cache_dir=tmp_path)
    e = ei.value
    msg = str(e)
    assert isinstance(e, RuntimeError)
    assert str(e.cu_path) in msg and e.cu_path.read_text().endswith(src)
    assert f"{e.cu_path}(" in msg  # nvcc diagnostics name the kept file
    assert "nvcc" in msg and "-gencode=arch=compute_90a,code=sm_90a" in msg
    assert "repro:" in msg and "error" in msg  # nvcc's own diagnostic tail
    assert e.command[0] == nvcc.nvcc_path() and str(e.cu_path) in e.command
    assert not _entries(tmp_path)  # nothing cached for a failed build


@pytest.mark.nvcc
@needs_nvcc
def test_publish_race_branches(tmp_path):
    # Deterministic versions of what the two-process test may or may not hit: this process
    # compiled, and at publish time the entry (a) already exists and is valid -> use it,
    # (b) exists but is corrupt -> replace it.
    src = small_source()
    first = compile_cuda(src, name="scale", cache_dir=tmp_path)
    key = first.key
    other = build._build(src, name="scale", key=key, root=tmp_path, flags=NVCC_FLAGS,
                         artifacts={"ir.txt": "x"})
    assert other.entry_dir == first.entry_dir and not other.cache_hit
    assert other.artifact_text("ir.txt") == "x"
    (first.entry_dir / "meta.json").write_text("[]")
    fixed = build._build(src, name="scale", key=key, root=tmp_path, flags=NVCC_FLAGS, artifacts={})
    assert fixed.entry_dir == first.entry_dir and fixed.cubin_path.read_bytes() == first.cubin_path.read_bytes()
    assert compile_cuda(src, name="scale", cache_dir=tmp_path).cache_hit
    assert len(_entries(tmp_path)) == 1
    assert not [p for p in tmp_path.iterdir() if p.name.startswith((".tmp-", ".trash-"))]


# ------------------------------------------------------------------------------------------
# the cache under faults: unusable directories, type-corrupt metadata, killed builds, modes


def _permissions_bind() -> bool:
    """Whether a directory's mode stops this process (root, or CAP_DAC_OVERRIDE, ignores it)."""
    with tempfile.TemporaryDirectory() as d:
        locked = Path(d) / "locked"
        locked.mkdir(mode=0o555)
        try:
            (locked / "probe").write_text("")
        except PermissionError:
            return True
        finally:
            locked.chmod(0o755)
    return False


needs_permissions = pytest.mark.skipif(not _permissions_bind(),
                                       reason="this process bypasses file permissions (root)")


def test_empty_cache_dir_env_counts_as_unset(monkeypatch, tmp_path):
    from wsched import knobs

    monkeypatch.setenv("HOME", str(tmp_path))
    for value in ("", "  "):
        monkeypatch.setenv("WSCHED_CACHE_DIR", value)
        assert knobs.cache_dir() == tmp_path / ".cache" / "wsched"  # never the current directory
    monkeypatch.setenv("WSCHED_CACHE_DIR", "~/kernels")
    assert knobs.cache_dir() == tmp_path / "kernels"


@pytest.mark.parametrize("where", ["root", "parent"])
def test_cache_path_that_is_a_file_is_a_clear_error(tmp_path, where):
    blocker = tmp_path / "cache"
    blocker.write_text("not a directory")
    root = blocker if where == "root" else blocker / "sub"
    with pytest.raises(build_cache.CacheError) as info:
        compile_cuda(small_source(), name="scale", cache_dir=root)  # before nvcc is looked for
    message = str(info.value)
    assert isinstance(info.value, BuildError)
    assert str(root) in message and f"remove {blocker}" in message and "WSCHED_CACHE_DIR" in message
    assert "\n" not in message


def test_foreign_owned_cache_falls_back_to_a_private_one(tmp_path, monkeypatch):
    root = tmp_path / "theirs"
    root.mkdir()
    monkeypatch.setattr(build_cache.os, "geteuid", lambda: root.stat().st_uid + 1)
    monkeypatch.setattr(build_cache, "_warned", set())
    with pytest.warns(build_cache.CacheWarning) as record:
        private = build_cache.usable_root(root)
    assert private != root and private.is_dir() and str(private).startswith(tempfile.gettempdir())
    message = str(record[0].message)
    assert str(root) in message and "is owned by uid" in message and str(private) in message
    assert "\n" not in message
    with warnings_as_errors():  # one warning per cache, not one per build
        assert build_cache.usable_root(root) == private


def test_missing_cache_is_created_and_used(tmp_path):
    root = tmp_path / "a" / "b"
    with warnings_as_errors():
        assert build_cache.usable_root(root) == root
    assert root.is_dir()


@pytest.fixture
def read_only_cache(tmp_path, monkeypatch):
    """A cache directory this process may read but not write (each test warns afresh)."""
    root = tmp_path / "readonly"
    root.mkdir()
    root.chmod(0o555)
    monkeypatch.setattr(build_cache, "_warned", set())
    yield root
    root.chmod(0o755)


@needs_permissions
def test_read_only_cache_falls_back_without_error(read_only_cache):
    root = read_only_cache
    with pytest.warns(build_cache.CacheWarning, match="is not writable"):
        private = build_cache.usable_root(root)
    with pytest.warns(build_cache.CacheWarning, match="cannot be created"):
        build_cache.usable_root(root / "sub")
    assert private != root and not list(root.iterdir())


@pytest.mark.nvcc
@needs_nvcc
@needs_permissions
def test_read_only_cache_builds_in_a_private_cache(read_only_cache):
    root = read_only_cache
    src = small_source()
    with pytest.warns(build_cache.CacheWarning):
        first = compile_cuda(src, name="scale", cache_dir=root)
    second = compile_cuda(src, name="scale", cache_dir=root)
    assert not first.cache_hit and second.cache_hit  # the private cache serves the process
    assert root not in first.entry_dir.parents and first.cubin_path.read_bytes()[:4] == b"\x7fELF"
    assert not list(root.iterdir())


def _good_meta(entry: Path) -> dict:
    return json.loads((entry / "meta.json").read_text())


TYPE_CORRUPTIONS = {
    "list": lambda m: [m],
    "string": lambda m: "meta",
    "format as text": lambda m: {**m, "format": "1"},
    "output outside the entry": lambda m: {**m, "output": "../kernel.cubin"},
    "output size as text": lambda m: {**m, "output_size": str(m["output_size"])},
    "checksum as number": lambda m: {**m, "output_sha256": 0},
    "flags as text": lambda m: {**m, "flags": " ".join(m["flags"])},
    "resources as list": lambda m: {**m, "resources": list(m["resources"])},
    "registers as text": lambda m: {**m, "resources": {k: {**v, "registers": "64"} for k, v in m["resources"].items()}},
    "registers as bool": lambda m: {**m, "resources": {k: {**v, "registers": True} for k, v in m["resources"].items()}},
    "unknown resource field": lambda m: {**m, "resources": {k: {**v, "x": 1} for k, v in m["resources"].items()}},
    "warnings as text": lambda m: {**m, "warnings": "C7508"},
    "name as number": lambda m: {**m, "name": 5},
    "no key": lambda m: {k: v for k, v in m.items() if k != "key"},
}


@pytest.mark.nvcc
@needs_nvcc
def test_type_corrupt_metadata_is_rebuilt(tmp_path):
    src = small_source()
    first = compile_cuda(src, name="scale", cache_dir=tmp_path)
    good = _good_meta(first.entry_dir)
    pristine = tmp_path.parent / f"{tmp_path.name}-pristine"
    shutil.copytree(first.entry_dir, pristine)
    for label, corrupt in TYPE_CORRUPTIONS.items():
        (first.entry_dir / "meta.json").write_text(json.dumps(corrupt(good)))
        assert build_cache.lookup(tmp_path, first.key, {}) is None, label   # corrupt: a miss
        assert not first.entry_dir.exists(), label                           # ...and removed
        shutil.copytree(pristine, first.entry_dir)
    # end to end: one corrupt entry is rebuilt by compile_cuda, never a TypeError
    (first.entry_dir / "meta.json").write_text(json.dumps(TYPE_CORRUPTIONS["registers as text"](good)))
    rebuilt = compile_cuda(src, name="scale", cache_dir=tmp_path)
    assert not rebuilt.cache_hit and rebuilt.cubin_path.read_bytes() == first.cubin_path.read_bytes()
    assert compile_cuda(src, name="scale", cache_dir=tmp_path).cache_hit


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_scratch_dirs_of_dead_builds_are_swept(tmp_path):
    host = build_cache._host()
    dead = tmp_path / f".tmp-{host}-{_dead_pid()}-abc"
    dead_trash = tmp_path / f".trash-{host}-{_dead_pid()}-abc"
    live = tmp_path / f".tmp-{host}-{os.getpid()}-abc"
    other_host = tmp_path / ".tmp-elsewhere-1-abc"
    old_unnamed = tmp_path / ".tmp-x7f3k"
    old_other_host = tmp_path / ".tmp-elsewhere-2-abc"
    entry = tmp_path / ("0" * 64)
    for path in (dead, dead_trash, live, other_host, old_unnamed, old_other_host, entry):
        path.mkdir()
        (path / "kernel.cu").write_text("")
    long_ago = time.time() - build_cache.STALE_SECONDS - 60
    for path in (old_unnamed, old_other_host, entry):
        os.utime(path, (long_ago, long_ago))
    removed = build_cache.sweep_stale(tmp_path)
    assert sorted(removed) == sorted([dead, dead_trash, old_unnamed, old_other_host])
    assert live.exists() and other_host.exists() and entry.exists()


@pytest.mark.nvcc
@needs_nvcc
def test_killed_build_is_cleaned_by_the_next_build(tmp_path):
    # a build killed while nvcc runs: its scratch dir stays behind
    killed = subprocess.run([sys.executable, "-c", (
        "import os, sys, signal\n"
        "from pathlib import Path\n"
        "from wsched.codegen import build_cache\n"
        "with build_cache.build_dir(Path(sys.argv[1])) as tmp:\n"
        "    (tmp / 'kernel.cu').write_text('// half done')\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"), str(tmp_path)])
    assert killed.returncode == -signal.SIGKILL
    leftovers = [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]
    assert len(leftovers) == 1
    compile_cuda(small_source(), name="scale", cache_dir=tmp_path)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith((".tmp-", ".trash-"))]


@pytest.mark.nvcc
@needs_nvcc
@pytest.mark.parametrize("cache_mode, dir_mode, file_mode", [(0o750, 0o750, 0o640), (0o700, 0o700, 0o600),
                                                             (0o755, 0o755, 0o644)])
def test_entries_are_readable_by_whoever_reads_the_cache(tmp_path, cache_mode, dir_mode, file_mode):
    root = tmp_path / "cache"
    root.mkdir()
    root.chmod(cache_mode)
    src = small_source()
    result = compile_cuda(src, name="scale", cache_dir=root, artifacts={"loop_ir.txt": "x"})
    compile_cuda(src, name="scale", cache_dir=root, artifacts={"later.txt": "y"})  # added on a hit
    modes = {}
    for parent, dirs, files in os.walk(result.entry_dir):
        for name in dirs + files:
            path = Path(parent) / name
            modes[path.relative_to(result.entry_dir)] = stat.S_IMODE(path.stat().st_mode)
    assert stat.S_IMODE(result.entry_dir.stat().st_mode) == dir_mode
    assert modes[Path("artifacts")] == dir_mode
    assert {p: m for p, m in modes.items() if p != Path("artifacts")} == {
        p: file_mode for p in modes if p != Path("artifacts")}
    assert {Path("artifacts/loop_ir.txt"), Path("artifacts/later.txt"), Path("kernel.cubin")} <= set(modes)



@contextlib.contextmanager
def warnings_as_errors():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield
