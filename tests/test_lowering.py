"""Lowering: the pass pipeline, the IR after each pass, golden final IR, round-trip through the parser."""


import pytest

import wsched as ws
from wsched.lowering import ir
from wsched.lowering.parser import parse_kernel
from wsched.lowering.pipeline import pass_names
from wsched.workloads import MATMUL
from wsched.lowering.printer import print_kernel

from fusions import linear_relu_residual, matmul, mlp, scaled_silu_f32


@pytest.fixture(autouse=True)
def debug_verifier(monkeypatch):
    monkeypatch.setenv("WSCHED_DEBUG", "1")   # verify after every pass


def test_default_matmul_final_ir_is_golden(golden):
    golden.check("matmul_default.ir", print_kernel(ws.lower(matmul)))


def test_mlp_final_ir_is_golden(golden):
    golden.check("mlp_default.ir", print_kernel(ws.lower(mlp)))


def test_ir_after_each_pass_is_kept_by_name():
    k = ws.lower(mlp)
    assert tuple(k.ir_after) == pass_names(MATMUL, ws.schedule_for(mlp)) == (
        "build_loops", "circular_buffer", "insert_barriers", "lower_tma", "lower_mma", "epilogue", "reg_realloc")
    assert pass_names(MATMUL) == (       # every step of the route; pingpong runs for mode="pingpong",
        "build_loops", "circular_buffer", "insert_barriers", "lower_tma", "lower_mma", "epilogue", "pingpong",
        "cluster", "reg_realloc")        # cluster for a cluster of more than one CTA
    assert pass_names(MATMUL, ws.schedule_for(mlp, cluster=(2, 1, 1)))[-2:] == ("cluster", "reg_realloc")
    assert k.ir_after["reg_realloc"] == k
    before = print_kernel(k.ir_after["circular_buffer"])
    after = print_kernel(k.ir_after["insert_barriers"])
    assert "mbarrier.wait empty[s] phase(ph ^ 1)" not in before
    assert "mbarrier.wait empty[s] phase(ph ^ 1)" in after
    assert "mbarrier.arrive_expect_tx full[s] bytes(49152)" in after
    assert "elect_one" not in print_kernel(k.ir_after["insert_barriers"])
    assert "setmaxnreg" not in print_kernel(k.ir_after["epilogue"])
    assert "setmaxnreg.dec 24" in print_kernel(k)


def test_print_ir_knob_prints_the_chosen_passes(monkeypatch, capsys):
    monkeypatch.setenv("WSCHED_PRINT_IR", "insert_barriers,epilogue")
    ws.lower(mlp)
    err = capsys.readouterr().err
    assert err.count("# ----- IR after") == 2
    assert "# ----- IR after insert_barriers -----\nkernel mlp(" in err
    assert "# ----- IR after epilogue -----" in err
    # a saved dump parses back as it is
    dump = err.split("# ----- IR after epilogue -----")[0]
    assert parse_kernel(dump) == ws.lower(mlp).ir_after["insert_barriers"]


def test_print_ir_knob_warns_about_a_misspelt_pass(monkeypatch):
    monkeypatch.setenv("WSCHED_PRINT_IR", "insert_barrier")
    with pytest.warns(UserWarning, match=r"WSCHED_PRINT_IR names no pass: insert_barrier; the passes are "
                                         r"build_loops, circular_buffer, insert_barriers, .*overlap_softmax, "
                                         r"pingpong, epilogue, defer_row_loads, dynamic_tiles, cluster, reg_realloc \(or all\)"):
        ws.lower(mlp)


@pytest.mark.parametrize("fusion", [matmul, mlp, linear_relu_residual, scaled_silu_f32], ids=lambda f: f.name)
@pytest.mark.parametrize("overrides", [dict(stages=s) for s in (1, 2)] + [dict(epilogue="direct", stages=s) for s in (3, 4)] + [
                                        dict(raster="column", swizzle_group=2), dict(mma_inflight=0)])
def test_every_pass_output_round_trips(fusion, overrides):
    k = ws.lower(fusion, **overrides)
    for name, snapshot in k.ir_after.items():
        text = print_kernel(snapshot)
        assert parse_kernel(text) == snapshot, name
        assert print_kernel(parse_kernel(text)) == text


def test_stages_change_the_ring_and_the_counter():
    k3, k4 = ws.lower(mlp, stages=3), ws.lower(mlp, epilogue="direct", stages=4)
    assert k3.smem_decl("A").shape == (3, 2, 64, 64) and k4.smem_decl("A").shape == (4, 2, 64, 64)
    assert "let s = it % 4" in print_kernel(k4) and "let s = it % 3" in print_kernel(k3)


def test_direct_epilogue_stores_from_registers():
    text = print_kernel(ws.lower(linear_relu_residual, epilogue="direct"))
    assert "tile.store out[m0 + wg * 64, n0 + j * 64] <- slice_t" in text
    assert "tma.store" not in text and "fence.proxy.async" not in text
    assert "tile.load res_t <- res[m0 + wg * 64, n0 + j * 64]" in text


def test_epilogue_reuses_dead_tiles():
    k = ws.lower(mlp)
    regs = [s for s in ir.walk(k.body) if isinstance(s, ir.RegDecl)]
    # a 64-column slice of acc carries add and gelu in place, and the store rounds it to bf16:
    # the bias row of the slice is the only other tile.
    assert [(r.name, r.dtype, r.shape) for r in regs] == [("acc", "f32", (64, 256)), ("slice_t", "f32", (64, 64)),
                                                          ("bias_t", "bf16", (1, 64))]
    assert print_kernel(k).count("tile.cast") == 1   # the copy of acc's slice; the output cast is the store's


def test_edited_ir_parses_back():
    text = print_kernel(ws.lower(mlp)).replace("setmaxnreg.inc 240", "setmaxnreg.inc 232").replace(
        "registers(240)", "registers(232)")
    k = parse_kernel(text)
    assert [r.registers for r in k.roles()] == [24, 232]


def test_host_evaluation_uses_the_simulators_semantics():
    from wsched.lowering.evaluate import evaluate
    from wsched.lowering.parser import parse_expr

    assert evaluate(parse_expr("ceil_div(M, 128) * 2 + (7 % 3)"), {"M": 300}) == 7
    assert evaluate(parse_expr("(it / 3) & 1"), {"it": 4}) == 1
    with pytest.raises(KeyError, match="expression reads 'N', which has no value here"):
        evaluate(parse_expr("N + 1"), {})
    with pytest.raises(ValueError, match=r"integer division by zero in M / 0"):
        evaluate(parse_expr("M / 0"), {"M": 3})


def test_a_tile_buffer_is_released_in_the_kv_loops_last_step_only_where_that_is_its_last_read():
    """insert_barriers releases attention's Q in the kv loop's last step, after its Q K^T: only
    where the loop counts from 0 (`kv_tiles == 0` then means no step ran), the reads are wgmmas
    at the top of its body, and lower_mma waits for each in its step (no group kept in flight)."""
    from wsched.lowering.passes import insert_barriers

    C, V = ir.IntConst, ir.Var
    s = ir.Wgmma("s_acc", ir.SmemRef("Q", (C(0),)), ir.SmemRef("K", (C(0),)), "k", "k", C(0))
    pv = ir.Wgmma("o_acc", "p", ir.SmemRef("V", (C(0),)), "k", "n", C(1))

    def loop(start, *body):
        return ir.For("k", C(start), V("kv_tiles"), C(1), "serial", body)

    assert insert_barriers._reads_every_step(loop(0, s, pv), {"Q"})
    assert not insert_barriers._reads_every_step(loop(1, s, pv), {"Q"})
    assert not insert_barriers._reads_every_step(loop(0, pv, ir.If(V("x"), (s,))), {"Q"})
    assert not insert_barriers._reads_every_step(loop(0, s), {"Q"})      # one group, kept in flight
    released = insert_barriers._release_in_last_step(loop(0, s, ir.MbarrierArrive(ir.BarRef("k_empty", C(0))), pv),
                                                     [ir.MbarrierArrive(ir.BarRef("q_empty", C(0)))], {"Q"})
    assert [type(x).__name__ for x in released.body] == ["Wgmma", "MbarrierArrive", "If", "Wgmma"]
    assert released.body[2].cond == ir.BinOp("==", ir.add("k", 1), V("kv_tiles"))
