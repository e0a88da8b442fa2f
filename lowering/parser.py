"""Parse the loop IR's text form (docs/ir.md) back into `ir` dataclasses.

`parse_kernel(print_kernel(k)) == k` for every kernel: this is how users hand-edit lowered IR
and how golden files are checked. The grammar (grammar.lark) is LALR(1) without conflicts
(tests/test_ir_text.py checks the tables); a lark Transformer builds the nodes while parsing, and
checks what the grammar cannot spell (tile op names, loop kinds, setmaxnreg actions, wgmma
majors, call names and arity), integer literals beyond 64 bits, and nesting deeper than the
verifier's limits (`MAX_EXPRESSION_DEPTH`, `MAX_BLOCK_DEPTH`: the later stages walk the IR
recursively). Every problem is an `IRParseError` that names the line and column, what was found,
what would be right, and shows the source line with a caret; text that is not a `str` is an
`ArgumentError`.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import re
import threading
from pathlib import Path
from typing import Iterable, Iterator

from lark import Lark, Token, Transformer, v_args
from lark.exceptions import UnexpectedCharacters, UnexpectedInput, UnexpectedToken

from wsched.errors import check_argument
from wsched.lowering import ir
from wsched.lowering.spelling import SETMAXNREG_PREFIX, SPELLINGS, TILE_OP_PREFIX, TILE_REDUCE_PREFIX
from wsched.lowering.verify.types import INT_LITERAL_BITS, MAX_BLOCK_DEPTH, MAX_EXPRESSION_DEPTH

GRAMMAR_PATH = Path(__file__).with_name("grammar.lark")


class IRParseError(ValueError):
    """Text that is not loop IR. `line` and `column` are 1-based; `detail` is the message
    without the position and the source excerpt."""

    def __init__(self, detail: str, line: int, column: int, text: str, source_name: str = ""):
        self.detail = detail
        self.line = line
        self.column = column
        where = f"{source_name}, line {line}, column {column}" if source_name else \
            f"line {line}, column {column}"
        super().__init__(f"{where}: {detail}\n{_excerpt(text, line, column)}")


def parse_kernel(text: str, source_name: str = "") -> ir.Kernel:
    """The kernel that `text` spells. `source_name` (a file name) prefixes error positions."""
    return _parse(text, "kernel", source_name)


def parse_expr(text: str) -> ir.Expr:
    """One expression, e.g. `ceil_div(K, 64) - 1`."""
    return _parse(text, "expr", "")


# ---------------------------------------------------------------------------------------------
# Parsing and error reports
# ---------------------------------------------------------------------------------------------


class _SemanticError(Exception):
    """Raised while parsing, by the transformer or the word check, at a token; `_parse` turns it
    into an IRParseError with the source text."""

    def __init__(self, detail: str, token: Token):
        super().__init__(detail)
        self.detail = detail
        self.line = token.line
        self.column = token.column


# The depth of every operator and call built during the parse running on this thread (operators
# on the longest path down to a leaf), keyed by id: the node is kept alive beside its depth so
# that no id is reused meanwhile.
_DEPTHS = threading.local()


def _parse(text: str, start: str, source_name: str):
    check_argument("text", text, str, "the IR text (a str)")
    check_argument("source_name", source_name, str, "a file name for error positions (a str)")
    _DEPTHS.table = {}
    try:
        return _lark().parse(text, start=start)
    except _SemanticError as e:
        raise IRParseError(e.detail, e.line, e.column, text, source_name) from None
    except UnexpectedInput as e:
        detail, line, column = _describe_syntax_error(e, text)
        raise IRParseError(detail, line, column, text, source_name) from None
    finally:
        _DEPTHS.table = {}


@functools.cache
def _lark() -> Lark:
    """The one parser instance (building the LALR tables takes a while; parsing is fast)."""
    return build_lark()


def build_lark(**options) -> Lark:
    """A fresh parser for the IR grammar (tests build one to inspect the LALR tables)."""
    return Lark(GRAMMAR_PATH.read_text(), parser="lalr", lexer="contextual",
                start=["kernel", "expr"], maybe_placeholders=True,
                transformer=_ToIR(), postlex=_TokenChecks(), **options)


class _TokenChecks:
    """Checks on the token stream, before the parser sees it: whole words and block depth."""

    always_accept: tuple[str, ...] = ()

    def process(self, stream: Iterator[Token]) -> Iterator[Token]:
        return _limit_block_depth(_whole_words(stream))


def _whole_words(stream: Iterator[Token]) -> Iterator[Token]:
    """Rejects a keyword or number glued to the next word: with a contextual lexer, `letx = 1`
    would otherwise lex as `let x = 1` and `tma.loads` as `tma.load s`."""
    previous = None
    for token in stream:
        if (previous is not None and previous.end_pos == token.start_pos
                and _is_word_char(previous[-1:]) and _is_word_char(token[:1])):
            word = previous + _WORD.match(token).group()
            raise _SemanticError(f"unknown word `{word}`{_did_you_mean(word, _keywords())}",
                                 previous)
        previous = token
        yield token


def _limit_block_depth(stream: Iterator[Token]) -> Iterator[Token]:
    """Rejects a block opened deeper than MAX_BLOCK_DEPTH inside the kernel's own braces (the
    token stream is flat, so this needs no recursion however deep the text goes)."""
    depth = 0
    for token in stream:
        if token.type == "LBRACE":
            depth += 1
            if depth > MAX_BLOCK_DEPTH + 1:
                raise _SemanticError(f"blocks nested more than {MAX_BLOCK_DEPTH} deep; the IR allows at most "
                                     f"{MAX_BLOCK_DEPTH} levels of statements inside the kernel", token)
        elif token.type == "RBRACE":
            depth -= 1
        yield token


_WORD = re.compile(r"\w+(?:\.\w+)*")


def _is_word_char(text: str) -> bool:
    return bool(text) and (text.isalnum() or text == "_")


def _describe_syntax_error(e: UnexpectedInput, text: str) -> tuple[str, int, int]:
    if isinstance(e, UnexpectedToken):
        token = e.token
        if token.type == "$END":
            found = "end of input"
            # lark places $END on the last token; the error is just after it.
            line = token.end_line or token.line
            column = token.end_column or token.column
        else:
            found = f"`{_word_at(text, token.start_pos) or token}`"
            line, column = token.line, token.column
        expected = e.expected
    elif isinstance(e, UnexpectedCharacters):
        found = f"character `{text[e.pos_in_stream]}`"
        line, column = e.line, e.column
        expected = e.allowed or set()
    else:
        return str(e), getattr(e, "line", 1), getattr(e, "column", 1)
    # Nothing expected: the text parsed completely before this token (`1)` as an expression).
    spellings = _expected_spellings(_accepted_terminals(e) or expected) or ["end of input"]
    detail = f"unexpected {found}; expected {_alternatives(spellings)}"
    word = found.strip("`")
    if word in ("smem", "barrier"):
        detail += "; `smem` and then `barrier` declarations come first in the kernel body"
    elif found.startswith("`") and word not in _keywords():
        detail += _did_you_mean(word, [s.strip("`") for s in _terminal_spellings(expected)])
    return detail, line, column


def _accepted_terminals(e: UnexpectedInput) -> set[str]:
    """The terminals that really continue the text at the error. The LALR state's own set is
    wider (states with the same items share their lookaheads), so ask the parser by trying each;
    an empty set where that is not possible."""
    try:
        return set(e.interactive_parser.accepts())
    except Exception:  # no parser state attached, or a trial reduction met a semantic error
        return set()


def _word_at(text: str, pos: int) -> str:
    """The whole dotted word starting at `pos` (`tma.loda`, where lark saw the name `tma`)."""
    match = _WORD.match(text, pos)
    return match.group() if match else ""


# Readable spellings of the terminals that are not a fixed string.
_PATTERN_SPELLINGS = {
    "NAME": "a name",
    "INT": "an integer",
    "FLOAT": "a float",
    "DTYPE": "a dtype (" + ", ".join(ir.DTYPES) + ")",
    "SETMAXNREG": " / ".join(f"`{k}`" for k in SPELLINGS[ir.Setmaxnreg].keywords()),
    "TILE_OP": f"a tile op (`{TILE_OP_PREFIX}add`, `{TILE_OP_PREFIX}exp`, ...)",
    "TILE_REDUCE": f"`{TILE_REDUCE_PREFIX}<op>`",
    "$END": "end of input",
}


def _terminal_spelling(name: str) -> str:
    if name in _PATTERN_SPELLINGS:
        return _PATTERN_SPELLINGS[name]
    if name not in _lark()._terminals_dict:
        # lark's own names: the contextual lexer reports the end of input as `<END-OF-FILE>`
        return "end of input" if "END" in name else name
    pattern = _lark().get_terminal(name).pattern
    return f"`{pattern.value}`" if pattern.type == "str" else name


def _terminal_spellings(names: Iterable[str]) -> list[str]:
    """Fixed spellings in alphabetical order, then descriptions (`a name`, `an integer`)."""
    return sorted((_terminal_spelling(n) for n in names),
                  key=lambda s: (not s.startswith("`"), s.strip("`")))


def _expected_spellings(names: Iterable[str]) -> list[str]:
    """Spellings of the expected terminals; where all terminals that can start a statement (or
    an expression) are among them, the one phrase "a statement" ("an expression") replaces them."""
    names = set(names)
    phrases = []
    for phrase, first in (("a statement", _first_terminals("stmt")),
                          ("an expression", _first_terminals("atom"))):
        if first <= names:
            phrases.append(phrase)
            names -= first
    return phrases + _terminal_spellings(names)


@functools.cache
def _first_terminals(rule_name: str) -> frozenset[str]:
    """The terminals that begin some alternative of a rule whose alternatives all begin with a
    terminal (`stmt` and `atom` are written that way)."""
    firsts = {r.expansion[0] for r in _lark().rules if r.origin.name == rule_name}
    assert all(s.is_term for s in firsts), rule_name
    return frozenset(s.name for s in firsts)


@functools.cache
def _keywords() -> tuple[str, ...]:
    """Every fixed word of the grammar (`let`, `mbarrier.wait`, `swizzle`, ...)."""
    return tuple(sorted(t.pattern.value for t in _lark().terminals
                        if t.pattern.type == "str" and _is_word_char(t.pattern.value[:1])))


def _did_you_mean(word: str, candidates: Iterable[str]) -> str:
    close = difflib.get_close_matches(word, [c for c in candidates if c != word], n=1)
    return f"; did you mean `{close[0]}`?" if close else ""


def _alternatives(items: list[str]) -> str:
    if len(items) <= 1:
        return "".join(items) or "nothing"
    return ", ".join(items[:-1]) + " or " + items[-1]


_EXCERPT_WIDTH = 100


def _excerpt(text: str, line: int, column: int) -> str:
    """The source line with a caret under `column`; a long line (a kernel header) is cut to a
    window around the column."""
    lines = text.splitlines()
    source = lines[line - 1] if 0 < line <= len(lines) else ""
    offset = column - 1
    if len(source) > _EXCERPT_WIDTH:
        start = max(0, min(offset - _EXCERPT_WIDTH // 2, len(source) - _EXCERPT_WIDTH))
        prefix = "..." if start > 0 else ""
        suffix = "..." if start + _EXCERPT_WIDTH < len(source) else ""
        source = prefix + source[start:start + _EXCERPT_WIDTH] + suffix
        offset += len(prefix) - start
    # Keep tabs in the padding so the caret lines up under tab-indented text.
    padding = "".join(c if c == "\t" else " " for c in source[:offset])
    return f"  {source}\n  {padding}^"


# ---------------------------------------------------------------------------------------------
# Tree → dataclasses
# ---------------------------------------------------------------------------------------------


def _present(items) -> tuple:
    """Children of an optional list: lark passes None for an absent `[...]`."""
    return tuple(i for i in items if i is not None)


def _check_one_of(value: str, allowed: Iterable[str], what: str, token: Token,
                  spell=lambda v: v) -> None:
    allowed = tuple(allowed)
    if value not in allowed:
        spellings = [f"`{spell(a)}`" for a in allowed]
        raise _SemanticError(f"unknown {what} `{spell(value)}`; expected {_alternatives(spellings)}"
                             f"{_did_you_mean(spell(value), map(spell, allowed))}", token)


def _tile_op(op: str) -> str:
    return TILE_OP_PREFIX + op


@v_args(inline=True)
class _ToIR(Transformer):
    """Builds `ir` nodes bottom-up; one method per grammar rule or alias."""

    # --- kernel -----------------------------------------------------------------------------
    def kernel(self, name, params, grid, cx, cy, cz, smem, barriers, body):
        smem_names = frozenset(d.name for d in smem)
        return ir.Kernel(str(name), params, grid, (cx, cy, cz), smem, barriers,
                         _resolve_mma_operands(body, smem_names))

    def params(self, *params):
        return _present(params)

    def scalar_param(self, dtype, name):
        return ir.ScalarParam(str(name), str(dtype))

    def host_param(self, dtype, name, value):
        return ir.HostParam(str(name), str(dtype), value)

    def workspace_param(self, name, dtype, shape, zeroed, fragments):
        return ir.WorkspaceParam(str(name), str(dtype), shape, zeroed is not None, fragments is not None)

    def tensormap_param(self, name, dtype, shape, box, swizzle):
        return ir.TensorMapParam(str(name), str(dtype), shape, box, swizzle)

    def global_param(self, name, dtype, shape):
        return ir.GlobalParam(str(name), str(dtype), shape)

    def span_param(self, name, dtype, shape, query, key, rows, cols):
        return ir.SpanParam(str(name), str(dtype), shape, str(query), str(key), rows, cols)

    def smem_decls(self, *decls):
        return decls

    def smem_decl(self, name, dtype, shape, swizzle):
        return ir.SmemDecl(str(name), str(dtype), shape, swizzle)

    def barrier_decls(self, *decls):
        return decls

    def barrier_decl(self, name, slots):
        return ir.BarrierDecl(str(name), slots)

    # --- structure ------------------------------------------------------------------------
    def block(self, stmts):
        return stmts

    def stmts(self, *stmts):
        return stmts

    def let(self, name, value):
        return ir.Let(str(name), value)

    def let_mutable(self, name, value):
        return ir.Let(str(name), value, mutable=True)

    def assign(self, name, value):
        return ir.Assign(str(name), value)

    def for_loop(self, var, iteration, start, stop, step, body):
        _check_one_of(iteration, ir.LOOP_KINDS, "loop kind", iteration)
        return ir.For(str(var), start, stop, step, str(iteration), body)

    def if_else(self, cond, then, orelse):
        return ir.If(cond, then, orelse or ())

    def role(self, name, warpgroups, registers, body):
        return ir.Role(str(name), warpgroups, registers, body)

    def elect_one(self, body):
        return ir.ElectOne(body)

    def return_stmt(self):
        return ir.Return()

    def setmaxnreg(self, keyword, registers):
        action = keyword.removeprefix(SETMAXNREG_PREFIX)
        _check_one_of(action, ir.SETMAXNREG_ACTIONS, "instruction", keyword,
                      spell=lambda a: SETMAXNREG_PREFIX + a)
        return ir.Setmaxnreg(action, registers)

    # --- synchronisation --------------------------------------------------------------------
    def mbarrier_init(self, barrier, arrivals):
        return ir.MbarrierInit(str(barrier), arrivals)

    def mbarrier_arrive(self, bar, cta):
        return ir.MbarrierArrive(bar, cta)

    def mbarrier_arrive_expect_tx(self, bar, nbytes):
        return ir.MbarrierArriveExpectTx(bar, nbytes)

    def mbarrier_wait(self, bar, phase):
        return ir.MbarrierWait(bar, phase)

    def mbarrier_inval(self, barrier):
        return ir.MbarrierInval(str(barrier))

    def fence_mbarrier_init(self):
        return ir.FenceMbarrierInit()

    def fence_proxy_async(self):
        return ir.FenceProxyAsync()

    def syncthreads(self):
        return ir.SyncThreads()

    def cluster_sync(self):
        return ir.ClusterSync()

    def named_barrier_sync(self, barrier_id, threads):
        return ir.NamedBarrierSync(barrier_id, threads)

    def named_barrier_arrive(self, barrier_id, threads):
        return ir.NamedBarrierArrive(barrier_id, threads)

    # --- asynchronous copies ----------------------------------------------------------------
    def tma_load(self, dst, row, tensor, coords, bar, multicast):
        return ir.TmaLoad(dst, str(tensor), coords, bar, row, multicast)

    def tma_store(self, tensor, coords, src):
        return ir.TmaStore(str(tensor), coords, src)

    def tma_commit(self):
        return ir.TmaCommit()

    def tma_wait(self, pending):
        return ir.TmaWait(pending, read=False)

    def tma_wait_read(self, pending):
        return ir.TmaWait(pending, read=True)

    # --- wgmma ------------------------------------------------------------------------------
    def wgmma_fence(self):
        return ir.WgmmaFence()

    def wgmma(self, acc, a, b, a_major, b_major, accumulate):
        for major in (a_major, b_major):
            _check_one_of(major, ir.MMA_MAJORS, "wgmma major", major)
        # A bare name here may be a register tile; `kernel` turns smem buffer names back.
        a_operand = a if a.index else a.buffer
        return ir.Wgmma(str(acc), a_operand, b, str(a_major), str(b_major), accumulate)

    def wgmma_commit(self):
        return ir.WgmmaCommit()

    def wgmma_wait(self, pending):
        return ir.WgmmaWait(pending)

    # --- register tiles ---------------------------------------------------------------------
    def reg_decl(self, name, dtype, shape, layout):
        return ir.RegDecl(str(name), str(dtype), shape, "fragment" if layout is None else str(layout))

    def tile_fill(self, dst, value):
        return ir.TileFill(str(dst), value)

    def tile_unary(self, keyword, dst, src):
        op = keyword.removeprefix(TILE_OP_PREFIX)
        if op in ir.TILE_BINARY_OPS:
            raise _SemanticError(f"`{keyword}` takes two operands: `{keyword} dst, lhs, rhs`",
                                 keyword)
        _check_one_of(op, ir.TILE_UNARY_OPS + ir.TILE_BINARY_OPS, "tile op", keyword, spell=_tile_op)
        return ir.TileUnary(op, str(dst), str(src))

    def tile_binary(self, keyword, dst, lhs, rhs):
        op = keyword.removeprefix(TILE_OP_PREFIX)
        if op in ir.TILE_UNARY_OPS:
            raise _SemanticError(f"`{keyword}` takes one operand: `{keyword} dst, src`", keyword)
        _check_one_of(op, ir.TILE_UNARY_OPS + ir.TILE_BINARY_OPS, "tile op", keyword, spell=_tile_op)
        return ir.TileBinary(op, str(dst), lhs, rhs)

    def tile_name(self, name):
        return str(name)

    def tile_scalar(self, value):
        return value

    def tile_reduce(self, keyword, dst, src, axis):
        op = keyword.removeprefix(TILE_REDUCE_PREFIX)
        _check_one_of(op, ir.REDUCE_OPS, "reduction", keyword,
                      spell=lambda o: TILE_REDUCE_PREFIX + o)
        return ir.TileReduce(op, str(dst), str(src), axis)

    def tile_mask(self, dst, row0, col0, limit, causal=None, period=None, lower=None):
        return ir.TileMask(str(dst), row0, col0, limit, causal, period, lower)

    def tile_load(self, dst, tensor, coords):
        return ir.TileLoadGlobal(str(dst), str(tensor), coords)

    def tile_store(self, tensor, coords, src, row_limit=None):
        return ir.TileStoreGlobal(str(tensor), coords, str(src), row_limit)

    def tile_store_smem(self, dst, src):
        return ir.TileStoreSmem(dst, str(src))

    # --- sliced epilogues and split-K -------------------------------------------------------
    def tile_view(self, name, src, col0, cols):
        return ir.TileView(str(name), str(src), col0, cols)

    def fence_gpu(self):
        return ir.FenceGpu()

    def atomic_inc(self, dst, tensor, coords, wrap):
        return ir.AtomicInc(dst, str(tensor), coords, wrap)

    def load_shared(self, name, src):
        return ir.LoadShared(str(name), src)

    # --- attention score functions -----------------------------------------------------------
    def tile_iota(self, dst, axis, start):
        return ir.TileIota(str(dst), axis, start)

    def tile_select(self, dst, cond, on_true, on_false):
        return ir.TileSelect(str(dst), cond, on_true, on_false)

    # --- paged KV caches ---------------------------------------------------------------------
    def load_global(self, name, tensor, coords):
        return ir.LoadGlobal(str(name), str(tensor), coords)

    # --- references -------------------------------------------------------------------------
    def smem_ref(self, buffer, *index):
        return ir.SmemRef(str(buffer), _present(index))

    def bar_ref(self, barrier, index):
        return ir.BarRef(str(barrier), index)

    # --- expressions ------------------------------------------------------------------------
    def binop(self, lhs, op, rhs):
        return _within_depth(ir.BinOp(str(op), lhs, rhs), (lhs, rhs), op)

    def cmp_op(self, op):
        return op

    shift_op = sum_op = product_op = cmp_op

    def variable(self, name):
        return ir.Var(str(name))

    def int_const(self, digits):
        return ir.IntConst(_int_literal(digits))

    def negative_int_const(self, digits):
        return ir.IntConst(_int_literal(digits, -1))

    def float_const(self, text):
        return ir.FloatConst(float(text))

    def negative_float_const(self, text):
        return ir.FloatConst(-float(text))

    def inf_const(self):
        return ir.FloatConst(math.inf)

    def negative_inf_const(self):
        return ir.FloatConst(-math.inf)

    def nan_const(self):
        # The one nan object: FloatConst compares its field with ==, which nan only passes
        # through identity.
        return ir.FloatConst(math.nan)

    def call(self, func, args):
        _check_one_of(func, tuple(ir.CALLS), "function", func)
        if len(args) != ir.CALLS[func]:
            raise _SemanticError(f"`{func}` takes {ir.CALLS[func]} arguments, not {len(args)}", func)
        return _within_depth(ir.Call(str(func), args), args, func)

    def exprs(self, *exprs):
        return _present(exprs)

    def ints(self, *ints):
        return _present(ints)

    def integer(self, digits):
        return _int_literal(digits)

    def negative_integer(self, digits):
        return _int_literal(digits, -1)


def _int_literal(digits: Token, sign: int = 1) -> int:
    """The value of an integer literal; one beyond 64 bits is an error at its token (Python
    would take it, the emitted CUDA could not)."""
    limit = 2 ** (INT_LITERAL_BITS - 1)
    if len(digits) > 20 or not -limit <= sign * int(digits) < limit:
        shown = digits if len(digits) <= 24 else f"{digits[:10]}...{digits[-10:]} ({len(digits)} digits)"
        raise _SemanticError(f"integer literal {'-' if sign < 0 else ''}{shown} does not fit in "
                             f"{INT_LITERAL_BITS} bits", digits)
    return sign * int(digits)


def _within_depth(node: ir.Expr, operands, token: Token) -> ir.Expr:
    """`node`, recording its depth; an IRParseError at `token` where it exceeds the limit."""
    table = _DEPTHS.__dict__.setdefault("table", {})   # a parser built by build_lark() skips _parse
    depth = 1 + max((table[id(x)][1] for x in operands if id(x) in table), default=0)
    if depth > MAX_EXPRESSION_DEPTH:
        raise _SemanticError(f"expression nested more than {MAX_EXPRESSION_DEPTH} operators deep; bind parts "
                             f"of it to names with `let`", token)
    table[id(node)] = (node, depth)
    return node


def _resolve_mma_operands(body: tuple[ir.Stmt, ...], smem_names: frozenset[str]):
    """`wgmma.mma acc, A, B` spells a whole smem buffer `A` and a register tile `A` alike; a name
    the kernel declares with `smem` is the buffer."""
    def resolve(stmt):
        if isinstance(stmt, ir.Wgmma) and isinstance(stmt.a, str) and stmt.a in smem_names:
            return dataclasses.replace(stmt, a=ir.SmemRef(stmt.a, ()))
        if isinstance(stmt, ir.If):
            return dataclasses.replace(stmt, then=resolve_all(stmt.then),
                                       orelse=resolve_all(stmt.orelse))
        if isinstance(stmt, (ir.For, ir.Role, ir.ElectOne)):
            return dataclasses.replace(stmt, body=resolve_all(stmt.body))
        return stmt

    def resolve_all(stmts):
        return tuple(resolve(s) for s in stmts)

    return resolve_all(body) if smem_names else body
