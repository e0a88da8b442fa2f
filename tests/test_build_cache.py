"""nvcc driver, on-disk cache and ptxas report: keys, hits, corruption, concurrency, errors,
log parsing."""

from __future__ import annotations

import json
import multiprocessing
import shutil
import uuid
from pathlib import Path

import pytest

from wsched.codegen import build, nvcc
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
