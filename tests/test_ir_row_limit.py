"""Two IR additions for variable-length attention, in every layer: `tile.store ... row_limit(L)`
(a tile of one sequence of a packed [total_rows, ...] output stops at the sequence's end) and the
builtin `bit_length(x)` (the number of bits of a non-negative int).

A small kernel copies a packed [T, 64] tensor tile by tile, two 64-row tiles per sequence, each
tile's store bounded by its sequence's end (read with `ld.global` from a cumulative-lengths
table): text, verifier messages, the simulator (rows at or beyond the limit keep their poison and
are not noted as written), the CUDA and its compile with nvcc.
"""

from __future__ import annotations

import pytest
import torch

from wsched.codegen import build
from wsched.codegen.emit import emit_kernel
from wsched.lowering import ir
from wsched.lowering.evaluate import evaluate
from wsched.lowering.parser import parse_expr, parse_kernel
from wsched.lowering.printer import print_expr, print_kernel, print_stmt
from wsched.lowering.simulate import simulate
from wsched.lowering.simulate.machine import Machine
from wsched.lowering.verify import verify_all

C, V = ir.IntConst, ir.Var

VARLEN = """\
kernel varlen_copy(global x: f32[T, 64], global out: f32[T, 64], global starts: i32[3], i32 T, i32 tiles_per_seq = bit_length(T) - 6) grid(2 * tiles_per_seq) cluster(1, 1, 1) {
  role worker warpgroups(1) registers(232) {
    reg t: f32[64, 64]
    ld.global q_start = starts[cta_id / tiles_per_seq]
    ld.global q_end = starts[cta_id / tiles_per_seq + 1]
    let r0 = q_start + cta_id % tiles_per_seq * 64
    tile.load t <- x[r0, 0]
    tile.store out[r0, 0] <- t row_limit(LIMIT)
  }
}
"""
STARTS = (0, 70, 100)   # sequence 0: rows 0..69 (two tiles), sequence 1: rows 70..99
T = 130                 # bit_length(130) - 6 = 2 tiles per sequence; rows 100..129 belong to none


def varlen_kernel(limit: str = "q_end") -> ir.Kernel:
    return parse_kernel(VARLEN.replace("LIMIT", limit))


def varlen_args(seed: int = 0) -> dict:
    x = torch.randn(T, 64, generator=torch.Generator().manual_seed(seed))
    return {"x": x, "out": torch.full((T, 64), float("nan")), "starts": torch.tensor(STARTS, dtype=torch.int32),
            "T": T}


# --- text ----------------------------------------------------------------------------------------

def test_the_kernel_prints_and_parses_back():
    k = varlen_kernel()
    assert print_kernel(k) == VARLEN.replace("LIMIT", "q_end")
    (store,) = [s for s in ir.walk(k.body) if isinstance(s, ir.TileStoreGlobal)]
    assert store == ir.TileStoreGlobal("out", (V("r0"), C(0)), "t", V("q_end"))
    assert k.params[-1] == ir.HostParam("tiles_per_seq", "i32", ir.sub(ir.bit_length("T"), 6))


@pytest.mark.parametrize("text", [
    "tile.store o[r0, c0] <- o_t row_limit(q_end)",
    "tile.store o[b, r0, 0] <- o_t row_limit(min(q_end, S) - 1)",
    "tile.store o[r0, c0] <- o_t",
])
def test_statement_spellings(text):
    (stmt,) = parse_kernel(f"kernel k() grid(1) cluster(1, 1, 1) {{\n  {text}\n}}\n").body
    assert print_stmt(stmt) == text


def test_row_limit_is_the_last_field_and_defaults_to_none():
    store = ir.TileStoreGlobal("o", (C(0), C(0)), "t")
    assert store.row_limit is None
    assert store != ir.TileStoreGlobal("o", (C(0), C(0)), "t", C(64))


def test_bit_length_spelling():
    assert ir.bit_length("n") == ir.Call("bit_length", (V("n"),))
    assert parse_expr("bit_length(n + 1) - 1") == ir.sub(ir.bit_length(ir.add("n", 1)), 1)
    assert print_expr(ir.bit_length(ir.mul("n", 2))) == "bit_length(n * 2)"


# --- bit_length's value --------------------------------------------------------------------------

@pytest.mark.parametrize("x, bits", [(0, 0), (1, 1), (2, 2), (5, 3), (64, 7), (2**31 - 1, 31)])
def test_bit_length_values(x, bits):
    assert evaluate(ir.bit_length("x"), {"x": x}) == bits


def test_bit_length_of_a_negative_number_has_no_value():
    with pytest.raises(ValueError) as info:
        evaluate(ir.bit_length(ir.sub("x", 1)), {"x": 0})
    assert str(info.value) == "bit_length of a negative number (-1) in bit_length(x - 1)"
    with pytest.raises(ValueError) as info:
        evaluate(ir.bit_length("x"), {"x": 2.0})
    assert str(info.value) == "'bit_length' needs an integer, got 2.0 in bit_length(x)"


def test_a_wrong_arity_is_a_parse_error():
    with pytest.raises(Exception, match=r"`bit_length` takes 1 arguments, not 2"):
        parse_expr("bit_length(1, 2)")


# --- verifier ------------------------------------------------------------------------------------

def test_the_kernel_is_sound():
    assert verify_all(varlen_kernel(), contract=False) == []


def test_a_row_limit_on_a_one_dim_tensor_is_reported():
    text = VARLEN.replace("LIMIT", "q_end").replace("global out: f32[T, 64]", "global out: f32[T]")
    text = text.replace("reg t: f32[64, 64]", "reg t: f32[1, 64]").replace("tile.load t <- x[r0, 0]\n", "tile.fill t, 0.0\n")
    text = text.replace("tile.store out[r0, 0]", "tile.store out[r0]")
    assert [d.message for d in verify_all(parse_kernel(text), contract=False)] == [
        "IR line 8 (role worker > tile.store): tile.store out[r0] <- t row_limit(q_end): out is f32[T] (rank 1); "
        "row_limit bounds the rows (dim -2) of a tensor of rank 2 or more"]


def test_a_row_limit_reading_an_undeclared_name_is_reported():
    assert [d.message for d in verify_all(varlen_kernel("q_stop"), contract=False)] == [
        "IR line 8 (role worker > tile.store): `q_stop` is not declared; expressions read scalar params, builtins "
        "(cta_id, num_ctas, wg inside a role), loop variables and the lets/vars of enclosing blocks"]


def test_floats_where_the_ir_takes_integers_are_reported():
    assert [d.message for d in verify_all(varlen_kernel("q_end + 0.5"), contract=False)] == [
        "IR line 8 (role worker > tile.store): row_limit(q_end + 0.5) is a row, an integer expression; it holds a "
        "float constant"]
    assert [d.message for d in verify_all(varlen_kernel("bit_length(0.5)"), contract=False)] == [
        "IR line 8 (role worker > tile.store): `bit_length` takes integers, not the float 0.5",
        "IR line 8 (role worker > tile.store): row_limit(bit_length(0.5)) is a row, an integer expression; it holds "
        "a float constant"]


# --- simulator -----------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(2))
def test_rows_at_or_beyond_the_limit_are_not_stored(seed):
    """Sequence 0's second tile (rows 64..127) stores rows 64..69 only, sequence 1's second tile
    (rows 134..) stores nothing, and rows 100..129, of no sequence, keep their NaN poison."""
    args = varlen_args(seed)
    simulate(varlen_kernel(), args, seed=seed)
    out, x = args["out"], args["x"]
    assert torch.equal(out[:100], x[:100])
    assert torch.isnan(out[100:]).all()


def test_rows_below_the_limit_are_still_bounds_checked():
    """A limit past the tensor's end stores up to the tensor's last row, no further."""
    args = varlen_args()
    simulate(varlen_kernel("q_end + 1000"), args)
    assert torch.equal(args["out"], args["x"])


def test_a_limit_at_or_below_the_first_row_stores_nothing():
    args = varlen_args()
    simulate(varlen_kernel("r0 - 3 * (cta_id % 2)"), args)      # the first tile of each sequence: limit r0
    assert torch.isnan(args["out"]).all()


def test_only_the_rows_stored_are_noted_as_written():
    """Neighbouring sequences' tiles share rows of their boxes (64..127 and 70..133) but write
    disjoint rows: each row's writer is the CTA that stored it, rows 100.. have none (a load of
    them races with no store)."""
    machine = Machine(varlen_kernel(), varlen_args(), 4, 0, 5_000_000)
    machine.run()
    index, records = machine.global_writes["out"]
    writer = [{records[i].ctx.cta_id if i >= 0 else None for i in index[row].tolist()} for row in range(T)]
    assert writer == [{0}] * 64 + [{1}] * 6 + [{2}] * 30 + [{None}] * 30


# --- emitter -------------------------------------------------------------------------------------

def test_emitted_cuda_checks_the_limit():
    src = emit_kernel(varlen_kernel()).source
    assert "tile.store out[r0, 0] <- t row_limit(q_end), bounds-checked" in src
    assert "const bool row_ok = row < T && row < q_end;" in src
    assert "//   host      tiles_per_seq = bit_length(T) - 6 (computed per call)\n" in src
    src = emit_kernel(varlen_kernel("q_end - (q_end & 1)")).source
    assert "const bool row_ok = row < T && row < q_end - (q_end & 1);" in src
    src = emit_kernel(varlen_kernel("q_end << 1")).source
    assert "const bool row_ok = row < T && row < (q_end << 1);" in src


def test_emitted_cuda_without_a_limit_is_unchanged():
    plain = VARLEN.replace(" row_limit(LIMIT)", "")
    src = emit_kernel(parse_kernel(plain)).source
    assert "const bool row_ok = row < T;" in src
    assert "row_limit" not in src


def test_bit_length_in_device_code_calls_the_helper():
    text = VARLEN.replace("LIMIT", "q_end").replace("    let r0 = q_start", "    let bits = bit_length(q_end)\n"
                                                     "    let r0 = bits * 0 + q_start")
    src = emit_kernel(parse_kernel(text)).source
    assert "const int bits = wsp::bit_length(q_end);" in src
    assert "bit_length(T) - 6" in src    # the host param's formula, in a comment


@pytest.mark.nvcc
def test_the_kernel_compiles_for_sm90a(tmp_path):
    text = VARLEN.replace("LIMIT", "min(q_end, bit_length(T) << 6)")
    emitted = emit_kernel(parse_kernel(text))
    assert "wsp::bit_length(T)" in emitted.source
    result = build.compile_cuda(emitted.source, name=emitted.name, cache_dir=tmp_path)
    res = result.resources[emitted.name]
    assert (res.spill_stores, res.spill_loads, res.stack_bytes) == (0, 0, 0)
