"""CUDA emission from the final loop IR (codegen/emit.py): the shape of the generated file,
golden text, the CUDA spelling of the IR's rules, errors, and (nvcc) spill-free sm_90a builds."""

from __future__ import annotations

import dataclasses
import re

import pytest

import wsched as ws
from wsched import target
from wsched.codegen import build, emit_tiles
from wsched.codegen.emit import EMITTERS, EmitError, EmittedKernel, emit_kernel
from wsched.codegen.nvcc import INCLUDE_DIR
from wsched.lowering import ir
from wsched.lowering.pipeline import lower_partition
from wsched.workloads import partition
from wsched.workloads.matmul.schedule import default_schedule

from attention_fusions import make_attention, make_biased

C, V = ir.IntConst, ir.Var


# --- fusions ------------------------------------------------------------------------------------


@ws.fusion
def matmul(a: ws.Tensor[ws.bf16, "M", "K"], b: ws.Tensor[ws.bf16, "K", "N"]):
    return ws.matmul(a, b).to(ws.bf16)


@ws.fusion
def bias_gelu(a: ws.Tensor[ws.bf16, "M", "K"], b: ws.Tensor[ws.bf16, "K", "N"],
              bias: ws.Tensor[ws.bf16, "N"]):
    return ws.gelu(ws.matmul(a, b) + bias).to(ws.bf16)


@ws.fusion
def linear_relu_residual(a: ws.Tensor[ws.bf16, "M", "K"], w: ws.Tensor[ws.bf16, "N", "K"],
                         bias: ws.Tensor[ws.bf16, "N"], r: ws.Tensor[ws.bf16, "M", "N"]):
    return (ws.relu(ws.matmul(a, w.transpose(-1, -2)) + bias) + r).to(ws.bf16)


def lower(fusion, **schedule) -> ir.Kernel:
    return lower_partition(partition(fusion, default_schedule(**schedule)))


def emit(fusion, **schedule) -> EmittedKernel:
    return emit_kernel(lower(fusion, **schedule))


@pytest.fixture(scope="module")
def default_kernel() -> ir.Kernel:
    return lower(matmul)


@pytest.fixture(scope="module")
def default_source(default_kernel) -> str:
    return emit_kernel(default_kernel).source


# --- the generated file -------------------------------------------------------------------------


def test_default_matmul_golden(golden, default_source):
    golden.check("matmul_default.cu", default_source)


def test_emitted_kernel_facts_come_from_the_ir(default_kernel):
    e = emit_kernel(default_kernel)
    assert (e.name, e.threads, e.smem_bytes) == ("matmul", 384, default_kernel.smem_bytes)
    assert e.params == default_kernel.params
    assert dataclasses.is_dataclass(e) and e.__dataclass_params__.frozen


def test_signature_spells_every_param_in_ir_order(default_source):
    start = default_source.index('extern "C"')
    head = default_source[start:default_source.index(") {", start)]
    assert head.startswith('extern "C" __global__ void __launch_bounds__(384, 1) matmul(')
    assert re.findall(r"\n    ([^\n,]+)", head) == [
        "int M", "int N", "int K",
        "const __grid_constant__ CUtensorMap a",
        "const __grid_constant__ CUtensorMap b",
        "const __grid_constant__ CUtensorMap out",
    ]
    linear = emit(linear_relu_residual, epilogue="direct").source
    assert "__nv_bfloat16* __restrict__ bias" in linear
    assert "__nv_bfloat16* __restrict__ r" in linear


def test_reads_like_a_warp_specialized_kernel(default_kernel, default_source):
    src = default_source
    producer, consumer = default_kernel.roles()
    assert src.startswith("// matmul: warp-specialized kernel")
    assert '#include "wsched.cuh"' in src and "#include <cuda_bf16.h>" in src
    order = ["// setup", "__syncthreads();",
             "const int wg_index = __shfl_sync(0xffffffff, threadIdx.x / 128, 0);",
             "if (wg_index < 1) {", f"// role producer: warpgroup 0, {producer.registers} registers",
             f"wsp::setmaxnreg_dec<{producer.registers}>();", "} else if (wg_index < 3) {",
             f"// role consumer: warpgroups 1-2, {consumer.registers} registers",
             "const int wg = wg_index - 1;", f"wsp::setmaxnreg_inc<{consumer.registers}>();"]
    positions = [src.index(s) for s in order]
    assert positions == sorted(positions)
    # mbarrier init and its fence by thread 0 only, before the CTA barrier
    assert re.search(r"if \(threadIdx.x == 0\) \{\n\s+for \(int i = 0; i < 4; \+\+i\) "
                     r"wsp::mbar_init\(&full_bar\[i\], 1\);\n.*\n\s+wsp::fence_mbarrier_init\(\);", src)
    # one arrival per warpgroup, a wait by every thread
    assert "if (threadIdx.x % 128 == 0) {\n            wsp::mbar_arrive(&empty_bar[prev_s]);" in src
    assert "\n        wsp::mbar_wait(&full_bar[s], ph);" in src
    assert "if (wsp::warp_id_in_warpgroup() == 0 && wsp::elect_one()) {" in src
    # the accumulator is declared at the top of the consumer branch
    assert re.search(r"wsp::setmaxnreg_inc<\d+>\(\);\n\s+float acc\[128\];", src)


def test_smem_carve_up_matches_kernel_smem_bytes(default_kernel, default_source):
    offsets, end = {}, 0
    for buf in default_kernel.smem:
        end = -(-end // 1024) * 1024
        offsets[f"smem_{buf.name}"] = end
        end += buf.nbytes
    end = -(-end // 8) * 8
    for b in default_kernel.barriers:
        offsets[f"{b.name}_bar"] = end
        end += 8 * b.slots
    for name, off in offsets.items():
        assert re.search(rf"\b{name} = .*smem \+ {off}\b", default_source), name
    assert end + 1023 <= default_kernel.smem_bytes  # runtime 1024-alignment of the base fits
    assert "& ~uintptr_t(1023)" in default_source


def test_changing_stages_changes_the_source():
    four = emit(matmul).source
    three = emit(matmul, stages=3).source
    assert "const int s = it % 4;" in four and "% 3" not in four.split("// setup")[1]
    assert "const int s = it % 3;" in three and "% 4" not in three.split("// setup")[1]
    assert "i < 3; ++i) wsp::mbar_init(&full_bar[i], 1);" in three


def test_tma_coordinates_are_innermost_first(default_source):
    # IR: tma.load A[s] <- a[m0, k * 64]; tma.store out[m0 + wg * 64, n0 + j * 64] <- C_bf16[wg, j % 2]
    assert "wsp::tma_load_2d(smem_A + s * 16384, &a, &full_bar[s], k * 64, m0);" in default_source
    assert ("wsp::tma_store_2d(&out, smem_C_bf16 + wg * 16384 + j % 2 * 8192, n0 + j * 64, m0 + wg * 64);"
            in default_source)
    assert "wsp::tma_store_commit();" in default_source
    assert "wsp::tma_store_wait_read<1>();" in default_source


def test_wgmma_descriptors_for_n_major_and_k_major_b(default_source):
    # B [K, N] row-major: N-major chunks (N/64, K, 64); LBO = next 64-column chunk, SBO = 8 rows
    assert "make_smem_desc(smem_A + s * 16384 + wg * 8192, 128, 16, 1024)" in default_source
    assert "make_smem_desc(smem_B + s * 32768, 128, 8192, 1024)" in default_source
    assert ("wgmma_m64n256k16_bf16_ss_tb(acc, wsp::smem_desc_add(desc_a, 32), "
            "wsp::smem_desc_add(desc_b, 2048), 1);") in default_source
    assert "wgmma_m64n256k16_bf16_ss_tb(acc, desc_a, desc_b, k > 0);" in default_source
    assert default_source.count("__device__ __forceinline__ void wgmma_m64n256k16") == 1
    # B = w.T with w [N, K]: K-major [N, K] rows, advanced 32 bytes per k16 step like A
    src = emit(linear_relu_residual).source
    assert "make_smem_desc(smem_B + s * 32768, 128, 16, 1024)" in src
    assert "wgmma_m64n256k16_bf16_ss(acc, wsp::smem_desc_add(desc_a, 32), " \
           "wsp::smem_desc_add(desc_b, 32), 1);" in src
    # accumulator fences around wgmma, as CUTLASS does
    assert re.search(r"warpgroup_fence_array\(acc\);\n\s+wsp::wgmma_fence\(\);", default_source)
    assert re.search(r"wgmma_wait<1>\(\);\n\s+wsp::warpgroup_fence_array\(acc\);", default_source)


def test_fused_epilogues_are_spelled_from_their_tile_ops():
    gelu = emit(bias_gelu).source
    # consecutive elementwise ops share one fragment loop, in IR order
    assert "// tile.cast slice_t, acc_j\n" in gelu
    assert "// tile.add slice_t, slice_t, bias_t; tile.gelu slice_t, slice_t\n" in gelu
    # a 64-column slice of the accumulator (tile.view) is the same array from element j * 64 / 2
    assert ("slice_t[4 * fj + 2 * fi + 0] = acc[(j * 64) / 2 + 4 * fj + 2 * fi + 0];\n"
            "            slice_t[4 * fj + 2 * fi + 1] = acc[(j * 64) / 2 + 4 * fj + 2 * fi + 1];\n") in gelu
    assert ("slice_t[4 * fj + 2 * fi + 0] = slice_t[4 * fj + 2 * fi + 0] + __bfloat162float(bias_t[fj].x);\n"
            "            slice_t[4 * fj + 2 * fi + 1] = slice_t[4 * fj + 2 * fi + 1] + __bfloat162float(bias_t[fj].y);\n"
            "            slice_t[4 * fj + 2 * fi + 0] = wsp::gelu(slice_t[4 * fj + 2 * fi + 0]);") in gelu
    assert "erff(x * 0.7071067811865476f)" in (INCLUDE_DIR / "activation.cuh").read_text()
    # a bf16 row tile: one 32-bit load per pair when the row is aligned, else two 16-bit ones
    assert "bias_t[fj] = wsp::load_pair(ptr + 8 * fj, row_ok && col0 + 8 * fj < N);" in gelu
    assert "bias_t[fj] = wsp::load_split(ptr + 8 * fj, row_ok && col0 + 8 * fj < N, " in gelu
    direct = emit(linear_relu_residual, epilogue="direct").source
    assert "slice_t[4 * fj + 2 * fi + 0] = fmaxf(slice_t[4 * fj + 2 * fi + 0], 0.0f);" in direct
    assert "const bool row_ok = row < M;" in direct
    # stores round f32 to the tensor's dtype: the pair is packed at the store, and a quad's pairs
    # of 4 column groups are transposed into 16 bytes a lane (one 16-byte store per 8 columns
    # where the row is aligned, else element by element, each bounds-checked)
    assert ("chunk[J] = wsp::quad_transpose(wsp::bit_cast<uint32_t>(__floats2bfloat162_rn("
            "slice_t[4 * (4 * J + 0) + 2 * fi + 0], slice_t[4 * (4 * J + 0) + 2 * fi + 1])), ") in direct
    assert "if (wsp::rows16_aligned(ptr, N) && col0 % 8 == 0) {" in direct
    assert "wsp::store_eight(ptr + 32 * J, row_ok && col0 + 32 * J + 8 <= N, chunk[J]);" in direct
    assert "wsp::store_eight_split(ptr + 32 * J, row_ok, col0 + 32 * J, N, chunk[J]);" in direct
    assert "tma_store" not in direct.split('extern "C"')[1]


# --- the CUDA spelling of expressions and rules --------------------------------------------------


def tiny_kernel(*consumer: ir.Stmt, kernel_level: tuple[ir.Stmt, ...] = (),
                params: tuple[ir.Param, ...] = (ir.ScalarParam("M", "i32"),),
                smem: tuple[ir.SmemDecl, ...] = (), barriers: tuple[ir.BarrierDecl, ...] = ()):
    return ir.Kernel("tiny", params, C(1), (1, 1, 1), smem, barriers,
                     kernel_level + (ir.Role("consumer", 1, 232, consumer),))


def test_expressions_use_cpp_precedence_and_types():
    k = tiny_kernel(
        ir.Let("x", ir.BinOp("==", ir.BinOp("&", V("M"), C(1)), C(0))),   # IR: M & 1 == 0
        ir.Let("y", ir.BinOp("-", V("M"), ir.BinOp("-", C(5), C(-1)))),
        ir.Let("z", ir.Call("select", (V("x"), ir.FloatConst(1.5), ir.FloatConst(float("inf"))))),
        ir.Let("u", ir.Call("ceil_div", (V("M"), C(64))), mutable=True),
        ir.Assign("u", ir.Call("min", (V("u"), V("y")))),
        ir.Let("f", ir.Call("max", (V("z"), ir.FloatConst(0.0)))),
    )
    src = emit_kernel(k).source
    assert "const int x = (M & 1) == 0;" in src
    assert "const int y = M - (5 - (-1));" in src
    assert "const float z = x ? 1.5f : INFINITY;" in src
    assert "int u = wsp::ceil_div(M, 64);" in src and "u = min(u, y);" in src
    assert "const float f = fmaxf(z, 0.0f);" in src
    assert_helpers_come_from_the_headers(src)


def test_tma_load_outside_elect_one_is_an_error(default_kernel):
    def unwrap(stmts):
        out = []
        for s in stmts:
            if isinstance(s, ir.ElectOne):
                out.extend(unwrap(s.body))
            elif isinstance(s, (ir.For, ir.Role)):
                out.append(dataclasses.replace(s, body=tuple(unwrap(s.body))))
            else:
                out.append(s)
        return out

    producer_without_elect = tuple(
        dataclasses.replace(s, body=tuple(unwrap(s.body)))
        if isinstance(s, ir.Role) and s.name == "producer" else s
        for s in default_kernel.body)
    broken = dataclasses.replace(default_kernel, body=producer_without_elect)
    with pytest.raises(EmitError, match=r"`tma.load` .*must be inside elect_one"):
        emit_kernel(broken)


def test_warpgroup_collective_ops_are_rejected_inside_elect_one():
    k = tiny_kernel(ir.RegDecl("acc", "f32", (64, 64)),
                    ir.ElectOne((ir.TileFill("acc", ir.FloatConst(0.0)),)))
    with pytest.raises(EmitError, match="warpgroup-collective"):
        emit_kernel(k)


def fragments_kernel(row: ir.Expr, col: ir.Expr, dtype: str = "f32") -> ir.Kernel:
    """A [64, 16] tile stored into and loaded back from a fragments workspace at (row, col)."""
    ws_param = ir.WorkspaceParam("parts", "f32", (V("S"), V("M"), V("N")), fragments=True)
    return tiny_kernel(
        ir.Let("m0", ir.BinOp("*", V("M"), C(128))), ir.Let("n0", ir.BinOp("*", V("M"), C(16))),
        ir.RegDecl("t", dtype, (64, 16)), ir.TileFill("t", ir.FloatConst(1.0)),
        ir.TileStoreGlobal("parts", (C(1), row, col), "t"), ir.TileLoadGlobal("t", "parts", (C(1), row, col)),
        params=(ir.ScalarParam("M", "i32"), ir.ScalarParam("N", "i32"), ir.ScalarParam("S", "i32"), ws_param))


def test_a_fragments_workspace_moves_16_bytes_a_thread_and_strip():
    """Row m0 + 64 (a multiple of 64: a let of a product with 128, plus 64) and column n0 + 8: one
    16-byte access per thread and 8-column group, at the strip's offset, bounds as for rows."""
    src = emit_kernel(fragments_kernel(ir.BinOp("+", V("m0"), C(64)), ir.BinOp("+", V("n0"), C(8)))).source
    strips = "(static_cast<long long>(1) * wsp::ceil_div(M, 64) + (m0 + 64) / 64) * wsp::ceil_div(N, 8) + (n0 + 8) / 8"
    assert f"float* const ptr = parts + ({strips}) * 512 + 4 * (threadIdx.x % 128);" in src
    assert "const bool row_ok = 1 < S && row0 < M;" in src
    # a store zeroes the elements outside the shape that share its 16 bytes; a load takes them as they are
    assert ("wsp::st_b128_if(ptr + 512 * fj, make_uint4(wsp::bit_cast<uint32_t>(t[4 * fj + 2 * 0 + 0]), "
            "col0 + 8 * fj + 1 < N ? wsp::bit_cast<uint32_t>(t[4 * fj + 2 * 0 + 1]) : 0u, "
            "row0 + 8 < M ? wsp::bit_cast<uint32_t>(t[4 * fj + 2 * 1 + 0]) : 0u, "
            "row0 + 8 < M && col0 + 8 * fj + 1 < N ? wsp::bit_cast<uint32_t>(t[4 * fj + 2 * 1 + 1]) : 0u), "
            "row_ok && col0 + 8 * fj < N);") in src
    assert "const uint4 v = wsp::ld_b128_if(ptr + 512 * fj, row_ok && col0 + 8 * fj < N);" in src
    assert "t[4 * fj + 2 * 1 + 1] = wsp::bit_cast<float>(v.w);" in src
    assert_helpers_come_from_the_headers(src)


@pytest.mark.parametrize("row, col, what", [
    (ir.BinOp("+", V("m0"), C(32)), V("n0"), r"its row coordinate \(m0 \+ 32\) must be a multiple of 64 whatever"),
    (V("m0"), ir.BinOp("*", V("M"), C(4)), r"its column coordinate \(M \* 4\) must be a multiple of 8 whatever the call"),
    (V("M"), V("n0"), r"its row coordinate \(M\) must be a multiple of 64"),
])
def test_a_fragments_access_off_whole_strips_is_refused(row, col, what):
    with pytest.raises(EmitError, match=r"a fragments workspace is moved in whole \[64, 8\] strips: " + what):
        emit_kernel(fragments_kernel(row, col))


def test_a_fragments_workspace_takes_tiles_of_its_dtype():
    with pytest.raises(EmitError, match=r"a fragments workspace \(parts: f32\) is moved in whole \[64, N\] register "
                                        r"tiles of its own dtype; t is bf16\[64, 16\]"):
        emit_kernel(fragments_kernel(V("m0"), V("n0"), dtype="bf16"))


def test_an_unknown_node_is_named():
    @dataclasses.dataclass(frozen=True)
    class Prefetch:
        tensor: str

    with pytest.raises(EmitError, match="no CUDA spelling for IR node Prefetch"):
        emit_kernel(tiny_kernel(Prefetch("a")))
    assert set(ir.STMT_TYPES) == set(EMITTERS)  # one emit function per node kind


def test_every_tile_op_of_the_target_has_a_cuda_spelling():
    assert tuple(emit_tiles._UNARY) == target.TILE_UNARY_OPS
    assert tuple(emit_tiles._BINARY) == target.BINARY_OPS


def test_ir_names_that_would_clash_in_cpp_get_a_trailing_underscore():
    k = tiny_kernel(ir.Let("row0", C(1)), ir.Let("int", V("row0")), ir.Let("min", ir.Call("min", (V("int"), V("v")))),
                    params=(ir.ScalarParam("v", "i32"),))
    src = emit_kernel(k).source
    assert "    int v_)" in src
    assert "const int row0_ = 1;" in src and "const int int_ = row0_;" in src
    assert "const int min_ = min(int_, v_);" in src


# --- a kitchen-sink consumer: reductions, register-A wgmma, column tiles, f32 smem stores --------

SOFTMAX_PV = tiny_kernel(
    ir.Setmaxnreg("inc", 232),
    ir.RegDecl("s", "f32", (64, 64)), ir.RegDecl("p", "bf16", (64, 64)),
    ir.RegDecl("m", "f32", (64, 1)), ir.RegDecl("l", "f32", (64, 1)),
    ir.RegDecl("o", "f32", (64, 64)), ir.RegDecl("bias", "f16", (1, 64)),
    ir.RegDecl("lse", "bf16", (64, 1)),
    ir.MbarrierWait(ir.BarRef("full", C(0)), C(0)),
    ir.WgmmaFence(),
    ir.Wgmma("s", ir.SmemRef("Q", (C(0),)), ir.SmemRef("K", (C(0),)), "k", "k", C(0)),
    ir.WgmmaCommit(), ir.WgmmaWait(0),
    ir.TileLoadGlobal("bias", "bvec", (C(0),)),
    ir.TileBinary("mul", "s", "s", ir.FloatConst(0.125)),
    ir.TileBinary("add", "s", "s", "bias"),
    ir.TileReduce("max", "m", "s", 1),
    ir.TileBinary("sub", "s", "s", "m"),
    ir.TileUnary("exp2", "s", "s"),
    ir.TileReduce("sum", "l", "s", 1),
    ir.TileUnary("cast", "p", "s"),
    ir.WgmmaFence(),
    ir.Wgmma("o", "p", ir.SmemRef("Vt", (C(0),)), "k", "n", C(0)),
    ir.WgmmaCommit(), ir.WgmmaWait(0),
    ir.TileBinary("div", "o", "o", "l"),
    ir.TileUnary("log", "l", "l"),
    ir.TileBinary("add", "l", "l", "m"),
    ir.TileUnary("cast", "lse", "l"),
    ir.TileStoreGlobal("lse_out", (C(0), C(0)), "lse"),
    ir.TileStoreSmem(ir.SmemRef("O", (C(0),)), "o"),
    ir.FenceProxyAsync(),
    kernel_level=(ir.MbarrierInit("full", 1), ir.FenceMbarrierInit(), ir.SyncThreads()),
    params=(ir.ScalarParam("M", "i32"), ir.GlobalParam("bvec", "f16", (C(64),)),
            ir.GlobalParam("lse_out", "bf16", (V("M"), C(1)))),
    smem=(ir.SmemDecl("Q", "bf16", (1, 64, 64), 128), ir.SmemDecl("K", "bf16", (1, 64, 64), 128),
          ir.SmemDecl("Vt", "bf16", (1, 1, 64, 64), 128), ir.SmemDecl("O", "f32", (1, 2, 64, 32), 128)),
    barriers=(ir.BarrierDecl("full", 1),),
)


def test_row_reductions_and_register_a_operand():
    src = emit_kernel(SOFTMAX_PV).source
    # per-thread max over its columns, then over the 4 lanes of the quad that share the row
    assert re.search(r"float fr = -INFINITY;\n(.*\n){2}\s+fr = fmaxf\(fr, s\[4 \* fj \+ 2 \* fi \+ 0\]\);", src)
    assert "fr = fmaxf(fr, __shfl_xor_sync(0xffffffff, fr, 1));" in src
    assert "fr = fr + __shfl_xor_sync(0xffffffff, fr, 2);" in src
    # P (bf16 accumulator layout) is the A fragment: pairs 4 ks .. 4 ks + 3 per k16 step
    assert ("wgmma_m64n64k16_bf16_rs_tb(o, wsp::bit_cast<uint32_t>(p[4]), wsp::bit_cast<uint32_t>(p[5]), "
            "wsp::bit_cast<uint32_t>(p[6]), wsp::bit_cast<uint32_t>(p[7]), "
            "wsp::smem_desc_add(desc_b, 2048), 1);") in src
    assert "wsp::fence_packed(p);" in src
    # f32 tile into a (2, 64, 32) 128B-swizzled buffer: 64-bit stores, chunk every 4 fj
    assert "wsp::swizzle128(row_addr + 1024 * fi + 8192 * (fj / 4) + 32 * (fj % 4))" in src
    assert "if (threadIdx.x % 4 == 0) {  // tile.store lse_out[0, 0] <- lse" in src


def assert_helpers_come_from_the_headers(src: str) -> None:
    """The .cu defines no device helpers of its own (only the per-shape wgmma wrappers), and
    every wsp:: function it calls is declared in a codegen/include header that wsched.cuh pulls in."""
    headers = sorted(p.name for p in INCLUDE_DIR.glob("*.cuh") if p.name != "wsched.cuh")
    included = re.findall(r'#include "(\w+\.cuh)"', (INCLUDE_DIR / "wsched.cuh").read_text())
    assert sorted(included) == headers
    text = "\n".join((INCLUDE_DIR / h).read_text() for h in headers)
    declared = set(re.findall(r"WSP_DEVICE\s+(?:[\w:<>]+\s+)*?(\w+)\s*\(", text))
    defined = re.findall(r"__device__ __forceinline__ \w+ (\w+)\(", src)
    assert all(name.startswith("wgmma_m64n") for name in defined), defined
    called = set(re.findall(r"wsp::(\w+)", src))
    assert called and called <= declared, f"not declared in codegen/include: {called - declared}"


def test_device_helpers_come_from_the_headers(default_source):
    for src in (default_source, emit(bias_gelu).source, emit(linear_relu_residual, epilogue="direct").source,
                emit_kernel(SOFTMAX_PV).source):
        assert_helpers_come_from_the_headers(src)


# --- nvcc: sm_90a builds without spills, stack or ignored setmaxnreg ------------------------------

BUILDS = {
    "matmul_default": lambda: emit(matmul),
    "bias_gelu": lambda: emit(bias_gelu),
    "linear_relu_residual_wT": lambda: emit(linear_relu_residual),
    "linear_relu_residual_wT_direct": lambda: emit(linear_relu_residual, epilogue="direct"),
    "matmul_direct_epilogue": lambda: emit(matmul, epilogue="direct"),
    "softmax_pv": lambda: emit_kernel(SOFTMAX_PV),
    "attention_d128_causal_lse": lambda: emit_kernel(ws.lower(make_attention(128, causal=True, lse=True))),
    "attention_d64": lambda: emit_kernel(ws.lower(make_attention(64))),
    "attention_d256_causal": lambda: emit_kernel(ws.lower(make_attention(256, causal=True))),
    "attention_d128_gqa_bottom_right_lse": lambda: emit_kernel(ws.lower(
        make_attention(128, causal="bottom_right", lse=True, gqa=True))),
    "attention_d128_pingpong": lambda: emit_kernel(ws.lower(make_attention(128, causal=True), mode="pingpong")),
    "attention_d64_f16_no_overlap": lambda: emit_kernel(ws.lower(
        make_attention(64, dtype=ws.f16), mma_inflight=0)),
    # the split-KV merge on linear tiles, 8 splits' loads in flight, at 255 and 168 registers
    "attention_d128_decode_split": lambda: emit_kernel(ws.lower(
        make_attention(128, causal="bottom_right", lse=True, gqa=True), tile=(64, 128, 128),
        consumer_warpgroups=1, split_kv=32, pack_gqa=True)),
    "attention_d64_causal_split": lambda: emit_kernel(ws.lower(
        make_attention(64, causal=True, lse=True), split_kv=32)),
}


@pytest.mark.nvcc
@pytest.mark.parametrize("case", sorted(BUILDS))
def test_compiles_for_sm90a_without_spills(case, tmp_path_factory):
    emitted = BUILDS[case]()
    cache = tmp_path_factory.mktemp("emit_cache")
    # raises on C7508 and on spills
    result = build.compile_cuda(emitted.source, name=emitted.name, cache_dir=cache)
    res = result.resources[emitted.name]
    print(f"{case}: {res.registers} registers, {res.spill_stores}/{res.spill_loads} bytes "
          f"spill stores/loads, {res.stack_bytes} bytes stack")
    assert (res.spill_stores, res.spill_loads, res.stack_bytes) == (0, 0, 0)
    assert not [w for w in result.warnings if "C7508" in w]
    assert res.registers <= 65536 // emitted.threads


def test_ir_names_that_clash_with_the_emitters_own_get_new_spellings():
    from wsched.codegen.emit_context import _cpp_names
    from wsched.lowering import ir

    body = (ir.Let("wgmma_x", ir.IntConst(1)), ir.Let("v", ir.IntConst(2)), ir.Let("v_", ir.IntConst(3)),
            ir.Let("__y", ir.IntConst(4)), ir.Let("int", ir.IntConst(5)))
    kernel = ir.Kernel("k", (), ir.IntConst(1), (1, 1, 1), (), (), body)
    names = _cpp_names(kernel)
    assert names == {"wgmma_x": "v_wgmma_x", "v": "v__", "v_": "v_", "__y": "v___y", "int": "int_"}
    assert len(set(names.values())) == len(names)


def test_the_split_merges_loads_are_issued_together_and_o_is_divided_by_row_reciprocals():
    """Split-KV's merge (a few query rows, each split's partials a load from L2 away) is latency
    bound: it runs on linear tiles (docs/ir.md, "Linear tiles"), each of the 128 threads loading 8
    consecutive values of a row, the splits (one pass with a running max) in groups of 8 whose
    loop is unrolled (10 registers a split), the loop of groups not, in one and two consumer
    warpgroups; split-K's [64, 64] partials (rows
    padded to an even length) 2 deep where ptxas has 248 registers a thread, not at all at 168.
    O is divided by one reciprocal a row, not by IEEE divisions, in the merge and where one split
    stores its own O."""
    from wsched.workloads.attention.schedule import MAX_SPLIT_KV

    decode = emit_kernel(ws.lower(make_attention(128, causal="bottom_right", lse=True, gqa=True),
                                  tile=(64, 128, 128), consumer_warpgroups=1, split_kv=MAX_SPLIT_KV,
                                  pack_gqa=True)).source
    merge = decode[decode.index("tile.load merge_mb <- part_m"):decode.index("tile.store o[")]
    assert "const int col0 = 0 + wsp::linear_col(16, 8);" in merge                  # 16 threads a row, 8 values each
    assert "const int row0 = wg * 64 + chunk_ * 8 + wsp::linear_row(16);" in merge
    assert "merge_part[li] = wsp::load_one(ptr + li, row_ok && col0 + li < 128);" in merge
    assert re.findall(r"#pragma unroll( \d+)?\n\s+for \(int (first_split|in_group)\b", decode) == [(" 1", "first_split"), ("", "in_group")]
    assert "merge_mb[0] = merge_mb[0] - (src_split >= splits) * 1e+30f;" in merge      # past the last split
    assert "merge_o[li] = wsp::div_shared(merge_o[li], merge_c[0]);" in merge
    assert "o_acc[4 * fj + 2 * fi + 0] = wsp::div_shared(o_acc[4 * fj + 2 * fi + 0], corr[fi]);" in decode
    for start in ("tile.div merge_o", "tile.div o_acc"):
        assert " / " not in decode[decode.index(start):decode.index("tile.store o[", decode.index(start))]
    lse = decode[decode.index("tile.store lse[b0, b1, m0 + (wg * 64 + chunk_ * 8), 0] <- merge_l"):]
    assert "if (threadIdx.x % 16 == 0) {" in decode[decode.index("tile.store lse[b0, b1, m0 + (wg") - 40:][:60]
    assert "const int row0 = m0 + (wg * 64 + chunk_ * 8) + wsp::linear_row(16);" in lse
    # a bottom-right diagonal bias counts a row from S - T (< 0): the row is an int (wsp::linear_row), so the
    # sum does not wrap around as one with the unsigned threadIdx.x would (the LSE was 4e9 off on the GPU)
    biased = emit_kernel(ws.lower(make_biased(lambda s, i, j, u, p: s + u * (j - i), d=128, align="bottom_right"),
                                  tile=(64, 128, 128), consumer_warpgroups=1, split_kv=MAX_SPLIT_KV)).source
    assert "merge_m[0] = static_cast<float>(S - T + chunk_ * 8 + wsp::linear_row(16)) + (0);" in biased
    store = decode[decode.index("tile.store o[b0, b1, m0 + wg * 64"):]
    assert "wsp::pairs_aligned(ptr, 128)" in store          # a user's tensor: tested per row
    assert "quad_transpose" not in store    # one consumer warpgroup: pair stores (QUAD_STORE_WARPGROUPS)
    assert_helpers_come_from_the_headers(decode)
    two = emit_kernel(ws.lower(make_attention(128, causal=True, lse=True), split_kv=MAX_SPLIT_KV)).source
    assert re.findall(r"#pragma unroll( \d+)?\n\s+for \(int (first_split|in_group)\b", two) == [(" 1", "first_split"), ("", "in_group")]
    for schedule, unroll in ((dict(split_k=4), "1"), (dict(tile=(64, 128, 64), consumer_warpgroups=1, split_k=4), "2")):
        split_k = emit(matmul, **schedule).source
        assert re.findall(r"#pragma unroll (\d+)\n\s+for \(int src_split", split_k) == [unroll]
        merge = split_k[split_k.index("tile.load partials[src_split"):]
        assert "wsp::ld_b128_if(ptr + 512 * fj" in merge[:merge.index("tile.add")]   # fragments: 16 bytes a strip


@ws.fusion
def divided(a: ws.Tensor[ws.bf16, "M", "K"], b: ws.Tensor[ws.bf16, "K", "N"], g: ws.Tensor[ws.bf16, "M", "N"],
            scale: ws.Tensor[ws.bf16, "N"]):
    return (ws.matmul(a, b) / g / scale / 3.0).to(ws.bf16)


def test_a_division_by_a_broadcast_tile_or_a_constant_takes_a_reciprocal_and_one_of_the_same_shape_stays_ieee():
    src = emit(divided, epilogue="direct").source
    assert re.search(r"slice_t\[4 \* fj \+ 2 \* fi \+ 0\] = slice_t\[4 \* fj \+ 2 \* fi \+ 0\] / "
                     r"__bfloat162float\(g_t\[", src)
    assert re.search(r"= wsp::div_shared\(slice_t\[4 \* fj \+ 2 \* fi \+ 0\], __bfloat162float\(scale_t\[fj\]\.x\)\);", src)
    assert re.search(r"= wsp::div_shared\(slice_t\[4 \* fj \+ 2 \* fi \+ 0\], 3\.0f\);", src)
