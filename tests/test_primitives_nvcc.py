"""Compile-only checks of the device primitive headers and the generated wgmma wrappers.

One kernel that calls every primitive is compiled for sm_90a (cubin, ptxas -v) and once more
to PTX, which is grepped for the instructions.  Needs nvcc, not a GPU.
"""

from __future__ import annotations

import re
import shutil

import pytest

from wsched.codegen.build import BuildError, compile_cuda, compile_ptx
from wsched.codegen.nvcc import NVCC_FLAGS, PTX_FLAGS
from wsched.codegen.wgmma import wgmma_function

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")

WGMMA_SHAPES = [
    (n, dt, a_from, trans_b)
    for n in (64, 128, 256)
    for dt in ("bf16", "f16")
    for a_from in ("smem", "regs")
    for trans_b in (False, True)
    # keep the kernel (and ptxas time) small: transposed-B only for n=64 and n=256 ss bf16
    if not trans_b or (a_from == "smem" and dt == "bf16" and n in (64, 256))
]


def _wgmma_cases() -> tuple[str, str]:
    """(function definitions, switch cases) calling every wrapper in WGMMA_SHAPES."""
    defs, cases = [], []
    for idx, (n, dt, a_from, trans_b) in enumerate(WGMMA_SHAPES):
        fname, text = wgmma_function(n, dt, a_from, trans_b)
        defs.append(text)
        pack = "wsp::pack_bf16x2" if dt == "bf16" else "wsp::pack_f16x2"
        if a_from == "smem":
            call = f"{fname}(acc, da, db, it > 0);"
        else:
            call = (f"{fname}(acc, {pack}(x, 1.f), {pack}(x, 2.f), {pack}(x, 3.f), "
                    f"{pack}(x, 4.f), db, it > 0);")
        cases.append(f"""\
      case {idx}: {{
        float acc[{n // 2}];
#pragma unroll
        for (int i = 0; i < {n // 2}; ++i) acc[i] = 0.f;
        for (int it = 0; it < iters; ++it) {{
          wsp::mbar_wait(full, it & 1);
          wsp::warpgroup_fence_array(acc);
          wsp::wgmma_fence();
          {call}
          wsp::wgmma_commit();
          wsp::wgmma_wait<0>();
          wsp::warpgroup_fence_array(acc);
          wsp::mbar_arrive(empty);
        }}
#pragma unroll
        for (int i = 0; i < {n // 2}; i += 8)
          wsp::stmatrix_x4(stage + (threadIdx.x % 128) * 16 + i,
                           {pack}(acc[i], acc[i + 1]), {pack}(acc[i + 2], acc[i + 3]),
                           {pack}(acc[i + 4], acc[i + 5]), {pack}(acc[i + 6], acc[i + 7]));
        break;
      }}""")
    return "\n".join(defs), "\n".join(cases)


def primitives_source() -> str:
    defs, cases = _wgmma_cases()
    return f"""\
#include "wsched.cuh"

{defs}

extern "C" __global__ void __launch_bounds__(384, 1)
all_primitives(const __grid_constant__ CUtensorMap m1, const __grid_constant__ CUtensorMap m2,
               const __grid_constant__ CUtensorMap m3, const __grid_constant__ CUtensorMap m4,
               const __grid_constant__ CUtensorMap m5, int variant, int iters, float x) {{
  extern __shared__ __align__(1024) unsigned char smem[];
  uint64_t* full = reinterpret_cast<uint64_t*>(smem);
  uint64_t* empty = full + 1;
  unsigned char* tile_a = smem + 1024;           // 1024 B aligned for 128B swizzle
  unsigned char* tile_b = smem + 1024 + 8192;
  uint16_t* stage = reinterpret_cast<uint16_t*>(smem + 1024 + 8192 + 32768);

  if (threadIdx.x == 0) {{
    wsp::mbar_init(full, 1);
    wsp::mbar_init(empty, 256);
    wsp::fence_mbarrier_init();
  }}
  __syncthreads();

  const uint32_t wg = wsp::warpgroup_id();
  if (wg == 0) {{
    // producer warpgroup
    wsp::setmaxnreg_dec<40>();
    if (wsp::warp_id_in_warpgroup() == 0 && wsp::elect_one()) {{
      wsp::prefetch_tensormap(&m1);
      for (int it = 0; it < iters; ++it) {{
        wsp::mbar_wait(empty, (it & 1) ^ 1);
        wsp::mbar_arrive_expect_tx(full, 5 * 1024);
        wsp::tma_load_1d(tile_a, &m1, full, it);
        wsp::tma_load_2d(tile_a + 1024, &m2, full, 0, it);
        wsp::tma_load_3d(tile_a + 2048, &m3, full, 0, it, 1);
        wsp::tma_load_4d(tile_a + 3072, &m4, full, 0, it, 1, 2);
        wsp::tma_load_5d(tile_b, &m5, full, 0, it, 1, 2, 3);
      }}
    }}
  }} else {{
    // two consumer warpgroups
    wsp::setmaxnreg_inc<232>();
    const uint64_t da = wsp::make_smem_desc(tile_a, 128, 16, 1024);
    const uint64_t db = wsp::smem_desc_add(wsp::make_smem_desc(tile_b, 128, 16, 1024), 32);
    switch (variant) {{
{cases}
      default:
        break;
    }}
    wsp::fence_proxy_async();
    wsp::named_barrier_sync(1, 256);
    if (wg == 1) {{
      wsp::named_barrier_arrive(2, 256);
    }} else {{
      wsp::named_barrier_sync(2, 256);
    }}
    if (wg == 1 && wsp::warp_id_in_warpgroup() == 0 && wsp::elect_one()) {{
      wsp::tma_store_1d(&m1, stage, 0);
      wsp::tma_store_2d(&m2, stage, 0, 1);
      wsp::tma_store_3d(&m3, stage, 0, 1, 2);
      wsp::tma_store_4d(&m4, stage, 0, 1, 2, 3);
      wsp::tma_store_5d(&m5, stage, 0, 1, 2, 3, 4);
      wsp::tma_store_commit();
      wsp::tma_store_wait_read<0>();
      wsp::tma_store_wait<0>();
      wsp::mbar_inval(full);
      wsp::mbar_inval(empty);
    }}
    float y = wsp::tanh_approx(wsp::ex2_approx(x));
    if (y == 12345.f) wsp::stmatrix_x4_trans(stage, 1u, 2u, 3u, 4u);
  }}
}}
"""


EXPECTED_PTX = [
    "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16",
    "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16",
    "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16",
    "wgmma.fence.sync.aligned",
    "wgmma.commit_group.sync.aligned",
    "wgmma.wait_group.sync.aligned",
    "setmaxnreg.inc.sync.aligned.u32",
    "setmaxnreg.dec.sync.aligned.u32",
    "cp.async.bulk.tensor.1d.shared::cluster.global.mbarrier::complete_tx::bytes",
    "cp.async.bulk.tensor.5d.shared::cluster.global.mbarrier::complete_tx::bytes",
    "cp.async.bulk.tensor.3d.global.shared::cta.bulk_group",
    "cp.async.bulk.commit_group",
    "cp.async.bulk.wait_group.read",
    "mbarrier.init.shared::cta.b64",
    "mbarrier.arrive.shared::cta.b64",
    "mbarrier.arrive.expect_tx.shared::cta.b64",
    "mbarrier.try_wait.parity.shared::cta.b64",
    "mbarrier.inval.shared::cta.b64",
    "fence.mbarrier_init.release.cluster",
    "fence.proxy.async.shared::cta",
    "prefetch.tensormap",
    "elect.sync",
    "bar.sync",
    "bar.arrive",
    "stmatrix.sync.aligned.m8n8.x4.shared.b16",
    "stmatrix.sync.aligned.m8n8.x4.trans.shared.b16",
    "cvt.rn.bf16x2.f32",
    "cvt.rn.f16x2.f32",
    "ex2.approx.ftz.f32",
    "tanh.approx.f32",
]


CLUSTER_SOURCE = """\
#include "wsched.cuh"

extern "C" __global__ void __launch_bounds__(128, 1) __cluster_dims__(2, 1, 1)
cluster_primitives(const __grid_constant__ CUtensorMap m1, const __grid_constant__ CUtensorMap m2,
                   const __grid_constant__ CUtensorMap m3, const __grid_constant__ CUtensorMap m4,
                   const __grid_constant__ CUtensorMap m5) {
  extern __shared__ __align__(1024) unsigned char smem[];
  uint64_t* full = reinterpret_cast<uint64_t*>(smem);
  unsigned char* tile = smem + 1024;
  if (threadIdx.x == 0) {
    wsp::mbar_init(full, 1);
    wsp::fence_mbarrier_init();
  }
  wsp::cluster_sync();
  const uint32_t rank = blockIdx.x % 2;
  if (threadIdx.x == 0) {
    wsp::mbar_arrive_expect_tx(full, 5 * 1024);
    wsp::tma_load_1d_multicast(tile, &m1, full, 3, rank);
    wsp::tma_load_2d_multicast(tile + 1024, &m2, full, 3, 0, rank);
    wsp::tma_load_3d_multicast(tile + 2048, &m3, full, 3, 0, rank, 1);
    wsp::tma_load_4d_multicast(tile + 3072, &m4, full, 3, 0, rank, 1, 2);
    wsp::tma_load_5d_multicast(tile + 4096, &m5, full, 1u << rank, 0, rank, 1, 2, 3);
  }
  wsp::mbar_wait(full, 0);
  if (threadIdx.x == 0) wsp::mbar_arrive_cluster(full, rank ^ 1);
  wsp::cluster_sync();
}
"""

CLUSTER_PTX = [
    "cp.async.bulk.tensor.1d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster",
    "cp.async.bulk.tensor.5d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster",
    "mapa.shared::cluster.u32",
    "mbarrier.arrive.shared::cluster.b64",
    "barrier.cluster.arrive.release.aligned",
    "barrier.cluster.wait.acquire.aligned",
    ".reqnctapercluster 2, 1, 1",
]


@pytest.mark.nvcc
@needs_nvcc
def test_cluster_primitives_compile_for_sm90a(tmp_path):
    """Multicast TMA loads of every rank, the remote arrival and the cluster barrier assemble, and
    the kernel carries its cluster shape."""
    res = compile_cuda(CLUSTER_SOURCE, name="cluster_primitives", cache_dir=tmp_path)
    assert res.cubin_path.stat().st_size > 0
    ptx = compile_ptx(CLUSTER_SOURCE, name="cluster_primitives_ptx", cache_dir=tmp_path)
    missing = [ins for ins in CLUSTER_PTX if ins not in ptx]
    assert not missing, f"instructions missing from the PTX: {missing}"


@pytest.mark.nvcc
@needs_nvcc
def test_all_primitives_compile_for_sm90a(tmp_path):
    src = primitives_source()
    res = compile_cuda(src, name="all_primitives", cache_dir=tmp_path)  # raises on C7508/spills
    assert res.cubin_path.stat().st_size > 0
    assert "C7508" not in res.log
    r = res.resources["all_primitives"]
    assert r.spill_stores == 0 and r.spill_loads == 0 and r.stack_bytes == 0
    assert r.barriers >= 3  # barrier 0 (__syncthreads) + named barriers 1 and 2
    # the PTX has every instruction (the cubin assembled, so ptxas accepted the spellings)
    ptx = compile_ptx(src, name="all_primitives_ptx", cache_dir=tmp_path)
    missing = [ins for ins in EXPECTED_PTX if ins not in ptx]
    assert not missing, f"instructions missing from the PTX: {missing}"
    for n, dt, a_from, trans_b in WGMMA_SHAPES:
        op = f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{dt}.{dt}"
        assert op in ptx
    # tnspB = 1 is present for the _tb variants (last immediate of the wgmma operand list)
    assert re.search(r"p, 1, 1, 0, 1;", ptx)


@pytest.mark.nvcc
@needs_nvcc
def test_setmaxnreg_without_launch_bounds_is_c7508_error(tmp_path):
    # setmaxnreg with no register cap at entry: ptxas ignores it and says C7508 -> BuildError.
    src = """\
#include "wsched.cuh"
extern "C" __global__ void no_bounds(float* out) {
  if (wsp::warpgroup_id() == 0) { wsp::setmaxnreg_dec<40>(); }
  else { wsp::setmaxnreg_inc<232>(); out[threadIdx.x] = 1.f; }
}
"""
    with pytest.raises(BuildError) as ei:
        compile_cuda(src, name="no_bounds", cache_dir=tmp_path)
    msg = str(ei.value)
    assert "C7508" in msg and "kernel.cu" in msg and "nvcc" in msg


def test_wgmma_rejects_bad_n():
    with pytest.raises(ValueError, match=r"multiple of 8 in \[8, 256\]"):
        wgmma_function(12, "bf16", "smem", False)
    for bad in (0, 264, 7):
        with pytest.raises(ValueError):
            wgmma_function(bad, "bf16", "smem", False)
    with pytest.raises(ValueError, match="ab_dtype"):
        wgmma_function(64, "fp8", "smem", False)
    with pytest.raises(ValueError, match="a_from"):
        wgmma_function(64, "bf16", "tmem", False)


def test_wgmma_function_text():
    name, text = wgmma_function(256, "bf16", "smem", False)
    assert name == "wgmma_m64n256k16_bf16_ss"
    assert "float (&d)[128]" in text and "uint64_t desc_a" in text
    assert text.count('"+f"(d[') == 128
    assert "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16" in text
    assert "setp.ne.b32 p, %130, 0;" in text  # 128 acc + desc_a + desc_b, then scale_d
    assert "%128, %129, p, 1, 1, 0, 0;" in text

    name, text = wgmma_function(64, "f16", "regs", True)
    assert name == "wgmma_m64n64k16_f16_rs_tb"
    assert "uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3" in text
    assert "{%32, %33, %34, %35}, %36, p, 1, 1, 1;" in text  # rs: no tnspA immediate
    assert '"r"(scale_d)' in text

    name, _ = wgmma_function(128, "bf16", "smem", True)
    assert name == "wgmma_m64n128k16_bf16_ss_tb"
    assert PTX_FLAGS != NVCC_FLAGS and "-ptx" in PTX_FLAGS


@pytest.mark.nvcc
@needs_nvcc
def test_the_spans_table_kernel_builds_without_spills(tmp_path):
    """codegen/block_spans.py's helper (a spans param's table on the GPU) builds for sm_90a, for
    the block size its launch uses (the CUDA's warp count is THREADS / 32)."""
    from wsched.codegen.block_spans import KERNEL, SOURCE, THREADS
    from wsched.codegen.build import compile_cuda

    result = compile_cuda(SOURCE, name=KERNEL)
    r = result.resources[KERNEL]
    assert r.spill_stores == 0 and r.spill_loads == 0
    assert f"#define WARPS {THREADS // 32}" in SOURCE
    ptx = compile_ptx(SOURCE, name="block_spans_ptx", cache_dir=tmp_path)
    assert f".maxntid {THREADS}, 1, 1" in ptx

