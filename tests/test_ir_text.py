"""The loop IR's text form: printer, LALR grammar and parser agree (`parse(print(k)) == k`).

Golden kernels in tests/golden/*.ir are hand-written; together they use every statement, every
parameter kind, every expression form and every tile op, and each reads back and prints to
itself. Hypothesis builds random kernels for the same round trip.
"""

from __future__ import annotations

import functools
import logging
import math
import re
import typing
from pathlib import Path

import lark
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from wsched.lowering import ir, spelling
from wsched.lowering.parser import IRParseError, build_lark, parse_expr, parse_kernel
from wsched.lowering.printer import print_expr, print_kernel, print_stmt

ROOT = Path(__file__).resolve().parent.parent
GOLDEN_FILES = sorted((ROOT / "tests" / "golden").glob("*.ir"))
DOC = ROOT / "docs" / "ir.md"


def golden_kernels() -> dict[str, ir.Kernel]:
    return {p.name: parse_kernel(p.read_text(), p.name) for p in GOLDEN_FILES}


def exprs_in(node):
    """Every expression inside a node, sub-expressions included."""
    if isinstance(node, (ir.IntConst, ir.FloatConst, ir.Var, ir.BinOp, ir.Call)):
        yield node
        for child in (node.lhs, node.rhs) if isinstance(node, ir.BinOp) else \
                node.args if isinstance(node, ir.Call) else ():
            yield from exprs_in(child)
    elif isinstance(node, tuple):
        for item in node:
            yield from exprs_in(item)
    elif hasattr(node, "__dataclass_fields__"):
        for name in node.__dataclass_fields__:
            if name != "ir_after":
                yield from exprs_in(getattr(node, name))


# ---------------------------------------------------------------------------------------------
# Golden kernels
# ---------------------------------------------------------------------------------------------


def test_there_are_golden_kernels():
    assert {"all_nodes.ir", "tiles.ir", "exprs.ir"} <= {p.name for p in GOLDEN_FILES}


@pytest.mark.parametrize("path", GOLDEN_FILES, ids=lambda p: p.name)
def test_golden_kernel_prints_back_to_its_file(path, golden):
    kernel = parse_kernel(path.read_text(), path.name)
    golden.check(path.name, print_kernel(kernel))
    assert parse_kernel(print_kernel(kernel)) == kernel


def test_golden_kernels_use_every_statement_kind():
    used = {type(s) for k in golden_kernels().values() for s in ir.walk(k.body)}
    missing = [t.__name__ for t in ir.STMT_TYPES if t not in used]
    assert not missing, f"no golden kernel uses {missing}"


def test_golden_kernels_use_every_param_kind_and_tile_op():
    kernels = golden_kernels().values()
    params = {type(p) for k in kernels for p in k.params}
    assert params == set(typing.get_args(ir.Param))
    ops = {s.op for k in kernels for s in ir.walk(k.body)
           if isinstance(s, (ir.TileUnary, ir.TileBinary, ir.TileReduce))}
    assert set(ir.TILE_UNARY_OPS + ir.BINARY_OPS + ir.REDUCE_OPS) <= ops
    wgmma_a = {type(s.a) for k in kernels for s in ir.walk(k.body) if isinstance(s, ir.Wgmma)}
    assert wgmma_a == {str, ir.SmemRef}
    operands = {type(o) for k in kernels for s in ir.walk(k.body) if isinstance(s, ir.TileBinary)
                for o in (s.lhs, s.rhs)}
    assert str in operands and len(operands) > 1  # tile names and scalar(...) expressions
    assert {s.iteration for k in kernels for s in ir.walk(k.body) if isinstance(s, ir.For)} == \
        set(ir.LOOP_KINDS)


def test_golden_kernels_use_every_expression_form():
    found = [e for k in golden_kernels().values() for e in exprs_in(k)]
    assert {e.op for e in found if isinstance(e, ir.BinOp)} == set(ir.BINARY_PRECEDENCE)
    assert {e.func for e in found if isinstance(e, ir.Call)} == set(ir.CALLS)
    ints = {e.value for e in found if isinstance(e, ir.IntConst)}
    assert min(ints) < 0 <= max(ints)
    floats = [e.value for e in found if isinstance(e, ir.FloatConst)]
    assert any(math.isnan(f) for f in floats)
    assert {math.inf, -math.inf} <= set(floats)
    assert any(f < 0 and math.isfinite(f) for f in floats)
    assert any("e" in repr(f) for f in floats)
    assert any(isinstance(e, ir.Var) for e in found)


# ---------------------------------------------------------------------------------------------
# Printing
# ---------------------------------------------------------------------------------------------


def test_print_kernel_built_in_python():
    s = ir.Var("s")
    kernel = ir.Kernel(
        name="copy",
        params=(ir.TensorMapParam("a", "bf16", (ir.Var("M"), ir.IntConst(64)), (64, 64), 128),
                ir.GlobalParam("out", "f32", (ir.Var("M"), ir.IntConst(64))),
                ir.ScalarParam("M", "i32")),
        grid=ir.ceil_div("M", 64),
        cluster=(1, 1, 1),
        smem=(ir.SmemDecl("A", "bf16", (2, 64, 64), 128),),
        barriers=(ir.BarrierDecl("full", 2),),
        body=(
            ir.MbarrierInit("full", 1),
            ir.FenceMbarrierInit(),
            ir.SyncThreads(),
            ir.Role("worker", 1, 168, (
                ir.Let("s", ir.mod("cta_id", 2)),
                ir.ElectOne((
                    ir.MbarrierArriveExpectTx(ir.BarRef("full", s), ir.IntConst(8192)),
                    ir.TmaLoad(ir.SmemRef("A", (s,)), "a", (ir.mul("cta_id", 64), ir.IntConst(0)),
                               ir.BarRef("full", s)),
                )),
                ir.MbarrierWait(ir.BarRef("full", s), ir.IntConst(0)),
                ir.RegDecl("t", "f32", (64, 64)),
                ir.If(ir.lt("cta_id", "M"), (ir.TileFill("t", ir.FloatConst(-math.inf)),),
                      (ir.TileFill("t", ir.FloatConst(1e-5)),)),
                ir.TileBinary("mul", "t", "t", ir.IntConst(-2)),
                ir.TileStoreGlobal("out", (ir.mul("cta_id", 64), ir.IntConst(0)), "t"),
            )),
        ),
    )
    assert print_kernel(kernel) == """\
kernel copy(tensormap a: bf16[M, 64] box(64, 64) swizzle(128), global out: f32[M, 64], i32 M) grid(ceil_div(M, 64)) cluster(1, 1, 1) {
  smem A: bf16[2, 64, 64] swizzle(128)
  barrier full[2]
  mbarrier.init full arrivals(1)
  fence.mbarrier_init
  syncthreads
  role worker warpgroups(1) registers(168) {
    let s = cta_id % 2
    elect_one {
      mbarrier.arrive_expect_tx full[s] bytes(8192)
      tma.load A[s] <- a[cta_id * 64, 0] bar(full[s])
    }
    mbarrier.wait full[s] phase(0)
    reg t: f32[64, 64]
    if cta_id < M {
      tile.fill t, -inf
    } else {
      tile.fill t, 1e-05
    }
    tile.mul t, t, scalar(-2)
    tile.store out[cta_id * 64, 0] <- t
  }
}
"""
    assert parse_kernel(print_kernel(kernel)) == kernel


def test_print_stmt_indents_nested_blocks_and_omits_empty_else():
    loop = ir.For("k", ir.IntConst(0), ir.Var("n"), ir.IntConst(1), "unroll", (
        ir.If(ir.eq("k", 0), (ir.Return(),)),
        ir.If(ir.Var("c"), ()),
    ))
    assert print_stmt(loop) == "for k in unroll(0, n, 1) {\n  if k == 0 {\n    return\n  }\n" \
                               "  if c {\n  }\n}"
    assert print_stmt(ir.Return(), indent=2) == "    return"


def test_empty_kernel():
    kernel = ir.Kernel("empty", (), ir.IntConst(1), (1, 1, 1), (), (), ())
    assert print_kernel(kernel) == "kernel empty() grid(1) cluster(1, 1, 1) {\n}\n"
    assert parse_kernel(print_kernel(kernel)) == kernel


def test_print_rejects_what_is_not_ir():
    with pytest.raises(ValueError, match=r"BinOp operator '\*\*'"):
        print_expr(ir.BinOp("**", ir.Var("a"), ir.Var("b")))
    with pytest.raises(TypeError, match="not an ir statement"):
        print_stmt("return")  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# Expressions and precedence
# ---------------------------------------------------------------------------------------------

a, b, c = ir.Var("a"), ir.Var("b"), ir.Var("c")


@pytest.mark.parametrize("expr, text", [
    (ir.sub(a, ir.sub(b, c)), "a - (b - c)"),
    (ir.sub(ir.sub(a, b), c), "a - b - c"),
    (ir.mul(ir.add(a, b), c), "(a + b) * c"),
    (ir.add(ir.add(a, b), c), "a + b + c"),
    (ir.add(a, ir.mul(b, c)), "a + b * c"),
    (ir.div(a, ir.mul(b, c)), "a / (b * c)"),
    (ir.BinOp("<<", ir.add(a, 1), b), "a + 1 << b"),
    (ir.BinOp("&", ir.BinOp("|", a, b), c), "(a | b) & c"),
    (ir.BinOp("||", ir.BinOp("&&", a, b), ir.BinOp("&&", b, c)), "a && b || b && c"),
    (ir.BinOp("==", ir.lt(a, b), ir.lt(b, c)), "a < b == (b < c)"),
    (ir.IntConst(-3), "-3"),
    (ir.add(a, -3), "a + (-3)"),
    (ir.mul(-3, a), "(-3) * a"),
    (ir.FloatConst(-0.0), "-0.0"),
    (ir.sub(a, -0.5), "a - (-0.5)"),
    (ir.add(ir.FloatConst(-math.inf), 2.5e-30), "(-inf) + 2.5e-30"),
    (ir.FloatConst(1e16), "1e+16"),
    (ir.FloatConst(math.nan), "nan"),
    (ir.emin(-1, ir.Call("select", (ir.lt(a, 0), a, ir.IntConst(0)))),
     "min(-1, select(a < 0, a, 0))"),
    (ir.ceil_div(ir.add(a, b), 64), "ceil_div(a + b, 64)"),
])
def test_expression_spelling(expr, text):
    assert print_expr(expr) == text
    assert parse_expr(text) == expr


def test_every_pair_of_operators_groups_by_the_precedence_table():
    for outer, outer_level in ir.BINARY_PRECEDENCE.items():
        for inner, inner_level in ir.BINARY_PRECEDENCE.items():
            nested_left = ir.BinOp(outer, ir.BinOp(inner, a, b), c)
            nested_right = ir.BinOp(outer, a, ir.BinOp(inner, b, c))
            left_parens = inner_level < outer_level
            right_parens = inner_level <= outer_level
            assert print_expr(nested_left) == \
                (f"(a {inner} b) {outer} c" if left_parens else f"a {inner} b {outer} c")
            assert print_expr(nested_right) == \
                (f"a {outer} (b {inner} c)" if right_parens else f"a {outer} b {inner} c")
            for expr in (nested_left, nested_right):
                assert parse_expr(print_expr(expr)) == expr
            # Without parentheses the tighter operator (or the left one) groups first.
            unparenthesised = parse_expr(f"a {inner} b {outer} c")
            assert unparenthesised == (nested_left if inner_level >= outer_level else
                                       ir.BinOp(inner, a, ir.BinOp(outer, b, c)))


def test_non_canonical_spellings_parse():
    assert parse_expr("a+-3") == ir.add(a, -3)
    assert parse_expr("((a))") == a
    assert parse_expr("- 2.5") == ir.FloatConst(-2.5)
    assert parse_expr(".5e1") == ir.FloatConst(5.0)
    assert parse_expr("min (a,b)") == ir.emin(a, b)
    assert parse_expr("for + let") == ir.add("for", "let")  # keywords are names in expressions


def test_nan_reads_back_as_the_one_nan_object():
    # FloatConst compares with ==, which nan only passes by identity; the parser returns math.nan.
    assert parse_expr("nan").value is math.nan
    assert parse_expr("nan") == ir.FloatConst(math.nan)


def test_wgmma_bare_operand_is_smem_only_when_declared():
    text = """\
kernel k() grid(1) cluster(1, 1, 1) {
  smem A: bf16[64, 64] swizzle(128)
  smem B: bf16[64, 64] swizzle(128)
  wgmma.mma acc, A, B major(k, k) accumulate(0)
  role r warpgroups(1) registers(240) {
    if 1 {
    } else {
      wgmma.mma acc, p, B major(k, n) accumulate(1)
    }
  }
}
"""
    kernel = parse_kernel(text)
    first, role = kernel.body
    assert first.a == ir.SmemRef("A", ()) and first.b == ir.SmemRef("B", ())
    assert role.body[0].orelse[0].a == "p"
    assert print_kernel(kernel) == text


# ---------------------------------------------------------------------------------------------
# Grammar properties
# ---------------------------------------------------------------------------------------------


def test_grammar_is_lalr_without_conflicts(caplog):
    # lark resolves a shift/reduce conflict silently (as a shift) unless `strict`, which needs
    # the optional interegular package; it logs each one at debug level, so look there.
    with caplog.at_level(logging.DEBUG, logger=lark.logger.name):
        build_lark(debug=True)
    conflicts = [r.getMessage() for r in caplog.records if "conflict" in r.getMessage().lower()]
    assert not conflicts


def test_grammar_statement_keywords_are_the_spelling_table():
    """grammar.lark spells statement keywords literally; they must be spelling.py's, and each
    keyword completed by an op or action must lex as the grammar's pattern terminal for it."""
    grammar = build_lark()
    firsts = [grammar.get_terminal(rule.expansion[0].name).pattern
              for rule in grammar.rules if rule.origin.name == "stmt"]
    assert {p.value for p in firsts if p.type == "str"} == spelling.fixed_keywords()
    patterns = [re.compile(p.value) for p in firsts if p.type == "re"]
    variants = spelling.all_keywords() - spelling.fixed_keywords()
    assert variants and all(any(p.fullmatch(k) for p in patterns) for k in variants)
    assert set(spelling.SPELLINGS) == set(ir.STMT_TYPES)


def test_printed_statements_start_with_their_keyword():
    for kernel in golden_kernels().values():
        for s in ir.walk(kernel.body):
            assert print_stmt(s).split()[0] == spelling.keyword(s), s


def test_grammar_dtypes_are_ir_dtypes():
    for dtype in ir.DTYPES:
        kernel = parse_kernel(f"kernel k({dtype} x) grid(1) cluster(1, 1, 1) {{\n}}\n")
        assert kernel.params == (ir.ScalarParam("x", dtype),)


def test_comments_and_free_whitespace():
    text = """
    # a comment line
    kernel k ( i32 n ) grid ( n ) cluster ( 1 , 1 , 1 )   {   # trailing comment
      barrier  full [ 2 ]
      let x = n*2   set x=x+1   # two statements on one line
      for i in serial(0,n,1){return}
      tma.wait.read 0
    }"""
    assert print_kernel(parse_kernel(text)) == """\
kernel k(i32 n) grid(n) cluster(1, 1, 1) {
  barrier full[2]
  let x = n * 2
  set x = x + 1
  for i in serial(0, n, 1) {
    return
  }
  tma.wait.read 0
}
"""


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------

SMALL = """\
kernel k(i32 n) grid(1) cluster(1, 1, 1) {
  barrier full[2]
  for s in serial(0, n, 1) {
    mbarrier.wait full[s] phase(s & 1)
    tma.load A[s] <- a[0, s] bar(full[s])
    tile.exp x, x
  }
}
"""


def parse_error(text: str) -> IRParseError:
    with pytest.raises(IRParseError) as info:
        parse_kernel(text)
    assert isinstance(info.value, ValueError)
    return info.value


@pytest.mark.parametrize("old, new, message", [
    pytest.param("}\n}\n", "}\n", "line 7, column 4: unexpected end of input; expected a statement or `}`\n"
                 "    }\n"
                 "     ^", id="missing closing brace"),
    pytest.param("phase(s & 1)", "phase()", "line 4, column 33: unexpected `)`; expected an expression\n"
                 "      mbarrier.wait full[s] phase()\n"
                 "                                  ^", id="empty phase"),
    pytest.param("tma.load", "tma.loda", "line 5, column 5: unexpected `tma.loda`; expected a "
                 "statement or `}`; did you mean `tma.load`?\n"
                 "      tma.loda A[s] <- a[0, s] bar(full[s])\n"
                 "      ^", id="unknown statement keyword"),
])
def test_error_message_in_full(old, new, message):
    assert old in SMALL
    error = parse_error(SMALL.replace(old, new))
    assert str(error) == message
    assert str(error).startswith(f"line {error.line}, column {error.column}: {error.detail}\n")


def test_error_lists_expected_terminals_in_readable_spellings():
    error = parse_error(SMALL.replace("i32 n", "n"))
    assert error.detail == \
        "unexpected `n`; expected `)`, `global`, `spans`, `tensormap`, `workspace` or a dtype (bf16, f16, f32, i32)"
    error = parse_error(SMALL.replace("phase(s & 1)", "phase(s & 1 $)"))
    assert (error.line, error.column) == (4, 39)
    assert error.detail == ("unexpected character `$`; expected `!=`, `%`, `&`, `&&`, `)`, `*`, "
                            "`+`, `-`, `/`, `<`, `<<`, `<=`, `==`, `>`, `>=`, `>>`, `^`, `|` or `||`")
    error = parse_error(SMALL.replace("bar(full[s])", "bar(full)"))
    assert error.detail == "unexpected `)`; expected `[`"


def test_error_keyword_glued_to_a_word():
    error = parse_error(SMALL.replace("tma.load A", "tma.loadA"))
    assert (error.line, error.column) == (5, 5)
    assert error.detail == "unknown word `tma.loadA`; did you mean `tma.load`?"


def test_error_declaration_after_statements():
    error = parse_error(SMALL.replace("  barrier full[2]\n", "").replace(
        "  }\n}", "  }\n  barrier full[2]\n}"))
    assert error.detail == ("unexpected `barrier`; expected a statement or `}`; `smem` and then "
                            "`barrier` declarations come first in the kernel body")


@pytest.mark.parametrize("old, new, position, detail", [
    ("tile.exp x, x", "tile.expp x, x", (6, 5),
     "unknown tile op `tile.expp`; expected `tile.neg`, `tile.exp`, `tile.exp2`, `tile.log`, "
     "`tile.relu`, `tile.gelu`, `tile.silu`, `tile.sigmoid`, `tile.tanh`, `tile.cast`, `tile.exp2_ftz`, "
     "`tile.add`, `tile.sub`, `tile.mul`, `tile.div`, `tile.maximum`, `tile.minimum`, `tile.lt`, "
     "`tile.le`, `tile.gt`, `tile.ge`, `tile.eq`, `tile.ne`, `tile.logical_and` or `tile.logical_or`; "
     "did you mean `tile.exp`?"),
    ("tile.exp x, x", "tile.exp x, x, x", (6, 5), "`tile.exp` takes one operand: `tile.exp dst, src`"),
    ("tile.exp x, x", "tile.add x, x", (6, 5), "`tile.add` takes two operands: `tile.add dst, lhs, rhs`"),
    ("tile.exp x, x", "tile.reduce.mean x, x, axis(1)", (6, 5),
     "unknown reduction `tile.reduce.mean`; expected `tile.reduce.sum` or `tile.reduce.max`; "
     "did you mean `tile.reduce.max`?"),
    ("serial", "sequential", (3, 12),
     "unknown loop kind `sequential`; expected `serial`, `persistent`, `unroll` or `dynamic`; "
     "did you mean `serial`?"),
    ("tile.exp x, x", "setmaxnreg.add 40", (6, 5),
     "unknown instruction `setmaxnreg.add`; expected `setmaxnreg.inc` or `setmaxnreg.dec`; "
     "did you mean `setmaxnreg.dec`?"),
    ("tile.exp x, x", "wgmma.mma x, A[s], B[s] major(k, m) accumulate(1)", (6, 38),
     "unknown wgmma major `m`; expected `k` or `n`"),
    ("phase(s & 1)", "phase(select(s, 1))", (4, 33), "`select` takes 3 arguments, not 2"),
    ("phase(s & 1)", "phase(cdiv(s, 2))", (4, 33),
     "unknown function `cdiv`; expected `min`, `max`, `ceil_div`, `bit_length` or `select`; "
     "did you mean `ceil_div`?"),
])
def test_semantic_errors_name_the_token(old, new, position, detail):
    error = parse_error(SMALL.replace(old, new))
    assert (error.line, error.column) == position
    assert error.detail == detail
    assert str(error).startswith(f"line {position[0]}, column {position[1]}: {detail}\n")
    assert str(error).endswith(" " * (position[1] + 1) + "^")


def test_error_source_name_and_long_line_excerpt():
    text = "kernel k(" + ", ".join(f"i32 n{i}" for i in range(30)) + ") grid(1) cluster(1, 1) {\n}\n"
    with pytest.raises(IRParseError) as info:
        parse_kernel(text, "long.ir")
    message = str(info.value)
    column = text.index(") {") + 1
    assert message.startswith(f"long.ir, line 1, column {column}: unexpected `)`; expected `,`\n")
    source, caret = message.splitlines()[1:]
    assert source.startswith("  ...") and len(source) <= 110
    assert source[caret.index("^")] == ")"


def test_parse_expr_errors():
    with pytest.raises(IRParseError, match=r"^line 1, column 4: unexpected end of input; "
                                           r"expected an expression\n"):
        parse_expr("a +")
    with pytest.raises(IRParseError, match=r"unexpected `x`; expected `inf`, a float or an integer"):
        parse_expr("-x")  # the IR has no negation node: only literals are negative


def test_nesting_up_to_the_limits_round_trips_and_one_more_level_is_an_error():
    from wsched.lowering.verify.types import MAX_BLOCK_DEPTH, MAX_EXPRESSION_DEPTH

    def text(expr_depth: int, block_depth: int) -> str:
        e = "1" + " + 1" * expr_depth
        return (f"kernel k() grid({e}) cluster(1, 1, 1) {{\n" + f"if {e} {{\n" * block_depth + f"let x = {e}\n"
                + "}\n" * (block_depth + 1))
    deepest = parse_kernel(text(MAX_EXPRESSION_DEPTH, MAX_BLOCK_DEPTH))
    assert parse_kernel(print_kernel(deepest)) == deepest
    with pytest.raises(IRParseError, match=rf"^line 1, column \d+: expression nested more than {MAX_EXPRESSION_DEPTH} "
                                           r"operators deep; bind parts of it to names with `let`\n"):
        parse_kernel(text(MAX_EXPRESSION_DEPTH + 1, 0))
    with pytest.raises(IRParseError, match=rf"^line {MAX_BLOCK_DEPTH + 2}, column \d+: blocks nested more than "
                                           rf"{MAX_BLOCK_DEPTH} deep"):
        parse_kernel(text(1, MAX_BLOCK_DEPTH + 1))


def test_integer_literals_are_64_bit():
    assert parse_expr(str(2**63 - 1)) == ir.IntConst(2**63 - 1)
    assert parse_expr(str(-2**63)) == ir.IntConst(-2**63)
    with pytest.raises(IRParseError, match=r"^line 1, column 1: integer literal 9223372036854775808 does not fit "
                                           r"in 64 bits"):
        parse_expr(str(2**63))


def test_text_must_be_a_str():
    from wsched.errors import ArgumentError
    with pytest.raises(ArgumentError, match=r"^text=b'kernel' \(bytes\): expected the IR text \(a str\)$"):
        parse_kernel(b"kernel")


# ---------------------------------------------------------------------------------------------
# Hypothesis: random kernels round-trip
# ---------------------------------------------------------------------------------------------

# Name pools. `inf` and `nan` are literals in expressions and `scalar` marks a tile operand;
# other keywords are fine as names (the lexer is contextual), so some are mixed in. Register
# tiles and smem buffers never share a name: a bare wgmma A operand is resolved by declaration.
VALUE_NAMES = ("i", "k0", "n_tiles", "wg", "cta_id", "_t", "for", "let", "min", "serial", "tile")
TILE_NAMES = ("acc", "p", "bias_t", "reg", "role")
SMEM_NAMES = ("A", "B", "C", "smem", "Kv")
BARRIER_NAMES = ("full", "empty", "barrier")
TENSOR_NAMES = ("a", "b", "c", "global", "out")
ROLE_NAMES = ("producer", "consumer", "role")

names = st.sampled_from(VALUE_NAMES)
small_ints = st.integers(0, 512)
signed_ints = st.integers(-4, 512)
dtypes = st.sampled_from(ir.DTYPES)

leaves = st.one_of(
    st.builds(ir.IntConst, st.integers(-2**40, 2**40)),
    st.builds(ir.FloatConst, st.floats(allow_nan=False)),
    st.just(ir.FloatConst(math.nan)),
    st.builds(ir.Var, names),
)


def _extend(children):
    binops = st.builds(ir.BinOp, st.sampled_from(sorted(ir.BINARY_PRECEDENCE)), children, children)
    calls = [st.tuples(*[children] * arity).map(functools.partial(ir.Call, func))
             for func, arity in sorted(ir.CALLS.items())]
    return st.one_of(binops, *calls)


def nested(base, extend, depth: int):
    """Trees up to `depth` levels of `extend` over `base` (much faster to draw than
    st.recursive, which dominated the test's time)."""
    strategy = base
    for _ in range(depth):
        strategy = st.one_of(base, extend(strategy))
    return strategy


# Kernels get shallow expressions; the expression round trip gets deep ones.
exprs = nested(leaves, _extend, depth=2)
deep_exprs = nested(leaves, _extend, depth=5)


def expr_tuples(min_size=0, max_size=3):
    return st.lists(exprs, min_size=min_size, max_size=max_size).map(tuple)


def int_tuples(min_size=0, max_size=4):
    return st.lists(small_ints, min_size=min_size, max_size=max_size).map(tuple)


bar_refs = st.builds(ir.BarRef, st.sampled_from(BARRIER_NAMES), exprs)


def smem_refs(buffers=SMEM_NAMES, min_size=0):
    return st.builds(ir.SmemRef, st.sampled_from(buffers), expr_tuples(min_size, 2))


tile_names = st.sampled_from(TILE_NAMES)
tile_operands = st.one_of(tile_names, exprs)


@functools.cache
def simple_statements(declared_smem: tuple[str, ...]):
    # A bare smem name as wgmma's A operand is only a buffer if the kernel declares it.
    mma_a = [tile_names, smem_refs(min_size=1)]
    if declared_smem:
        mma_a.append(smem_refs(declared_smem, min_size=0))
    majors = st.sampled_from(ir.MMA_MAJORS)
    return st.one_of(
        st.builds(ir.Let, names, exprs, st.booleans()),
        st.builds(ir.Assign, names, exprs),
        st.just(ir.Return()),
        st.builds(ir.Setmaxnreg, st.sampled_from(ir.SETMAXNREG_ACTIONS), small_ints),
        st.builds(ir.MbarrierInit, st.sampled_from(BARRIER_NAMES), small_ints),
        st.builds(ir.MbarrierArrive, bar_refs),
        st.builds(ir.MbarrierArriveExpectTx, bar_refs, exprs),
        st.builds(ir.MbarrierWait, bar_refs, exprs),
        st.builds(ir.MbarrierInval, st.sampled_from(BARRIER_NAMES)),
        st.just(ir.FenceMbarrierInit()),
        st.just(ir.FenceProxyAsync()),
        st.just(ir.SyncThreads()),
        st.builds(ir.NamedBarrierSync, exprs, small_ints),
        st.builds(ir.NamedBarrierArrive, exprs, small_ints),
        st.builds(ir.TmaLoad, smem_refs(), st.sampled_from(TENSOR_NAMES), expr_tuples(), bar_refs),
        st.builds(ir.TmaStore, st.sampled_from(TENSOR_NAMES), expr_tuples(), smem_refs()),
        st.just(ir.TmaCommit()),
        st.builds(ir.TmaWait, small_ints, st.booleans()),
        st.just(ir.WgmmaFence()),
        st.builds(ir.Wgmma, tile_names, st.one_of(*mma_a), smem_refs(), majors, majors, exprs),
        st.just(ir.WgmmaCommit()),
        st.builds(ir.WgmmaWait, small_ints),
        st.builds(ir.RegDecl, tile_names, dtypes, int_tuples()),
        st.builds(ir.TileFill, tile_names, exprs),
        st.builds(ir.TileUnary, st.sampled_from(ir.TILE_UNARY_OPS), tile_names, tile_names),
        st.builds(ir.TileBinary, st.sampled_from(ir.TILE_BINARY_OPS), tile_names, tile_operands,
                  tile_operands),
        st.builds(ir.TileReduce, st.sampled_from(ir.REDUCE_OPS), tile_names, tile_names,
                  signed_ints),
        st.builds(ir.TileLoadGlobal, tile_names, st.sampled_from(TENSOR_NAMES), expr_tuples()),
        st.builds(ir.TileStoreGlobal, st.sampled_from(TENSOR_NAMES), expr_tuples(), tile_names,
                  st.none() | exprs),
        st.builds(ir.TileStoreSmem, smem_refs(), tile_names),
        # attention score functions
        st.builds(ir.TileIota, tile_names, signed_ints, exprs),
        st.builds(ir.TileSelect, tile_names, tile_operands, tile_operands, tile_operands),
    )


@functools.cache
def statements(declared_smem: tuple[str, ...]):
    def nest(children):
        blocks = st.lists(children, max_size=3).map(tuple)
        return st.one_of(
            st.builds(ir.For, names, exprs, exprs, exprs, st.sampled_from(ir.LOOP_KINDS), blocks),
            st.builds(ir.If, exprs, blocks, blocks),
            st.builds(ir.Role, st.sampled_from(ROLE_NAMES), small_ints, small_ints, blocks),
            st.builds(ir.ElectOne, blocks),
        )
    return nested(simple_statements(declared_smem), nest, depth=3)


params = st.one_of(
    st.builds(ir.ScalarParam, names, dtypes),
    st.builds(ir.TensorMapParam, st.sampled_from(TENSOR_NAMES), dtypes, expr_tuples(1, 3),
              int_tuples(1, 3), st.sampled_from((0, 32, 64, 128))),
    st.builds(ir.GlobalParam, st.sampled_from(TENSOR_NAMES), dtypes, expr_tuples(0, 3)),
)


@st.composite
def kernels(draw):
    smem_names = draw(st.lists(st.sampled_from(SMEM_NAMES), unique=True, max_size=3))
    smem = tuple(ir.SmemDecl(n, draw(dtypes), draw(int_tuples(1, 4)), draw(st.sampled_from((0, 128))))
                 for n in smem_names)
    barriers = tuple(ir.BarrierDecl(n, draw(small_ints))
                     for n in draw(st.lists(st.sampled_from(BARRIER_NAMES), unique=True, max_size=2)))
    return ir.Kernel(
        name=draw(st.sampled_from(("gemm", "kernel", "k_1"))),
        params=tuple(draw(st.lists(params, max_size=4))),
        grid=draw(exprs),
        cluster=draw(st.tuples(small_ints, small_ints, small_ints)),
        smem=smem,
        barriers=barriers,
        body=tuple(draw(st.lists(statements(tuple(smem_names)), max_size=8))),
    )


@settings(max_examples=200, deadline=None)
@given(deep_exprs)
def test_random_expressions_round_trip(expr):
    text = print_expr(expr)
    assert parse_expr(text) == expr
    assert print_expr(parse_expr(text)) == text


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kernels())
def test_random_kernels_round_trip(kernel):
    text = print_kernel(kernel)
    parsed = parse_kernel(text)
    assert parsed == kernel
    assert print_kernel(parsed) == text


# ---------------------------------------------------------------------------------------------
# docs/ir.md stays true
# ---------------------------------------------------------------------------------------------


def test_docs_example_kernels_print_back_to_themselves():
    blocks = re.findall(r"```ir\n(.*?)```", DOC.read_text(), flags=re.S)
    assert blocks, "docs/ir.md has no ```ir example"
    for block in blocks:
        assert print_kernel(parse_kernel(block)) == block


def test_docs_table_spells_every_statement():
    """Each table row `| Node | `spelling` | meaning |` whose node is a statement: the spelling,
    inside a kernel, parses to that node and prints back to itself (a block on one line)."""
    rows = re.findall(r"^\| (\w+) \| (.+?) \| .+ \|$", DOC.read_text(), flags=re.M)
    by_name = {t.__name__: t for t in ir.STMT_TYPES}
    seen = set()
    for node, cell in rows:
        if node not in by_name:
            continue
        for spelling in re.findall(r"`([^`]+)`", cell):
            text = f"kernel k() grid(1) cluster(1, 1, 1) {{\n  {spelling}\n}}\n"
            (stmt,) = parse_kernel(text).body
            assert type(stmt).__name__ == node, spelling
            assert " ".join(line.strip() for line in print_stmt(stmt).splitlines()) == spelling
        seen.add(node)
    assert seen == set(by_name), f"docs/ir.md has no row for {sorted(set(by_name) - seen)}"
