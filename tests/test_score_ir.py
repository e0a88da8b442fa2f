"""The loop-IR nodes of attention score functions in every layer: `tile.iota`, `tile.select`, the
comparison tile ops (`tile.lt` ... `tile.logical_or`) and i32 tile loads — text round trip,
verifier messages, simulator semantics against torch, the CUDA spelling (and an nvcc build)."""

import math

import pytest
import torch

from wsched.codegen import emit_tiles
from wsched.codegen.emit import emit_kernel
from wsched.lowering import ir
from wsched.lowering.parser import parse_kernel
from wsched.lowering.printer import print_kernel
from wsched.lowering.simulate import simulate
from wsched.lowering.simulate.tiles import COMPARE_SEMANTICS
from wsched.lowering.verify import VerifyError, verify
from wsched.reference import MASK_TORCH
from wsched.target import COMPARE_OPS

V, C = ir.Var, ir.const
ROWS, COLS = 64, 32


def mask_kernel(op: str = "le") -> ir.Kernel:
    """out[r, c] = c - r where `op`(c, r) holds and the query's id equals the key's, else -inf:
    positions, a comparison, an i32 row / column loaded into f32 tiles, a logical and, a select."""
    row0 = ir.mul("cta_id", ROWS)
    return ir.Kernel(
        name="mask_tile",
        params=(ir.ScalarParam("R", "i32"), ir.GlobalParam("ids", "i32", (V("R"), C(1))),
                ir.GlobalParam("keys", "i32", (C(1), C(COLS))), ir.GlobalParam("out", "f32", (V("R"), C(COLS)))),
        grid=ir.ceil_div("R", ROWS), cluster=(1, 1, 1), smem=(), barriers=(),
        body=(ir.Role("worker", 1, 168, (
              ir.RegDecl("i_t", "f32", (ROWS, COLS)), ir.RegDecl("j_t", "f32", (ROWS, COLS)),
              ir.RegDecl("id_t", "f32", (ROWS, 1)), ir.RegDecl("key_t", "f32", (1, COLS)),
              ir.RegDecl("m_t", "f32", (ROWS, COLS)), ir.RegDecl("o_t", "f32", (ROWS, COLS)),
              ir.TileLoadGlobal("id_t", "ids", (row0, C(0))),
              ir.TileLoadGlobal("key_t", "keys", (C(0), C(0))),
              ir.TileIota("i_t", 0, row0),
              ir.TileIota("j_t", 1, C(0)),
              ir.TileBinary(op, "m_t", "j_t", "i_t"),
              ir.TileBinary("eq", "o_t", "id_t", "key_t"),
              ir.TileBinary("logical_and", "m_t", "m_t", "o_t"),
              ir.TileBinary("sub", "o_t", "j_t", "i_t"),
              ir.TileSelect("o_t", "m_t", "o_t", ir.FloatConst(-math.inf)),
              ir.TileStoreGlobal("out", (row0, C(0)), "o_t"))),),
    )


def test_the_nodes_print_and_parse_back():
    kernel = mask_kernel()
    text = print_kernel(kernel)
    assert "tile.iota i_t, axis(0), start(cta_id * 64)" in text
    assert "tile.le m_t, j_t, i_t" in text and "tile.logical_and m_t, m_t, o_t" in text
    assert "tile.select o_t, m_t, o_t, scalar(-inf)" in text
    assert parse_kernel(text) == kernel
    for op in COMPARE_OPS:
        assert parse_kernel(print_kernel(mask_kernel(op))) == mask_kernel(op)


def test_the_tables_cover_the_comparisons():
    assert tuple(COMPARE_SEMANTICS) == COMPARE_OPS == ir.COMPARE_OPS
    assert tuple(emit_tiles._COMPARE) == COMPARE_OPS
    assert set(MASK_TORCH) == {*COMPARE_OPS, "logical_not", "where"}


@pytest.mark.parametrize("op", COMPARE_OPS[:6])
@pytest.mark.parametrize("num_sms", [1, 2])
def test_the_simulator_computes_masks_like_torch(op, num_sms):
    R = 150
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 3, (R, 1), generator=g, dtype=torch.int32)
    keys = torch.randint(0, 3, (1, COLS), generator=g, dtype=torch.int32)
    out = torch.full((R, COLS), float("nan"))
    simulate(mask_kernel(op), {"R": R, "ids": ids, "keys": keys, "out": out}, num_sms=num_sms)
    i, j = torch.arange(R)[:, None], torch.arange(COLS)[None, :]
    keep = getattr(torch, op)(j, i) & (ids == keys)
    assert torch.equal(out, torch.where(keep, (j - i).float(), -math.inf))


def with_body(body) -> ir.Kernel:
    kernel = mask_kernel()
    (role,) = kernel.body
    return ir.Kernel(**{**kernel.__dict__, "body": (ir.Role(role.name, 1, 168, tuple(body)),)})


def test_the_verifier_names_bad_positions_and_selections():
    body = list(mask_kernel().body[0].body)
    body[8] = ir.TileIota("i_t", 2, C(0))
    body[14] = ir.TileSelect("o_t", "m_t", "key_t", "id_t")    # broadcasts: [64, 32]
    body[12] = ir.TileBinary("and", "m_t", "m_t", "o_t")
    with pytest.raises(VerifyError) as error:
        verify(with_body(body))
    text = str(error.value)
    assert "tile.iota i_t: axis(2) is not an axis of a 2-D tile; use 0 (rows) or 1 (columns)" in text
    assert "tile.select" not in text
    assert ("tile.and is not a binary tile op; use one of add, sub, mul, div, maximum, minimum, lt, le, gt, ge, "
            "eq, ne, logical_and, logical_or") in text
    body = list(mask_kernel().body[0].body)
    body[14] = ir.TileSelect("id_t", "m_t", "o_t", ir.FloatConst(0.0))
    with pytest.raises(VerifyError, match=r"tile\.select id_t: operands m_t \[64, 32\], o_t \[64, 32\] do not "
                                          r"broadcast to the result \[64, 1\]"):
        verify(with_body(body))


def test_the_cuda_spelling():
    source = emit_kernel(mask_kernel()).source
    # one int-to-float conversion per thread (loop-invariant), a constant added per element
    assert "i_t[4 * fj + 2 * fi + 0] = static_cast<float>(cta_id * 64 + wsp::frag_row()) + (8 * fi);" in source
    assert "j_t[4 * fj + 2 * fi + 1] = static_cast<float>(0 + wsp::frag_col()) + (8 * fj + 1);" in source
    assert "m_t[4 * fj + 2 * fi + 0] = ((j_t[4 * fj + 2 * fi + 0]) <= (i_t[4 * fj + 2 * fi + 0])) ? 1.0f : 0.0f;" in source
    assert ("o_t[4 * fj + 2 * fi + 0] = (m_t[4 * fj + 2 * fi + 0]) != 0.0f ? o_t[4 * fj + 2 * fi + 0] : -INFINITY;"
            in source)
    # i32 ids read as pairs (one 64-bit load) into f32 tiles
    assert ("{ const int2 v = wsp::load_pair(ptr + 8 * fj, row_ok && col0 + 8 * fj < 32); "
            "key_t[2 * fj + 0] = static_cast<float>(v.x); key_t[2 * fj + 1] = static_cast<float>(v.y); }") in source
    # the positions, comparisons and the select run as one loop
    assert "// tile.iota i_t, axis(0), start(cta_id * 64); tile.iota j_t, axis(1), start(0); tile.le" in source


@pytest.mark.nvcc
@pytest.mark.parametrize("make", [lambda: mask_kernel(), lambda: int_kernel()], ids=["masks", "i32_tiles"])
def test_the_cuda_builds(make):
    from wsched.codegen.build import compile_cuda

    emitted = emit_kernel(make())
    assert compile_cuda(emitted.source, name=emitted.name).resources[emitted.name].spill_stores == 0


# ---------------------------------------------------------------------------------------------
# i32 register tiles (docs/ir.md, "Integer tiles")
# ---------------------------------------------------------------------------------------------


def int_kernel(body_edit=None) -> ir.Kernel:
    """out[r, c] = float(wrap((keys[c] - ids[r]) * 3 + r)) where ids[r] == keys[c] (an integer
    comparison) and that difference is below the row's position cast from an f32 iota, else -inf."""
    row0 = ir.mul("cta_id", ROWS)
    body = [
        ir.RegDecl("ids_t", "i32", (ROWS, 1)), ir.RegDecl("keys_t", "i32", (1, COLS)),
        ir.RegDecl("d_t", "i32", (ROWS, COLS)), ir.RegDecl("r_t", "i32", (ROWS, 1)),
        ir.RegDecl("f_t", "f32", (ROWS, 1)), ir.RegDecl("m_t", "f32", (ROWS, COLS)),
        ir.RegDecl("o_t", "f32", (ROWS, COLS)),
        ir.TileLoadGlobal("ids_t", "ids", (row0, C(0))),
        ir.TileLoadGlobal("keys_t", "keys", (C(0), C(0))),
        ir.TileIota("f_t", 0, row0),
        ir.TileUnary("cast", "r_t", "f_t"),                     # f32 -> i32, truncated
        ir.TileBinary("sub", "d_t", "keys_t", "ids_t"),
        ir.TileBinary("mul", "d_t", "d_t", C(3)),
        ir.TileBinary("add", "d_t", "d_t", "r_t"),
        ir.TileBinary("eq", "m_t", "ids_t", "keys_t"),          # integers compared exactly
        ir.TileBinary("lt", "o_t", "d_t", C(2**31 - 1)),
        ir.TileBinary("logical_and", "m_t", "m_t", "o_t"),
        ir.TileSelect("o_t", "m_t", "d_t", ir.FloatConst(-math.inf)),   # d_t read as fp32
        ir.TileStoreGlobal("out", (row0, C(0)), "o_t"),
    ]
    kernel = mask_kernel()
    body = body_edit(body) if body_edit else body
    return ir.Kernel(**{**kernel.__dict__, "body": (ir.Role("worker", 1, 168, tuple(body)),)})


def test_i32_tiles_compute_integers_exactly_in_the_simulator():
    """Ids 2**30 + d (one value in fp32), differences scaled until they wrap: as torch's int32."""
    R = 150
    g = torch.Generator().manual_seed(0)
    ids = (torch.randint(0, 3, (R, 1), generator=g) + 2**30).to(torch.int32)
    keys = (torch.randint(0, 3, (1, COLS), generator=g) + 2**30).to(torch.int32)
    keys[0, 0] = -2**31 + 1   # (keys - ids) * 3 wraps
    out = torch.full((R, COLS), float("nan"))
    kernel = int_kernel()
    assert parse_kernel(print_kernel(kernel)) == kernel
    simulate(kernel, {"R": R, "ids": ids, "keys": keys, "out": out}, num_sms=2)
    r = torch.arange(R, dtype=torch.int32)[:, None]
    d = (keys - ids) * 3 + r
    keep = (ids == keys) & (d < 2**31 - 1)
    assert torch.equal(out, torch.where(keep, d.float(), -math.inf))
    assert (ids == keys).any() and not (ids == keys).all()


@pytest.mark.parametrize("edit, message", [
    (lambda b: b[:12] + [ir.TileBinary("mul", "d_t", "d_t", ir.FloatConst(0.5))] + b[13:],
     "tile.mul d_t: d_t is i32 but the scalar 0.5 is a float; an op into an i32 tile takes integer scalars"),
    (lambda b: b[:11] + [ir.TileBinary("sub", "d_t", "keys_t", "f_t")] + b[12:],
     "tile.sub d_t: d_t is i32 but operand f_t is f32; an op into an i32 tile computes in integers on i32 tiles "
     "and integer scalars (tile.cast d_t, f_t truncates a float tile first)"),
    (lambda b: b[:14] + [ir.TileBinary("eq", "d_t", "ids_t", "keys_t")] + b[15:],
     "tile.eq d_t: d_t is i32; a comparison writes 1.0 / 0.0 into a float tile (its operands may be i32)"),
    (lambda b: b[:12] + [ir.TileBinary("div", "d_t", "d_t", C(3))] + b[13:],
     "tile.div d_t: d_t is i32; an i32 tile is computed by neg, cast, add, sub, mul, maximum, minimum"),
    (lambda b: b[:10] + [ir.TileUnary("exp", "r_t", "r_t")] + b[11:],
     "tile.exp r_t, r_t: r_t is i32; an i32 tile is computed by neg, cast, add, sub, mul, maximum, minimum"),
    (lambda b: b[:7] + [ir.TileLoadGlobal("ids_t", "out", (C(0), C(0)))] + b[8:],
     "tile.load ids_t <- out: ids_t is i32 but out is f32; an i32 tile reads an i32 tensor"),
    (lambda b: b[:-1] + [ir.TileStoreGlobal("out", (C(0), C(0)), "d_t")],
     "tile.store out: d_t is an i32 tile, which is not stored"),
    (lambda b: b[:-1] + [ir.TileReduce("max", "r_t", "d_t", 1)],
     "tile.reduce.max r_t, d_t: d_t is an i32 tile, which is not reduced"),
    (lambda b: b[:-1] + [ir.TileFill("d_t", ir.FloatConst(1.5))],
     "tile.fill d_t: d_t is i32 but the scalar 1.5 is a float"),
    (lambda b: b[:12] + [ir.TileBinary("add", "d_t", "d_t", ir.add("R", "scale"))] + b[13:],
     "tile.add d_t: d_t is i32 but the scalar R + scale is a float"),
])
def test_the_verifier_names_misused_i32_tiles(edit, message):
    kernel = int_kernel(edit)
    kernel = ir.Kernel(**{**kernel.__dict__, "params": kernel.params + (ir.ScalarParam("scale", "f32"),)})
    with pytest.raises(VerifyError) as error:
        verify(kernel)
    assert message in str(error.value)


def test_the_cuda_spelling_of_i32_tiles():
    source = emit_kernel(int_kernel()).source
    assert "int keys_t[8];" in source and "int ids_t[2];" in source
    # i32 ids read as pairs, unconverted
    assert ("{ const int2 v = wsp::load_pair(ptr + 8 * fj, row_ok && col0 + 8 * fj < 32); "
            "keys_t[2 * fj + 0] = v.x; keys_t[2 * fj + 1] = v.y; }") in source
    assert "r_t[fi] = __float2int_rz(f_t[fi]);" in source
    assert "d_t[4 * fj + 2 * fi + 0] = wsp::wrap_sub(keys_t[2 * fj + 0], ids_t[fi]);" in source
    assert "d_t[4 * fj + 2 * fi + 1] = wsp::wrap_mul(d_t[4 * fj + 2 * fi + 1], 3);" in source
    assert "m_t[4 * fj + 2 * fi + 0] = ((ids_t[fi]) == (keys_t[2 * fj + 0])) ? 1.0f : 0.0f;" in source
    assert "o_t[4 * fj + 2 * fi + 0] = ((d_t[4 * fj + 2 * fi + 0]) < (2147483647)) ? 1.0f : 0.0f;" in source
    assert ("o_t[4 * fj + 2 * fi + 0] = (m_t[4 * fj + 2 * fi + 0]) != 0.0f ? "
            "static_cast<float>(d_t[4 * fj + 2 * fi + 0]) : -INFINITY;") in source

