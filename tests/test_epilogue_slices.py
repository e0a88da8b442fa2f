"""The matmul epilogue walks the accumulator in 64-column slices (`tile.view`), so the tiles it
loads beside it are one slice wide and a fused epilogue with [M, N] inputs (a gate, a residual)
or an f32 output builds without spills at the default schedule.

`tile.view` in every layer (text, verifier, simulator, emitter), then the fusions that spilled
before: nvcc builds them without spills, and the simulator matches torch at M = 1, 33 and a shape
of more tiles than SMs, outputs NaN-poisoned.
"""

from __future__ import annotations

import pytest
import torch

import wsched as ws
from fusions import gated, inputs_for, linear_relu_residual, mlp, scaled_silu_f32
from wsched.codegen import build
from wsched.codegen.emit import emit_kernel
from wsched.lowering import ir
from wsched.lowering.parser import parse_kernel
from wsched.lowering.printer import print_kernel
from wsched.lowering.simulate import ProtocolError, RaceError, simulate
from wsched.lowering.verify import verify_all

V, C = ir.Var, ir.IntConst


@ws.fusion
def residual_f16(x: ws.Tensor[ws.f16, "M", "K"], w: ws.Tensor[ws.f16, "N", "K"], res: ws.Tensor[ws.f16, "M", "N"]):
    return (ws.matmul(x, w.transpose(0, 1)) + res).to(ws.f16)


@ws.fusion
def gated_f32(a: ws.Tensor[ws.bf16, "M", "K"], w: ws.Tensor[ws.bf16, "K", "N"], g: ws.Tensor[ws.bf16, "M", "N"],
              bias: ws.Tensor[ws.bf16, "N"]):
    return ws.silu(ws.matmul(a, w) + bias) * g


FUSIONS = [gated, residual_f16, gated_f32, mlp, linear_relu_residual, scaled_silu_f32]


def rel_error(out, ref) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


# --- the epilogue ------------------------------------------------------------------------------

def test_side_tiles_are_one_slice_wide():
    k = ws.lower(gated)
    regs = {s.name: s.shape for s in ir.walk(k.body) if isinstance(s, ir.RegDecl)}
    assert regs == {"acc": (64, 256), "slice_t": (64, 64), "g_t": (64, 64)}
    text = print_kernel(k)
    assert ("      for j in unroll(0, 4, 1) {\n"
            "        elect_one {\n"
            "          tma.wait.read 1\n"
            "        }\n"
            "        bar.sync 1 + wg, 128\n"
            "        tile.view acc_j, acc, cols(j * 64, 64)\n"
            "        tile.cast slice_t, acc_j\n"
            "        tile.silu slice_t, slice_t\n"
            "        tile.load g_t <- g[m0 + wg * 64, n0 + j * 64]\n"
            "        tile.mul slice_t, slice_t, g_t\n"
            "        tile.store_smem C_bf16[wg, j % 2] <- slice_t\n"
            "        fence.proxy.async\n"
            "        bar.sync 1 + wg, 128\n") in text


def test_an_f32_output_stages_two_chunks_per_slice():
    text = print_kernel(ws.lower(gated_f32))
    assert "smem C_f32: f32[2, 2, 2, 64, 32] swizzle(128)" in text     # two slots of two chunks a warpgroup
    assert "tma.store out[m0 + wg * 64, n0 + j * 64 + 32] <- C_f32[wg, j % 2, 1]" in text


def test_a_64_column_tile_needs_no_view():
    text = print_kernel(ws.lower(gated, tile=(128, 64, 64)))
    assert "tile.view" not in text and "for j in" not in text
    assert "tile.cast slice_t, acc\n" in text and "tile.store_smem C_bf16[wg, 0] <- slice_t" in text


@pytest.mark.parametrize("fusion", FUSIONS, ids=lambda f: f.name)
@pytest.mark.parametrize("M", [1, 33, 300])
def test_epilogues_match_torch(fusion, M):
    """M = 300, N = 520: 3 x 3 tiles (partial ones) on 4 SMs; 5 k steps over the stages."""
    k = ws.compile(fusion, build=False)
    x = inputs_for(fusion, M, 520, 320, seed=M)
    out = k.simulate(*x, num_sms=4)
    assert not torch.isnan(out.float()).any()
    assert rel_error(out, fusion.reference(*x)) < 1e-2


@pytest.mark.parametrize("fusion", FUSIONS, ids=lambda f: f.name)
def test_direct_epilogues_match_torch(fusion):
    k = ws.compile(fusion, epilogue="direct", build=False)
    x = inputs_for(fusion, 33, 264, 128, seed=7)
    assert rel_error(k.simulate(*x, num_sms=2), fusion.reference(*x)) < 1e-2


@pytest.mark.nvcc
@pytest.mark.parametrize("fusion", FUSIONS, ids=lambda f: f.name)
def test_default_schedules_build_without_spills(fusion, tmp_path_factory):
    emitted = emit_kernel(ws.lower(fusion))
    result = build.compile_cuda(emitted.source, name=emitted.name, cache_dir=tmp_path_factory.mktemp("slices"))
    res = result.resources[emitted.name]
    assert (res.spill_stores, res.spill_loads, res.stack_bytes) == (0, 0, 0)
    # wgmma is the only writer of the accumulator: ptxas keeps the k loop's wgmmas in flight
    assert not [w for w in result.warnings if "C7514" in w]


# --- tile.view in every layer ---------------------------------------------------------------

def _view_kernel(*body: ir.Stmt, cols: int = 128) -> ir.Kernel:
    return ir.Kernel("views", (ir.ScalarParam("M", "i32"), ir.GlobalParam("out", "f32", (V("M"), C(cols)))), C(1),
                     (1, 1, 1), (), (), (ir.Role("consumer", 1, 232, (ir.RegDecl("acc", "f32", (64, cols)),) + body),))


def _slices(*inner: ir.Stmt, width: int = 64, loop: str = "unroll", stop: int = 2) -> ir.Stmt:
    return ir.For("j", C(0), C(stop), C(1), loop, (ir.TileView("acc_j", "acc", ir.mul("j", width), width),) + inner)


def test_a_view_reads_and_writes_its_columns():
    k = _view_kernel(
        ir.TileFill("acc", ir.FloatConst(1.0)),
        _slices(ir.TileBinary("mul", "acc_j", "acc_j", ir.add("j", 2))),
        ir.TileStoreGlobal("out", (C(0), C(0)), "acc"))
    assert parse_kernel(print_kernel(k)) == k
    assert "    for j in unroll(0, 2, 1) {\n      tile.view acc_j, acc, cols(j * 64, 64)\n" in print_kernel(k)
    out = torch.full((64, 128), float("nan"))
    simulate(k, {"M": 64, "out": out})
    assert out[:, :64].eq(2.0).all() and out[:, 64:].eq(3.0).all()


def test_a_view_of_a_pending_accumulator_is_a_race():
    """The gated kernel without its last `wgmma.wait 0`: the epilogue's first view reads the
    accumulator a wgmma may still be writing."""
    text = print_kernel(ws.lower(gated)).replace("      wgmma.wait 0\n", "", 1)
    a, w, g = inputs_for(gated, 64, 256, 128, seed=1)
    out = torch.full((64, 256), float("nan"), dtype=torch.bfloat16)
    with pytest.raises(RaceError, match=r"acc read while wgmma pending \(missing wgmma\.wait\): acc in CTA 0 consumer "
                                        r"wg[01]: tile\.cast slice_t, acc_j"):
        simulate(parse_kernel(text), {"M": 64, "N": 256, "K": 128, "a": a, "w": w, "g": g, "out": out})


VERIFY_CASES = {
    "view-from-a-serial-loop": (
        lambda: _view_kernel(_slices(loop="serial")),
        "IR line 5 (role consumer > for j > tile.view acc_j): tile.view acc_j: the first column j * 64 reads `j`, "
        "which is not the variable of an enclosing `unroll` loop; the registers of a view must be known at "
        "compile time (use constants and unroll loop variables)"),
    "view-past-the-tile": (
        lambda: _view_kernel(_slices(stop=3)),
        "IR line 5 (role consumer > for j > tile.view acc_j): tile.view acc_j: columns 128..191 (at j = 2) are "
        "not a whole-group slice of acc [64, 128]; the first column is a multiple of 8 and the last inside "
        "the tile"),
    "view-of-part-of-a-group": (
        lambda: _view_kernel(_slices(width=12)),
        "IR line 5 (role consumer > for j > tile.view acc_j): tile.view acc_j: cols(j * 12, 12) is 12 columns; "
        "a view spans whole column groups of the fragment layout, a multiple of 8"),
}


@pytest.mark.parametrize("case", sorted(VERIFY_CASES))
def test_verifier_messages(case):
    build_kernel, expected = VERIFY_CASES[case]
    assert [d.message for d in verify_all(build_kernel(), contract=False)] == [expected]


def test_a_view_is_no_wgmma_operand():
    text = print_kernel(ws.lower(gated)).replace(
        "        wgmma.mma acc, A[s, wg]", "        tile.view acc_v, acc, cols(0, 256)\n        wgmma.mma acc_v, A[s, wg]")
    assert [d.message for d in verify_all(parse_kernel(text), contract=False)] == [
        "IR line 64 (role consumer > for tile > for k > wgmma.mma): wgmma operand acc_v is a tile.view; wgmma reads "
        "and writes whole `reg` tiles (an asynchronous wgmma holds the registers it names until its wgmma.wait)"]


def test_the_view_is_the_same_array_in_cuda():
    src = emit_kernel(ws.lower(gated)).source
    assert "// tile.view acc_j, acc, cols(j * 64, 64): acc's elements from [(j * 64) / 2]" in src
    assert "slice_t[4 * fj + 2 * fi + 0] = acc[(j * 64) / 2 + 4 * fj + 2 * fi + 0];" in src
    assert "__nv_bfloat162 g_t[16];" in src and "float slice_t[32];" in src
