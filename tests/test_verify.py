"""The verifier: a correct warp-specialized matmul verifies cleanly, and each rule broken on its
own gives the message that names the IR line, what is wrong and what would be right.

The kernels are built with the ir constructors; `edit(kernel, path, new)` replaces one statement
(a traversal path, as in the diagnostics), which keeps every other line number. Every expected
line number is also checked against `print_kernel`'s text by `problems()`.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

import wsched as ws

from wsched.lowering import ir
from wsched.lowering.parser import parse_kernel
from wsched.lowering.printer import print_kernel
from wsched.lowering.verify import (
    Diagnostic, VerifyError, children, statement_at, statement_lines, verify, verify_all,
)

V, C = ir.Var, ir.IntConst
S = V("s")


def full(index=S):
    return ir.BarRef("full", index)


def empty(index=S):
    return ir.BarRef("empty", index)


def counter_lets():
    """it = local tile index × k_tiles + k; stage and phase from it (4 stages)."""
    return (
        ir.Let("it", ir.add(ir.mul(ir.div(ir.sub("tile", "cta_id"), "num_ctas"), "k_tiles"), "k")),
        ir.Let("s", ir.mod("it", 4)),
        ir.Let("ph", ir.band(ir.div("it", 4), 1)),
    )


def raster_lets():
    return (ir.Let("m0", ir.mul(ir.div("tile", "n_tiles"), 128)),
            ir.Let("n0", ir.mul(ir.mod("tile", "n_tiles"), 256)))


def tile_loop(body):
    return ir.For("tile", V("cta_id"), V("num_tiles"), V("num_ctas"), "persistent", raster_lets() + body)


def k_loop(body):
    return ir.For("k", C(0), V("k_tiles"), C(1), "serial", counter_lets() + body)


def producer(warpgroups=1, registers=40):
    return ir.Role("producer", warpgroups, registers, (
        ir.Setmaxnreg("dec", registers),
        ir.ElectOne((tile_loop((k_loop((
            ir.MbarrierWait(empty(), ir.BinOp("^", V("ph"), C(1))),
            ir.MbarrierArriveExpectTx(full(), C(49152)),
            ir.TmaLoad(ir.SmemRef("A", (S,)), "a", (V("m0"), ir.mul("k", 64)), full()),
            ir.TmaLoad(ir.SmemRef("B", (S,)), "b", (V("n0"), ir.mul("k", 64)), full()),
        )),)),)),
        ir.Return(),
    ))


MMA = ir.Wgmma("acc", ir.SmemRef("A", (S, V("wg"))), ir.SmemRef("B", (S,)), "k", "k", ir.BinOp(">", V("k"), C(0)))


def consumer_k_body():
    """Wait for the stage, multiply, wait for the wgmma, release the stage."""
    return (
        ir.MbarrierWait(full(), V("ph")),
        ir.WgmmaFence(),
        MMA,
        ir.WgmmaCommit(),
        ir.WgmmaWait(0),
        ir.MbarrierArrive(empty()),
    )


def consumer(k_body=None, after_k=(), warpgroups=2, registers=232):
    return ir.Role("consumer", warpgroups, registers, (
        ir.Setmaxnreg("inc", registers),
        ir.RegDecl("acc", "f32", (64, 256)),
        ir.RegDecl("out", "bf16", (64, 256)),
        tile_loop((k_loop(consumer_k_body() if k_body is None else k_body),) + after_k + (
            ir.TileUnary("cast", "out", "acc"),
            ir.TileStoreGlobal("c", (ir.add("m0", ir.mul("wg", 64)), V("n0")), "out"),
        )),
    ))


def matmul(roles=None, smem=None, barriers=None, params=None, setup=None) -> ir.Kernel:
    """A persistent warp-specialized bf16 matmul: 128x256x64 tiles, 4 stages, one producer
    warpgroup (an elected thread issues the TMA loads), two consumer warpgroups (64 rows each)."""
    params = params or (
        ir.ScalarParam("M", "i32"), ir.ScalarParam("N", "i32"), ir.ScalarParam("K", "i32"),
        ir.TensorMapParam("a", "bf16", (V("M"), V("K")), (128, 64), 128),
        ir.TensorMapParam("b", "bf16", (V("N"), V("K")), (256, 64), 128),
        ir.GlobalParam("c", "bf16", (V("M"), V("N"))),
    )
    smem = smem or (ir.SmemDecl("A", "bf16", (4, 2, 64, 64), 128), ir.SmemDecl("B", "bf16", (4, 256, 64), 128))
    barriers = barriers or (ir.BarrierDecl("full", 4), ir.BarrierDecl("empty", 4))
    setup = setup or (
        ir.Let("num_tiles", ir.mul(ir.ceil_div("M", 128), ir.ceil_div("N", 256))),
        ir.Let("n_tiles", ir.ceil_div("N", 256)),
        ir.Let("k_tiles", ir.ceil_div("K", 64)),
        ir.MbarrierInit("full", 1),
        ir.MbarrierInit("empty", 2),
        ir.FenceMbarrierInit(),
        ir.SyncThreads(),
    )
    grid = ir.emin("num_sms", ir.mul(ir.ceil_div("M", 128), ir.ceil_div("N", 256)))
    return ir.Kernel("matmul", params, grid, (1, 1, 1), smem, barriers,
                     setup + (roles or (producer(), consumer())))


def pipelined_k_body(release_first=False, prev=None):
    """One wgmma group stays in flight: iteration k releases the stage of iteration k - 1."""
    prev = prev if prev is not None else ir.mod(ir.sub("it", 1), 4)
    release = ir.If(ir.BinOp(">", V("k"), C(0)), (ir.Let("prev_s", prev), ir.MbarrierArrive(empty(V("prev_s")))))
    wait = ir.WgmmaWait(1)
    return (ir.MbarrierWait(full(), V("ph")), ir.WgmmaFence(), MMA, ir.WgmmaCommit()) + (
        (release, wait) if release_first else (wait, release))


def pipelined_tail():
    last = ir.mod(ir.sub(ir.add(ir.mul(ir.div(ir.sub("tile", "cta_id"), "num_ctas"), "k_tiles"), "k_tiles"), 1), 4)
    return (ir.WgmmaWait(0), ir.Let("last_s", last), ir.MbarrierArrive(empty(V("last_s"))))


def pipelined_matmul() -> ir.Kernel:
    return matmul(roles=(producer(), consumer(pipelined_k_body(), pipelined_tail())))


# --- paths of the fixture's statements (line numbers in the printed IR in comments) ----------
PRODUCER = (7,)                       # line 13
PRODUCER_K = (7, 1, 0, 2)             # line 19: for k
PRODUCER_WAIT = PRODUCER_K + (3,)     # line 23: mbarrier.wait empty[s] phase(ph ^ 1)
EXPECT_TX = PRODUCER_K + (4,)         # line 24
LOAD_A = PRODUCER_K + (5,)            # line 25
LOAD_B = PRODUCER_K + (6,)            # line 26
CONSUMER = (8,)                       # line 32
CONSUMER_TILE = (8, 3)                # line 36
CONSUMER_K = (8, 3, 2)                # line 39
CONSUMER_WAIT = CONSUMER_K + (3,)     # line 43: mbarrier.wait full[s] phase(ph)
WGMMA = CONSUMER_K + (5,)             # line 45
WGMMA_WAIT = CONSUMER_K + (7,)        # line 47
RELEASE = CONSUMER_K + (8,)           # line 48: mbarrier.arrive empty[s]
CAST = CONSUMER_TILE + (3,)           # line 50
STORE = CONSUMER_TILE + (4,)          # line 51

SAMPLE = "M=256, N=384, K=320, cta_id=0, num_ctas=2"


def edit(kernel: ir.Kernel, path, new) -> ir.Kernel:
    """`kernel` with the statement at `path` replaced by `new`."""
    def rebuild(stmts, path):
        i, rest = path[0], path[1:]
        if not rest:
            return stmts[:i] + (new,) + stmts[i + 1:]
        s = stmts[i]
        if isinstance(s, ir.If):
            then, orelse = s.then, s.orelse
            if rest[0] < len(then):
                s = replace(s, then=rebuild(then, rest))
            else:
                s = replace(s, orelse=rebuild(orelse, (rest[0] - len(then),) + rest[1:]))
        else:
            s = replace(s, body=rebuild(s.body, rest))
        return stmts[:i] + (s,) + stmts[i + 1:]
    return replace(kernel, body=rebuild(kernel.body, path))


def problems(kernel: ir.Kernel, contract: bool = True) -> list[str]:
    """The messages, after checking that each names the line print_kernel gives its statement."""
    text = print_kernel(kernel).splitlines()
    found = verify_all(kernel, contract=contract)
    for d in found:
        if d.path:
            keyword = d.message.split("(", 1)[1].split(")")[0].split(" > ")[-1].split()[0]
            assert text[d.line - 1].strip().startswith(keyword), (d.message, text[d.line - 1])
    return [d.message for d in found]


# ---------------------------------------------------------------------------------------------
# Correct kernels and line numbers
# ---------------------------------------------------------------------------------------------


def test_correct_matmul_verifies():
    verify(matmul())
    assert problems(matmul()) == []


def test_pipelined_matmul_verifies():
    assert problems(pipelined_matmul()) == []


def test_statement_lines_follow_the_printer():
    k = pipelined_matmul()
    k = edit(k, STORE, ir.If(V("k_tiles"), (ir.Return(),), (ir.WgmmaFence(), ir.ElectOne(()))))
    text = print_kernel(k).splitlines()
    lines = statement_lines(k)

    def visit(stmts, prefix):
        for i, s in enumerate(stmts):
            path = prefix + (i,)
            head = text[lines[path] - 1].strip()
            assert head.startswith(ir_keyword(s)), (path, head)
            visit(children(s), path)

    visit(k.body, ())
    assert len(lines) == sum(1 for _ in ir.walk(k.body))
    assert text[lines[STORE] - 1].strip() == "if k_tiles {"
    assert text[lines[STORE + (0,)] - 1].strip() == "return"
    assert text[lines[STORE + (1,)] - 1].strip() == "wgmma.fence"      # the else block follows then
    assert text[lines[STORE + (1,)] - 2].strip() == "} else {"
    assert statement_at(k, STORE + (2,)) == ir.ElectOne(())
    assert text[lines[STORE + (2,)]].strip() == "}"                    # an empty block still closes


def ir_keyword(s) -> str:
    from wsched.lowering.printer import print_stmt
    return print_stmt(s).split()[0]


def test_fixture_paths_point_at_their_lines():
    lines = statement_lines(matmul())
    assert [lines[p] for p in (PRODUCER, PRODUCER_K, PRODUCER_WAIT, EXPECT_TX, LOAD_A, LOAD_B, CONSUMER,
                               CONSUMER_TILE, CONSUMER_K, CONSUMER_WAIT, WGMMA, WGMMA_WAIT, RELEASE, CAST,
                               STORE)] == [13, 19, 23, 24, 25, 26, 32, 36, 39, 43, 45, 47, 48, 50, 51]


def test_every_statement_kind_is_checked():
    from wsched.lowering.verify.structure import StructureCheck
    assert [t.__name__ for t in ir.STMT_TYPES if not hasattr(StructureCheck, "_" + t.__name__)] == []


def test_verify_raises_with_every_diagnostic():
    k = edit(matmul(), EXPECT_TX, ir.MbarrierArriveExpectTx(full(), C(32768)))
    k = edit(k, CAST, ir.SyncThreads())
    with pytest.raises(VerifyError) as info:
        verify(k)
    assert isinstance(info.value, ValueError)
    assert [d.line for d in info.value.diagnostics] == [24, 50]
    assert str(info.value) == "\n".join(d.message for d in info.value.diagnostics)
    assert all(isinstance(d, Diagnostic) for d in info.value.diagnostics)
    assert info.value.diagnostics[0].path == EXPECT_TX


def with_smem(index, decl):
    smem = list(matmul().smem)
    smem[index] = decl
    return matmul(smem=tuple(smem))


def with_param(index, param, smem=None):
    params = list(matmul().params)
    params[index] = param
    return matmul(params=tuple(params), smem=smem)


def with_consumer_tile(decl, *edits):
    """The matmul with `reg out` replaced by `decl` and (path, statement) edits applied."""
    k = edit(matmul(), CONSUMER + (2,), decl)
    for path, stmt in edits:
        k = edit(k, path, stmt)
    return k


def appended(kernel, *stmts):
    return replace(kernel, body=kernel.body + stmts)


WHERE_K = "role consumer > for tile > for k"
WHERE_TILE = "role consumer > for tile"
WHERE_LOAD = "role producer > elect_one > for tile > for k"
NAMES = "expressions read scalar params, builtins (cta_id, num_ctas, wg inside a role), loop variables and the lets/vars of enclosing blocks"
UNIQUE = "(names are unique in the IR); rename one of them"
NOT_VISIBLE = "the barrier inits are not visible to the roles yet; after the last mbarrier.init put `fence.mbarrier_init` and then `syncthreads`"
ELEMENTWISE = "an elementwise op keeps the shape"
NOT_INITIALISED = "barrier `empty` is never initialised; add `mbarrier.init empty arrivals(n)` at kernel level before the roles"
INIT_AFTER_USE = "barrier `empty` is used before its mbarrier.init; initialise every barrier at kernel level before the roles"


def no_empty_init():
    return edit(matmul(), (4,), ir.FenceMbarrierInit())


# ---------------------------------------------------------------------------------------------
# Structural checks (verify(..., contract=False) runs only these)
# ---------------------------------------------------------------------------------------------

STRUCTURAL = [
    # names and scopes
    pytest.param(lambda: edit(matmul(), CONSUMER_K + (1,), ir.Let("s", ir.mod("itt", 4))), [
        f"IR line 41 ({WHERE_K} > let s): `itt` is not declared; {NAMES}",
    ], id="undeclared-name"),
    pytest.param(lambda: edit(matmul(), CONSUMER_K + (0,), ir.Let("it", ir.add("s", 1))), [
        f"IR line 40 ({WHERE_K} > let it): `s` is used before its declaration (let at IR line 41); declare it before this statement",
    ], id="name-used-before-its-let"),
    pytest.param(lambda: edit(matmul(), STORE, ir.TileStoreGlobal("c", (ir.add("m0", "it"), V("n0")), "out")), [
        f"IR line 51 ({WHERE_TILE} > tile.store): `it` is declared at IR line 40 ({WHERE_K} > let it), which does not enclose this statement; declare it in this block or an enclosing one",
    ], id="name-out-of-its-block"),
    pytest.param(lambda: edit(matmul(), (1,), ir.Let("n_tiles", ir.add(ir.ceil_div("N", 256), ir.mul("wg", 0)))), [
        "IR line 7 (let n_tiles): `wg` (the warpgroup index) exists only inside a role; move this statement into a role or use a constant",
    ], id="wg-outside-a-role"),
    pytest.param(lambda: edit(matmul(), (0,), ir.Let("num_tiles", V("num_sms"))), [
        "IR line 6 (let num_tiles): `num_sms` is host-side and may appear only in the grid; inside the kernel use num_ctas (gridDim.x)",
    ], id="num_sms-in-the-kernel"),
    pytest.param(lambda: replace(matmul(), grid=V("num_tiles")), [
        "IR line 1 (kernel matmul > grid): the grid reads `num_tiles`; host-side expressions may read scalar params (and num_sms in the grid) only",
    ], id="grid-reads-a-let"),
    pytest.param(lambda: edit(matmul(), CAST, ir.Assign("m0", C(0))), [
        f"IR line 50 ({WHERE_TILE} > set m0): `set m0` updates a let (immutable, IR line 37); declare it with `var m0 = ...` to update it",
    ], id="set-of-a-let"),
    pytest.param(lambda: edit(matmul(), CAST, ir.Assign("tile", C(0))), [
        f"IR line 50 ({WHERE_TILE} > set tile): `set tile` updates a loop variable; only a `var` can be updated",
    ], id="set-of-a-loop-variable"),
    pytest.param(lambda: edit(matmul(), CAST, ir.Assign("x", C(0))), [
        f"IR line 50 ({WHERE_TILE} > set x): `set x` updates an undeclared name; declare it first with `var x = ...`",
    ], id="set-of-an-undeclared-name"),
    pytest.param(lambda: edit(matmul(), CAST, ir.Let("k_tiles", C(1))), [
        f"IR line 50 ({WHERE_TILE} > let k_tiles): `k_tiles` is already declared as a let at IR line 8 {UNIQUE}",
    ], id="let-shadows-a-let"),
    pytest.param(lambda: edit(matmul(), CAST, ir.For("tile", C(0), C(1), C(1), "serial", ())), [
        f"IR line 50 ({WHERE_TILE} > for tile): `tile` is already declared as a loop variable at IR line 36 {UNIQUE}",
    ], id="loop-shadows-a-loop"),
    pytest.param(lambda: edit(matmul(), CAST, ir.Let("cta_id", C(1))), [
        f"IR line 50 ({WHERE_TILE} > let cta_id): `cta_id` is a builtin name; choose another name for the let",
    ], id="let-shadows-a-builtin"),
    pytest.param(lambda: matmul(smem=matmul().smem + (ir.SmemDecl("K", "bf16", (1, 64, 64), 0),)), [
        f"IR line 4 (smem K): `K` is already declared as a scalar param at IR line 1 {UNIQUE}",
    ], id="smem-named-like-a-param"),
    pytest.param(lambda: matmul(params=matmul().params + (ir.ScalarParam("wg", "i32"),)), [
        "IR line 1 (kernel matmul > scalar wg): `wg` is a builtin name; rename the scalar param",
    ], id="param-named-like-a-builtin"),
    pytest.param(lambda: matmul(params=matmul().params + (ir.WorkspaceParam("parts", "bf16", (V("M"), V("N")), fragments=True),
                                                         ir.WorkspaceParam("row", "f32", (V("N"),), fragments=True))), [
        "IR line 1 (kernel matmul > global parts): a fragments workspace holds 4-byte elements (f32, i32) in matrices "
        "(rank >= 2); parts is bf16 of rank 2: drop `fragments` or declare it f32[..., rows, cols]",
        "IR line 1 (kernel matmul > global row): a fragments workspace holds 4-byte elements (f32, i32) in matrices "
        "(rank >= 2); row is f32 of rank 1: drop `fragments` or declare it f32[..., rows, cols]",
    ], id="fragments-workspace-of-2-byte-elements-or-no-rows"),
    pytest.param(lambda: edit(matmul(), CAST, ir.Let("x", ir.Call("min", (C(1),)))), [
        f"IR line 50 ({WHERE_TILE} > let x): min() takes 2 arguments, not 1",
    ], id="call-arity"),
    pytest.param(lambda: edit(matmul(), CAST, ir.For("j", C(0), C(4), C(0), "parallel", ())), [
        f"IR line 50 ({WHERE_TILE} > for j): loop kind `parallel` is not one of serial, persistent, unroll, dynamic",
        f"IR line 50 ({WHERE_TILE} > for j): step 0: a loop counts up; use a step >= 1",
    ], id="loop-kind-and-step"),
    # references
    pytest.param(lambda: edit(matmul(), WGMMA, replace(MMA, b=ir.SmemRef("Bx", (S,)))), [
        f"IR line 45 ({WHERE_K} > wgmma.mma): buffer `Bx` is not a declared smem buffer (declared: A, B)",
    ], id="unknown-smem-buffer"),
    pytest.param(lambda: edit(matmul(), CONSUMER_WAIT, ir.MbarrierWait(ir.BarRef("fulll", S), V("ph"))), [
        f"IR line 43 ({WHERE_K} > mbarrier.wait): barrier `fulll` is not a declared barrier (declared: full, empty)",
    ], id="unknown-barrier"),
    pytest.param(lambda: edit(matmul(), LOAD_A, ir.TmaLoad(ir.SmemRef("A", (S,)), "a", (V("m0"), ir.mul("k", 64)), ir.BarRef("A", S))), [
        f"IR line 25 ({WHERE_LOAD} > tma.load): barrier `A` is a smem buffer, not a barrier (declared: full, empty)",
    ], id="tma-bar-is-not-a-barrier"),
    pytest.param(lambda: edit(matmul(), LOAD_A, ir.TmaLoad(ir.SmemRef("A", (S,)), "x", (V("m0"), ir.mul("k", 64)), full())), [
        f"IR line 25 ({WHERE_LOAD} > tma.load): tma.load uses `x`, which is not a kernel parameter; declare it as `tensormap x: dtype[shape] box(...) swizzle(...)`",
    ], id="tma-unknown-tensor"),
    pytest.param(lambda: edit(matmul(), LOAD_A, ir.TmaLoad(ir.SmemRef("A", (S,)), "c", (V("m0"), ir.mul("k", 64)), full())), [
        f"IR line 25 ({WHERE_LOAD} > tma.load): tma.load needs a tensormap param, but `c` is a global param; declare it as `tensormap c: ...`",
    ], id="tma-tensor-is-not-a-tensormap"),
    pytest.param(lambda: edit(matmul(), STORE, ir.TileStoreGlobal("a", (V("m0"), V("n0")), "out")), [
        f"IR line 51 ({WHERE_TILE} > tile.store): tensor `a` is a tensormap param, not a global param (declared: c)",
    ], id="tile-store-to-a-tensormap"),
    pytest.param(lambda: with_consumer_tile(ir.WgmmaFence(), (CAST, ir.TileUnary("cast", "out", "acc")), (STORE, ir.RegDecl("out", "bf16", (64, 256)))), [
        f"IR line 50 ({WHERE_TILE} > tile.cast): `out` is used before its declaration (register tile at IR line 51); declare it before this statement",
    ], id="tile-used-before-its-reg"),
    pytest.param(lambda: edit(matmul(), PRODUCER + (2,), ir.TileFill("acc", ir.FloatConst(0.0))), [
        "IR line 30 (role producer > tile.fill): register tile `acc` belongs to role consumer (IR line 34); register tiles are per warpgroup and visible only inside the role that declares them",
    ], id="tile-outside-its-role"),
    pytest.param(lambda: edit(matmul(), CAST, ir.TileUnary("cast", "foo", "acc")), [
        f"IR line 50 ({WHERE_TILE} > tile.cast): `foo` is not a register tile; declare it in this role with `reg foo: f32[rows, cols]`",
    ], id="unknown-tile"),
    # barrier initialisation
    pytest.param(lambda: appended(no_empty_init(), ir.MbarrierInit("empty", 2)), [
        f"IR line 23 ({WHERE_LOAD} > mbarrier.wait): {INIT_AFTER_USE}",
        f"IR line 48 ({WHERE_K} > mbarrier.arrive): {INIT_AFTER_USE}",
    ], id="barrier-used-before-init"),
    pytest.param(lambda: edit(matmul(), CAST, ir.MbarrierInit("empty", 2)), [
        f"IR line 50 ({WHERE_TILE} > mbarrier.init): mbarrier.init inside role consumer; barriers are initialised at kernel level (by thread 0) before the roles",
    ], id="init-inside-a-role"),
    pytest.param(lambda: edit(matmul(), (3,), ir.MbarrierInit("full", 0)), [
        "IR line 9 (mbarrier.init): arrivals(0): an mbarrier phase needs at least 1 arrival; count the arrive operations of one phase",
    ], id="init-with-no-arrivals"),
    pytest.param(lambda: edit(matmul(), (3,), ir.MbarrierInit("full", 2**20)), [
        "IR line 9 (mbarrier.init): arrivals(1048576): an mbarrier phase counts at most 1048575 arrivals",
    ], id="init-with-too-many-arrivals"),
    pytest.param(lambda: edit(matmul(), (5,), ir.MbarrierInit("full", 1)), [
        "IR line 11 (mbarrier.init): barrier `full` is initialised twice (first at IR line 9); initialise it once",
        f"IR line 13 (role producer): {NOT_VISIBLE}",
    ], id="init-twice"),
    pytest.param(lambda: edit(matmul(), (6,), ir.FenceProxyAsync()), [
        f"IR line 13 (role producer): {NOT_VISIBLE}",
    ], id="inits-not-fenced-and-synced"),
    # registers and threads
    pytest.param(lambda: edit(matmul(), CONSUMER + (0,), ir.Setmaxnreg("inc", 230)), [
        "IR line 33 (role consumer > setmaxnreg.inc): setmaxnreg 230: the register count must be a multiple of 8 in [24, 256]",
        "IR line 33 (role consumer > setmaxnreg.inc): setmaxnreg.inc 230 in role consumer registers(232); the role's budget and its setmaxnreg must agree: use setmaxnreg.inc 232 (or registers(230))",
    ], id="setmaxnreg-not-a-multiple-of-8"),
    pytest.param(lambda: edit(matmul(), CONSUMER + (0,), ir.Setmaxnreg("inc", 240)), [
        "IR line 33 (role consumer > setmaxnreg.inc): setmaxnreg.inc 240 in role consumer registers(232); the role's budget and its setmaxnreg must agree: use setmaxnreg.inc 232 (or registers(240))",
    ], id="setmaxnreg-differs-from-role"),
    pytest.param(lambda: appended(matmul(), ir.Setmaxnreg("dec", 40)), [
        "IR line 54 (setmaxnreg.dec): setmaxnreg outside a role; it belongs at the start of a role's body",
    ], id="setmaxnreg-outside-a-role"),
    pytest.param(lambda: matmul(roles=(producer(), consumer(registers=240))), [
        "IR line 1 (kernel matmul): register budget exceeded: role producer 1×128×40 + role consumer 2×128×240 = 66560 registers, 2048 over the 64512 a CTA of 384 threads holds (setmaxnreg.inc would wait forever); lower the registers of a role, e.g. role consumer registers(232)",
    ], id="register-budget"),
    pytest.param(lambda: matmul(roles=(producer(registers=20), consumer())), [
        "IR line 13 (role producer): registers(20): a role's register count must be a multiple of 8 in [24, 256] (what setmaxnreg can set)",
        "IR line 14 (role producer > setmaxnreg.dec): setmaxnreg 20: the register count must be a multiple of 8 in [24, 256]",
    ], id="role-registers-out-of-range"),
    pytest.param(lambda: matmul(roles=(producer(), consumer(warpgroups=8, registers=56))), [
        "IR line 1 (kernel matmul): the roles add up to 1152 threads (9 warpgroups); a CTA has at most 1024 threads (8 warpgroups)",
    ], id="too-many-threads"),
    # CTA and named barriers
    pytest.param(lambda: edit(matmul(), CAST, ir.SyncThreads()), [
        f"IR line 50 ({WHERE_TILE} > syncthreads): syncthreads inside role consumer waits for the threads of every role (deadlock); synchronise the participating warpgroups with a named barrier `bar.sync id, threads` with id >= 1",
    ], id="syncthreads-inside-a-role"),
    pytest.param(lambda: edit(matmul(), CAST, ir.NamedBarrierSync(C(0), 128)), [
        f"IR line 50 ({WHERE_TILE} > bar.sync): bar.sync 0: barrier id 0 is outside [1, 15] (id 0 is the barrier syncthreads uses); use ids 1..15",
    ], id="named-barrier-id-0"),
    pytest.param(lambda: edit(matmul(), CAST, ir.NamedBarrierSync(ir.add(15, "wg"), 128)), [
        f"IR line 50 ({WHERE_TILE} > bar.sync): bar.sync 15 + wg: barrier id 16 for wg = 1 is outside [1, 15] (id 0 is the barrier syncthreads uses); use ids 1..15",
    ], id="named-barrier-id-per-warpgroup"),
    pytest.param(lambda: edit(matmul(), CAST, ir.NamedBarrierArrive(ir.add(1, "wg"), 96)), [
        f"IR line 50 ({WHERE_TILE} > bar.arrive): bar.arrive 1 + wg, 96: the thread count must be a multiple of 128 (whole warpgroups inside a role)",
    ], id="named-barrier-partial-warpgroup"),
    pytest.param(lambda: edit(matmul(), CAST, ir.NamedBarrierSync(C(1), 512)), [
        f"IR line 50 ({WHERE_TILE} > bar.sync): bar.sync 1, 512: more threads than the block has (384); count only the participating threads",
    ], id="named-barrier-larger-than-the-block"),
    # shared memory
    pytest.param(lambda: edit(matmul(), WGMMA, replace(MMA, a=ir.SmemRef("A", (S, V("wg"), C(0), C(0))))), [
        f"IR line 45 ({WHERE_K} > wgmma.mma): `A[s, wg, 0, 0]` has 4 indices but A is bf16[4, 2, 64, 64] (rank 4); a reference selects a sub-array, so use at most 3",
    ], id="smem-ref-too-many-indices"),
    pytest.param(lambda: edit(matmul(), WGMMA, replace(MMA, a=ir.SmemRef("A", (S, C(2))))), [
        f"IR line 45 ({WHERE_K} > wgmma.mma): `A[s, 2]`: index 2 is out of range for dim 1 of A (extent 2); valid indices are 0..1",
    ], id="smem-ref-index-out-of-range"),
    pytest.param(lambda: edit(matmul(), RELEASE, ir.MbarrierArrive(empty(C(4)))), [
        f"IR line 48 ({WHERE_K} > mbarrier.arrive): `empty[4]`: barrier empty has 4 slots (0..3)",
    ], id="barrier-index-out-of-range"),
    pytest.param(lambda: matmul(smem=matmul().smem + (ir.SmemDecl("P", "f32", (2, 64, 128), 0),)), [
        "IR line 1 (kernel matmul): shared memory needs 264192 bytes (buffers, barriers and alignment), 31744 over the 232448 bytes (227 KB) a CTA can have; use fewer stages or smaller tiles",
    ], id="shared-memory-total"),
    # TMA
    pytest.param(lambda: edit(matmul(), LOAD_A, ir.TmaLoad(ir.SmemRef("A", (S,)), "a", (V("m0"),), full())), [
        f"IR line 25 ({WHERE_LOAD} > tma.load): tma.load a[m0] gives 1 coordinate but tensormap a is bf16[M, K] (rank 2); give one coordinate per dim, outermost first",
    ], id="tma-coordinate-count"),
    pytest.param(lambda: with_param(3, ir.TensorMapParam("a", "bf16", (V("M"), V("K")), (64, 64), 128)), [
        f"IR line 25 ({WHERE_LOAD} > tma.load): tma.load moves one box(64, 64) of bf16 = 8192 bytes but A[s] is bf16[2, 64, 64] = 16384 bytes; the smem sub-array must hold exactly one box",
    ], id="tma-box-bytes"),
    pytest.param(lambda: with_smem(0, ir.SmemDecl("A", "f16", (4, 2, 64, 64), 128)), [
        f"IR line 25 ({WHERE_LOAD} > tma.load): tma.load copies bf16 (tensormap a) into A, which is f16; TMA does not convert: declare A as bf16",
        f"IR line 45 ({WHERE_K} > wgmma.mma): B operand B[s] is bf16 but A is f16; both operands must have one dtype",
    ], id="tma-dtype"),
    pytest.param(lambda: with_smem(0, ir.SmemDecl("A", "bf16", (4, 2, 64, 64), 64)), [
        f"IR line 25 ({WHERE_LOAD} > tma.load): tensormap a has swizzle(128) but smem A has swizzle(64); TMA lays the box out with the map's swizzle, so both must agree",
    ], id="tma-swizzle-differs-from-smem"),
    pytest.param(lambda: with_param(3, ir.TensorMapParam("a", "bf16", (V("M"), V("K")), (64, 128), 128),
                                    smem=(ir.SmemDecl("A", "bf16", (4, 64, 128), 128), matmul().smem[1])), [
        "IR line 1 (kernel matmul > tensormap a): the box's inner dim is 128 bf16 = 256 bytes, more than the 128-byte swizzle span; use at most 64 bf16 per box row (store wider tiles as column chunks)",
        f"IR line 45 ({WHERE_K} > wgmma.mma): `A[s, wg]` is a bf16[128] sub-array, which holds no 2-D tile; select a [rows, cols] or (chunks, rows, width) sub-array",
    ], id="tma-swizzle-128-inner-box"),
    pytest.param(lambda: with_param(3, ir.TensorMapParam("a", "bf16", (V("M"), V("K")), (512, 7, 1), 48)), [
        "IR line 1 (kernel matmul > tensormap a): box(512, 7, 1) has 3 dims but the tensor has rank 2; give one box extent per dim",
        "IR line 1 (kernel matmul > tensormap a): box extent 512 is outside [1, 256], the range a TMA box allows",
        "IR line 1 (kernel matmul > tensormap a): swizzle(48) is not a TMA swizzle; use 0, 32, 64 or 128",
        "IR line 1 (kernel matmul > tensormap a): the box's inner dim is 1 bf16 = 2 bytes; TMA needs a multiple of 16 bytes",
        f"IR line 25 ({WHERE_LOAD} > tma.load): tma.load moves one box(512, 7, 1) of bf16 = 7168 bytes but A[s] is bf16[2, 64, 64] = 16384 bytes; the smem sub-array must hold exactly one box",
        f"IR line 25 ({WHERE_LOAD} > tma.load): tensormap a has swizzle(48) but smem A has swizzle(128); TMA lays the box out with the map's swizzle, so both must agree",
    ], id="tensormap-box-rules"),
    pytest.param(lambda: edit(matmul(), STORE, ir.TmaStore("a", (V("m0"), V("n0")), ir.SmemRef("B", (C(0),)))), [
        f"IR line 51 ({WHERE_TILE} > tma.store): tma.store moves one box(128, 64) of bf16 = 16384 bytes but B[0] is bf16[256, 64] = 32768 bytes; the smem sub-array must hold exactly one box",
    ], id="tma-store-box-bytes"),
    # wgmma
    pytest.param(lambda: edit(matmul(), CONSUMER + (1,), ir.RegDecl("acc", "f32", (64, 250))), [
        f"IR line 45 ({WHERE_K} > wgmma.mma): the accumulator acc is f32[64, 250]; wgmma accumulates into an f32[64, N] register tile with N a multiple of 8 in [8, 256]",
        f"IR line 50 ({WHERE_TILE} > tile.cast): tile.cast out, acc: acc is f32[64, 250] but out is bf16[64, 256]; {ELEMENTWISE}",
    ], id="wgmma-accumulator-width"),
    pytest.param(lambda: edit(matmul(), CONSUMER + (1,), ir.RegDecl("acc", "bf16", (64, 256))), [
        f"IR line 45 ({WHERE_K} > wgmma.mma): the accumulator acc is bf16[64, 256]; wgmma accumulates into an f32[64, N] register tile with N a multiple of 8 in [8, 256]",
    ], id="wgmma-accumulator-dtype"),
    pytest.param(lambda: with_smem(0, ir.SmemDecl("A", "bf16", (4, 2, 64, 8), 128)), [
        f"IR line 25 ({WHERE_LOAD} > tma.load): tma.load moves one box(128, 64) of bf16 = 16384 bytes but A[s] is bf16[2, 64, 8] = 2048 bytes; the smem sub-array must hold exactly one box",
        f"IR line 45 ({WHERE_K} > wgmma.mma): A operand A[s, wg] holds a [64, 8] tile; wgmma's A is [64, K] with K a multiple of 16",
    ], id="wgmma-k-not-a-multiple-of-16"),
    pytest.param(lambda: edit(matmul(), CONSUMER + (1,), ir.RegDecl("acc", "f32", (64, 128))), [
        f"IR line 45 ({WHERE_K} > wgmma.mma): B operand B[s] is [256, 64], a tile with N = 256 and K = 64, but the accumulator acc has N = 128 and A has K = 64; B must be [128, 64] (K-major: [N, K])",
        f"IR line 50 ({WHERE_TILE} > tile.cast): tile.cast out, acc: acc is f32[64, 128] but out is bf16[64, 256]; {ELEMENTWISE}",
    ], id="wgmma-b-k-major-shape"),
    pytest.param(lambda: edit(matmul(), WGMMA, replace(MMA, b_major="n")), [
        f"IR line 45 ({WHERE_K} > wgmma.mma): B operand B[s] is [256, 64], a tile with N = 64 and K = 256, but the accumulator acc has N = 256 and A has K = 64; B must be (4, 64, 64) (N-major column chunks)",
    ], id="wgmma-b-n-major-shape"),
    pytest.param(lambda: edit(matmul(), WGMMA, replace(MMA, a_major="m")), [
        f"IR line 45 ({WHERE_K} > wgmma.mma): major(m, k): a's major must be k or n",
    ], id="wgmma-major"),
    pytest.param(lambda: with_consumer_tile(ir.RegDecl("out", "f32", (64, 64)), (WGMMA, replace(MMA, a="out", a_major="n"))), [
        f"IR line 45 ({WHERE_K} > wgmma.mma): A from registers (out) is K-major; use major(k, k)",
        f"IR line 45 ({WHERE_K} > wgmma.mma): A operand out is f32; wgmma multiplies bf16 or f16",
        f"IR line 45 ({WHERE_K} > wgmma.mma): B operand B[s] is bf16 but A is f32; both operands must have one dtype",
        f"IR line 50 ({WHERE_TILE} > tile.cast): tile.cast out, acc: acc is f32[64, 256] but out is f32[64, 64]; {ELEMENTWISE}",
    ], id="wgmma-a-from-registers"),
    # tile ops
    pytest.param(lambda: with_consumer_tile(ir.RegDecl("out", "bf16", (64, 128))), [
        f"IR line 50 ({WHERE_TILE} > tile.cast): tile.cast out, acc: acc is f32[64, 256] but out is bf16[64, 128]; {ELEMENTWISE}",
    ], id="tile-unary-shape"),
    pytest.param(lambda: with_consumer_tile(ir.RegDecl("out", "bf16", (2, 256)), (CAST, ir.TileBinary("add", "acc", "acc", "out"))), [
        f"IR line 50 ({WHERE_TILE} > tile.add): tile.add acc: operands acc [64, 256], out [2, 256] do not broadcast to the result [64, 256]; each dim must equal the result's or be 1",
    ], id="tile-binary-broadcast"),
    pytest.param(lambda: with_consumer_tile(ir.RegDecl("out", "bf16", (64, 256)), (CAST, ir.TileBinary("mul", "acc", "out", ir.FloatConst(2.0))),
                                            (CONSUMER + (2,), ir.RegDecl("out", "bf16", (256,))), (STORE, ir.WgmmaFence())), [
        f"IR line 50 ({WHERE_TILE} > tile.mul): tile.mul acc: operands out [256] and result [64, 256] differ in rank; tiles of one op have one rank (extent 1 broadcasts)",
    ], id="tile-binary-rank"),
    pytest.param(lambda: edit(matmul(), CAST, ir.TileBinary("pow", "acc", "acc", ir.FloatConst(2.0))), [
        f"IR line 50 ({WHERE_TILE} > tile.pow): tile.pow is not a binary tile op; use one of add, sub, mul, div, maximum, minimum, "
        "lt, le, gt, ge, eq, ne, logical_and, logical_or",
    ], id="tile-binary-op"),
    pytest.param(lambda: edit(matmul(), CAST, ir.TileReduce("max", "out", "acc", 2)), [
        f"IR line 50 ({WHERE_TILE} > tile.reduce.max): axis(2) is out of range for acc [64, 256]; use 0..1",
    ], id="tile-reduce-axis"),
    pytest.param(lambda: edit(matmul(), CAST, ir.TileReduce("sum", "out", "acc", 1)), [
        f"IR line 50 ({WHERE_TILE} > tile.reduce.sum): tile.reduce.sum out, acc, axis(1): out is [64, 256] but reducing [64, 256] over axis 1 gives [64, 1]; declare out with that shape",
    ], id="tile-reduce-shape"),
    pytest.param(lambda: edit(matmul(), CAST, ir.TileStoreSmem(ir.SmemRef("B", (C(0),)), "out")), [
        f"IR line 50 ({WHERE_TILE} > tile.store_smem): tile.store_smem B[0] <- out: out is [64, 256] but B[0] ([256, 64]) holds a [256, 64] tile; the tile and the sub-array must have one shape",
    ], id="tile-store-smem-shape"),
    pytest.param(lambda: edit(matmul(), CAST, ir.TileLoadGlobal("out", "c", (V("m0"),))), [
        f"IR line 50 ({WHERE_TILE} > tile.load): tile.load c[m0] gives 1 coordinate but c is bf16[M, N] (rank 2); give one coordinate per dim",
    ], id="tile-load-coordinates"),
    # linear tiles (docs/ir.md, "Linear tiles")
    pytest.param(lambda: with_consumer_tile(ir.RegDecl("out", "bf16", (3, 256), "linear"), (CAST, ir.WgmmaFence())), [
        "IR line 35 (role consumer > reg out): reg out: bf16[3, 256] linear does not spread over the 128 threads of a warpgroup; a linear tile is [R, C] with R dividing 128 and R x C a multiple of 128 (each thread R C / 128 elements of one row), or [R, 1] (each row's value)",
    ], id="linear-tile-shape"),
    pytest.param(lambda: with_consumer_tile(ir.RegDecl("out", "bf16", (64, 256), "rows")), [
        "IR line 35 (role consumer > reg out): reg out: layout `rows` is not a register tile layout; write nothing (the wgmma fragment layout) or `linear`",
    ], id="reg-layout"),
    pytest.param(lambda: with_consumer_tile(ir.RegDecl("out", "bf16", (64, 256), "linear")), [
        f"IR line 50 ({WHERE_TILE} > tile.cast): tile.cast out, acc: the tiles lie in different layouts (out linear, acc fragment); an elementwise op combines tiles of one layout",
    ], id="linear-and-fragment-tiles"),
    pytest.param(lambda: edit(with_consumer_tile(ir.RegDecl("out", "f32", (64, 1), "linear")), CAST,
                              ir.TileReduce("max", "out", "acc", 1)), [
        f"IR line 50 ({WHERE_TILE} > tile.reduce.max): tile.reduce.max out, acc: out is a linear tile; this op works on tiles in the wgmma fragment layout (a linear tile takes tile.fill, tile.iota, the unary and binary ops, tile.load and tile.store)",
    ], id="linear-tile-reduced"),
    pytest.param(lambda: with_consumer_tile(ir.RegDecl("out", "bf16", (2, 64, 256)), (CAST, ir.WgmmaFence())), [
        f"IR line 51 ({WHERE_TILE} > tile.store): tile.store: tile out [2, 64, 256] does not fit c (rank 2); the tile covers the tensor's trailing dims, and its dims beyond the tensor's rank must be 1",
    ], id="tile-store-rank"),
]


@pytest.mark.parametrize("build, expected", STRUCTURAL)
def test_structural_check(build, expected):
    assert problems(build(), contract=False) == expected


def test_structural_checks_accept_partially_lowered_kernels():
    """Before insert_barriers: barriers declared and named by the loads but not initialised yet,
    no elect_one, no expect_tx, no wgmma protocol."""
    k = matmul()
    k = replace(k, body=k.body[:3] + k.body[7:])            # no inits, fence, syncthreads
    k = edit(k, (3, 1), ir.If(C(1), statement_at(k, (3, 1)).body))
    k = edit(k, (3, 1, 0, 2, 3), ir.WgmmaFence())              # no wait on empty
    k = edit(k, (3, 1, 0, 2, 4), ir.WgmmaFence())              # no expect_tx
    assert problems(k, contract=False) == []
    assert "barrier `full` is never initialised" in problems(k)[0]


def test_barrier_never_initialised_is_a_contract_problem():
    assert problems(no_empty_init(), contract=False) == []
    assert problems(no_empty_init()) == [
        f"IR line 23 ({WHERE_LOAD} > mbarrier.wait): {NOT_INITIALISED}",
        f"IR line 48 ({WHERE_K} > mbarrier.arrive): {NOT_INITIALISED}",
    ]


# ---------------------------------------------------------------------------------------------
# The load/compute contract
# ---------------------------------------------------------------------------------------------

WHERE_EXPECT = f"IR line 24 ({WHERE_LOAD} > mbarrier.arrive_expect_tx)"
NO_EXPECT_TX = "tma.load completes on full[s] but no `mbarrier.arrive_expect_tx full[s] bytes(...)` precedes it in this block; announce the stage's bytes on that barrier before the loads"
NOT_ELECTED = "tma.load outside elect_one would be issued by every thread of the warpgroup; put the producer's loads inside `elect_one { ... }`"
SAME_ORDER = "the load and compute nests must traverse the same (tile, k) order"
PENDING = "put `wgmma.wait 0` (or wait for that group) before the release"


def producer_unelected():
    k = matmul()
    return edit(k, PRODUCER + (1,), ir.If(C(1), statement_at(k, PRODUCER + (1,)).body))


def with_lets(kernel, base, *lets):
    """`kernel` with the counter lets of the k loop at `base` replaced (it, s, ph order)."""
    for i, let in lets:
        kernel = edit(kernel, base + (i,), let)
    return kernel


def pipelined(k_body=None, tail=None):
    return matmul(roles=(producer(), consumer(k_body or pipelined_k_body(), pipelined_tail() if tail is None else tail)))


CONTRACT = [
    # the producer's copies and expect_tx
    pytest.param(producer_unelected, [
        f"IR line 25 ({WHERE_LOAD.replace('elect_one', 'if')} > tma.load): {NOT_ELECTED}",
        f"IR line 26 ({WHERE_LOAD.replace('elect_one', 'if')} > tma.load): {NOT_ELECTED}",
    ], id="tma-load-outside-elect-one"),
    pytest.param(lambda: edit(matmul(), EXPECT_TX, ir.MbarrierArriveExpectTx(full(), C(32768))), [
        f"{WHERE_EXPECT}: expect_tx announces 32768 bytes but the loads into full[s] deliver 49152 (A[s] 16384 + B[s] 32768); use bytes(49152)",
    ], id="expect-tx-bytes"),
    pytest.param(lambda: with_param(3, ir.TensorMapParam("a", "bf16", (V("M"), V("K")), (64, 64), 128)), [
        f"{WHERE_EXPECT}: expect_tx announces 49152 bytes but the loads into full[s] deliver 40960 (A[s] 8192 + B[s] 32768); use bytes(40960)",
        f"IR line 25 ({WHERE_LOAD} > tma.load): tma.load moves one box(64, 64) of bf16 = 8192 bytes but A[s] is bf16[2, 64, 64] = 16384 bytes; the smem sub-array must hold exactly one box",
    ], id="expect-tx-counts-box-bytes"),
    pytest.param(lambda: edit(matmul(), EXPECT_TX, ir.MbarrierArriveExpectTx(full(), ir.mul("K", 2))), [
        f"{WHERE_EXPECT}: bytes(K * 2) is not a constant; TMA delivers whole boxes (out-of-bounds elements included), so announce their constant sum",
    ], id="expect-tx-bytes-not-constant"),
    pytest.param(lambda: edit(matmul(), EXPECT_TX, ir.FenceProxyAsync()), [
        f"IR line 25 ({WHERE_LOAD} > tma.load): {NO_EXPECT_TX}",
        f"IR line 26 ({WHERE_LOAD} > tma.load): {NO_EXPECT_TX}",
    ], id="tma-load-without-expect-tx"),
    pytest.param(lambda: edit(matmul(), EXPECT_TX, ir.MbarrierArriveExpectTx(full(ir.mod("it", 4)), C(49152))), [
        f"{WHERE_EXPECT}: expect_tx announces 49152 bytes but no tma.load into full[it % 4] follows it in this block; announce the bytes right before the loads",
        f"IR line 25 ({WHERE_LOAD} > tma.load): {NO_EXPECT_TX}",
        f"IR line 26 ({WHERE_LOAD} > tma.load): {NO_EXPECT_TX}",
    ], id="expect-tx-on-another-barrier-reference"),
    pytest.param(lambda: edit(matmul(), LOAD_B, ir.TmaLoad(ir.SmemRef("B", (V("ph"),)), "b", (V("n0"), ir.mul("k", 64)), full())), [
        f"IR line 26 ({WHERE_LOAD} > tma.load): tma.load B[ph] completes on full[s]: the barrier slot must be the destination's stage, full[ph]",
    ], id="load-stage-and-barrier-slot-differ"),
    pytest.param(lambda: edit(matmul(), PRODUCER_WAIT, ir.FenceProxyAsync()), [
        f"{WHERE_EXPECT}: the producer announces full[s] without first waiting for the stage to be free; put `mbarrier.wait empty[...] phase(ph ^ 1)` (producer_acquire) before it",
    ], id="producer-does-not-acquire"),
    # channel declarations and arrival counts
    pytest.param(lambda: matmul(barriers=(ir.BarrierDecl("full", 3), ir.BarrierDecl("empty", 4))), [
        "IR line 4 (barrier full): barrier full has 3 slots but its channel buffers A, B have 4 stages; a channel has one full and one empty barrier per stage: declare full[4]",
    ], id="barrier-slots-and-stages"),
    pytest.param(lambda: edit(matmul(), (3,), ir.MbarrierInit("full", 2)), [
        "IR line 9 (mbarrier.init): full is initialised with arrivals(2), but a full barrier's phase is completed by the one elected producer thread's arrive_expect_tx (plus the TMA bytes); use arrivals(1)",
    ], id="full-arrivals"),
    pytest.param(lambda: edit(matmul(), (4,), ir.MbarrierInit("empty", 1)), [
        "IR line 10 (mbarrier.init): empty is initialised with arrivals(1) but 2 consumer arrivals release each stage (role consumer: 2 warpgroups × 1 arrive); use arrivals(2)",
    ], id="empty-arrivals"),
    pytest.param(lambda: matmul(roles=(producer(), consumer(consumer_k_body() + (ir.MbarrierArrive(empty()),)))), [
        "IR line 10 (mbarrier.init): empty is initialised with arrivals(2) but 4 consumer arrivals release each stage (role consumer: 2 warpgroups × 2 arrives); use arrivals(4)",
    ], id="empty-arrivals-counts-every-arrive"),
    pytest.param(lambda: matmul(roles=(producer(warpgroups=2, registers=24), consumer())), [
        f"{WHERE_EXPECT}: 2 warpgroups (role producer wg 0, role producer wg 1) arrive on full for every stage; a full barrier is completed by one elected producer thread: issue the loads from one warpgroup",
    ], id="one-producer-per-full-barrier"),
    # the same traversal, stage and phase on both sides
    pytest.param(lambda: edit(matmul(), PRODUCER_WAIT, ir.MbarrierWait(empty(), V("ph"))), [
        f"IR line 23 ({WHERE_LOAD} > mbarrier.wait): at tile=0, k=0 ({SAMPLE}) the producer waits on empty stage 0 with phase(0), its 1st use of the stage; the parity must be 1, the consumer's phase 0 XOR 1 (the first pass through a stage is free, each later one waits for the previous release)",
    ], id="producer-phase-not-consumer-xor-1"),
    pytest.param(lambda: edit(matmul(), CONSUMER_WAIT, ir.MbarrierWait(full(), ir.BinOp("^", V("ph"), C(1)))), [
        f"IR line 43 ({WHERE_K} > mbarrier.wait): at wg=0, tile=0, k=0 ({SAMPLE}) the consumer waits on full stage 0 with phase(1), the 1st use of the stage, which completes phase 0; the parity must be 0 (phase = (it / S) & 1)",
    ], id="consumer-phase"),
    pytest.param(lambda: with_lets(with_lets(matmul(), CONSUMER_K, (2, ir.Let("ph", ir.band("it", 1)))), PRODUCER_K, (2, ir.Let("ph", ir.band("it", 1)))), [
        f"IR line 23 ({WHERE_LOAD} > mbarrier.wait): at tile=0, k=1 ({SAMPLE}) the producer waits on empty stage 1 with phase(0), its 1st use of the stage; the parity must be 1, the consumer's phase 0 XOR 1 (the first pass through a stage is free, each later one waits for the previous release)",
        f"IR line 43 ({WHERE_K} > mbarrier.wait): at wg=0, tile=0, k=1 ({SAMPLE}) the consumer waits on full stage 1 with phase(1), the 1st use of the stage, which completes phase 0; the parity must be 0 (phase = (it / S) & 1)",
    ], id="phase-from-the-counter-not-the-stage-count"),
    pytest.param(lambda: with_lets(matmul(), CONSUMER_K, (1, ir.Let("s", ir.mod("it", 2)))), [
        f"IR line 43 ({WHERE_K} > mbarrier.wait): at wg=0, tile=0, k=2 ({SAMPLE}) the consumer waits on full stage 0 but the producer's 3rd fill went to stage 2; both sides must compute the stage from the same counter (stage = it % S)",
    ], id="consumer-stage"),
    pytest.param(lambda: edit(matmul(), PRODUCER_WAIT, ir.MbarrierWait(empty(ir.mod(ir.add("it", 1), 4)), ir.BinOp("^", V("ph"), C(1)))), [
        f"IR line 23 ({WHERE_LOAD} > mbarrier.wait): at tile=0, k=0 ({SAMPLE}) the producer waits on empty stage 1 but then fills stage 0; wait on the stage it fills",
    ], id="producer-acquires-another-stage"),
    pytest.param(lambda: edit(matmul(), CONSUMER_K, replace(statement_at(matmul(), CONSUMER_K), stop=ir.sub("k_tiles", 1))), [
        f"IR line 39 ({WHERE_K}): the consumer's for k runs serial(0, ceil_div(K, 64) - 1, 1) but the producer's for k (IR line 19) runs serial(0, ceil_div(K, 64), 1); {SAME_ORDER}",
    ], id="k-loop-bounds"),
    pytest.param(lambda: edit(matmul(), CONSUMER_TILE, replace(statement_at(matmul(), CONSUMER_TILE), start=C(0), step=C(1))), [
        f"IR line 36 ({WHERE_TILE}): the consumer's for tile runs persistent(0, ceil_div(M, 128) * ceil_div(N, 256), 1) but the producer's for tile (IR line 16) runs persistent(cta_id, ceil_div(M, 128) * ceil_div(N, 256), num_ctas); {SAME_ORDER}",
    ], id="tile-loop-bounds"),
    pytest.param(lambda: edit(matmul(), PRODUCER_K, ir.For("j", C(0), C(1), C(1), "unroll", (statement_at(matmul(), PRODUCER_K),))), [
        f"IR line 45 ({WHERE_K} > mbarrier.wait): the consumer waits on full inside 2 loops (for tile > for k) but the producer fills it inside 3 (for tile > for j > for k); {SAME_ORDER}",
    ], id="loop-nest-depth"),
    # releasing stages
    pytest.param(lambda: edit(matmul(), WGMMA_WAIT, ir.WgmmaWait(1)), [
        f"IR line 48 ({WHERE_K} > mbarrier.arrive): consumer releases empty[s] (stage 0, at wg=0, tile=0, k=0 ({SAMPLE})) before the wgmma reading A[s, wg] and B[s] (IR line 45) has completed; {PENDING}",
    ], id="release-before-wgmma-completes"),
    pytest.param(lambda: pipelined(pipelined_k_body(release_first=True)), [
        f"IR line 49 ({WHERE_K} > if > mbarrier.arrive): consumer releases empty[prev_s] (stage 0, at wg=0, tile=0, k=1 ({SAMPLE})) before the wgmma reading A[s, wg] and B[s] (IR line 45) has completed; {PENDING}",
    ], id="pipelined-release-before-wait-1"),
    pytest.param(lambda: pipelined(pipelined_k_body(prev=ir.mod("it", 4))), [
        f"IR line 43 ({WHERE_K} > mbarrier.wait): at wg=0, tile=0, k=0 ({SAMPLE}) the consumer never releases stage 0 before its next use; the producer's wait on empty deadlocks: arrive on empty once the wgmmas reading the stage are done",
        f"IR line 50 ({WHERE_K} > if > mbarrier.arrive): consumer releases empty[prev_s] (stage 1, at wg=0, tile=0, k=1 ({SAMPLE})) before the wgmma reading A[s, wg] and B[s] (IR line 45) has completed; {PENDING}",
    ], id="pipelined-release-of-the-current-stage"),
    pytest.param(lambda: pipelined(tail=pipelined_tail()[:1]), [
        f"IR line 43 ({WHERE_K} > mbarrier.wait): at wg=0, tile=0, k=4 ({SAMPLE}) the consumer never releases stage 0 before its next use; the producer's wait on empty deadlocks: arrive on empty once the wgmmas reading the stage are done",
    ], id="pipelined-without-the-tail-release"),
    pytest.param(lambda: pipelined(tail=(ir.WgmmaFence(),) + pipelined_tail()[1:]), [
        f"IR line 55 ({WHERE_TILE} > mbarrier.arrive): consumer releases empty[last_s] (stage 0, at wg=0, tile=0 ({SAMPLE})) before the wgmma reading A[s, wg] and B[s] (IR line 45) has completed; {PENDING}",
    ], id="pipelined-tail-release-before-wait-0"),
    pytest.param(lambda: edit(matmul(), WGMMA, replace(MMA, b=ir.SmemRef("B", (ir.mod(ir.add("s", 1), 4),)))), [
        f"IR line 45 ({WHERE_K} > wgmma.mma): at wg=0, tile=0, k=0 ({SAMPLE}) wgmma.mma reads B[(s + 1) % 4] (stage 1) but this warpgroup does not hold that stage; wait on full[1] first and release it only after the wgmma",
    ], id="wgmma-reads-a-stage-not-acquired"),
    pytest.param(lambda: edit(matmul(), RELEASE, ir.MbarrierArrive(empty(ir.mod(ir.add("s", 1), 4)))), [
        f"IR line 48 ({WHERE_K} > mbarrier.arrive): at wg=0, tile=0, k=0 ({SAMPLE}) the consumer releases empty stage 1 before it ever waited on full for it; release a stage only after using it",
    ], id="release-before-acquire"),
]


@pytest.mark.parametrize("build, expected", CONTRACT)
def test_contract_check(build, expected):
    assert problems(build()) == expected


def test_contract_checks_follow_lets_and_vars():
    """The nests may spell the same traversal differently: another let, or a mutable counter."""
    k_tiles = ir.ceil_div("K", 64)
    respelled = ir.Let("it", ir.add(ir.mul(ir.div(ir.sub("tile", "cta_id"), "num_ctas"), k_tiles), "k"))
    assert problems(with_lets(matmul(), CONSUMER_K, (0, respelled))) == []

    k_loop_with_var = ir.For("k", C(0), V("k_tiles"), C(1), "serial", (
        ir.Let("s", ir.mod("it", 4)),
        ir.Let("ph", ir.band(ir.div("it", 4), 1)),
    ) + consumer_k_body() + (ir.Assign("it", ir.add("it", 1)),))
    role = consumer()
    role = replace(role, body=role.body[:3] + (ir.Let("it", C(0), mutable=True),) + (
        replace(role.body[3], body=role.body[3].body[:2] + (k_loop_with_var,) + role.body[3].body[3:]),))
    kernel = matmul(roles=(producer(), role))
    assert "set it = it + 1" in print_kernel(kernel)
    assert problems(kernel) == []
    stuck = replace(role, body=role.body[:3] + (ir.Let("it", C(1), mutable=True),) + role.body[4:])
    assert problems(matmul(roles=(producer(), stuck))) == [
        f"IR line 43 ({WHERE_K} > mbarrier.wait): at wg=0, tile=0, k=0 ({SAMPLE}) the consumer waits on full "
        f"stage 1 but the producer's 1st fill went to stage 0; both sides must compute the stage from the same "
        f"counter (stage = it % S)",
    ]


def test_only_the_first_sample_failure_is_reported_per_statement():
    k = edit(matmul(), CONSUMER_WAIT, ir.MbarrierWait(full(), ir.BinOp("^", V("ph"), C(1))))
    assert len(verify_all(k)) == 1


def test_lowered_pipeline_kernels_verify():
    """The passes' own output: the final kernel of each epilogue flavour verifies cleanly."""
    @ws.fusion
    def mlp(a: ws.Tensor[ws.bf16, "M", "K"], b: ws.Tensor[ws.bf16, "K", "N"], bias: ws.Tensor[ws.bf16, "N"]):
        return ws.gelu(ws.matmul(a, b) + bias).to(ws.bf16)

    for overrides in ({}, {"epilogue": "direct"}, {"mma_inflight": 0}):
        kernel = ws.lower(mlp, **overrides)
        assert problems(kernel) == [], overrides



# ---------------------------------------------------------------------------------------------
# Generic-proxy smem writes before async-proxy reads (a TMA-store epilogue on its own)
# ---------------------------------------------------------------------------------------------

SYNC = ir.NamedBarrierSync(ir.add(1, "wg"), 128)


def tma_store_epilogue(*steps) -> ir.Kernel:
    """Each consumer warpgroup writes its [64, 256] tile to C[wg] and one thread stores it."""
    stores = tuple(ir.TmaStore("c", (ir.mul("wg", 64), C(64 * j)), ir.SmemRef("C", (V("wg"), C(j)))) for j in range(4))
    steps = steps or (ir.TileStoreSmem(ir.SmemRef("C", (V("wg"),)), "out"), ir.FenceProxyAsync(), SYNC)
    return ir.Kernel(
        "epilogue", (ir.ScalarParam("M", "i32"), ir.TensorMapParam("c", "bf16", (V("M"), C(256)), (64, 64), 128)),
        C(1), (1, 1, 1), (ir.SmemDecl("C", "bf16", (2, 4, 64, 64), 128),), (),
        (ir.Role("consumer", 2, 232, (
            ir.RegDecl("out", "bf16", (64, 256)),
            ir.TileFill("out", ir.FloatConst(0.0)),
            ir.ElectOne((ir.TmaWait(0, True),)),
            SYNC,
        ) + steps + (ir.ElectOne(stores + (ir.TmaCommit(),)),)),))


STORE_SMEM = ir.TileStoreSmem(ir.SmemRef("C", (V("wg"),)), "out")
READ_WITHOUT = ("IR line 14 (role consumer > elect_one > tma.store): at wg=0 (M=256, cta_id=0, num_ctas=2) "
                "tma.store reads C[wg, 0], written by tile.store_smem C[wg] (IR line 10) with generic stores; put ")


def test_tma_store_epilogue_verifies():
    assert problems(tma_store_epilogue()) == []


def test_tma_store_of_unfenced_smem():
    assert problems(tma_store_epilogue(STORE_SMEM, SYNC, ir.WgmmaFence())) == [
        READ_WITHOUT + "`fence.proxy.async` and then a `bar.sync` of the warpgroup between the write and this read",
    ]


def test_tma_store_without_a_barrier_after_the_fence():
    assert problems(tma_store_epilogue(STORE_SMEM, SYNC, ir.FenceProxyAsync())) == [
        READ_WITHOUT + "`bar.sync` of the warpgroup after the fence (one thread issues the copy of what every "
                       "thread wrote) between the write and this read",
    ]


def test_collective_statement_inside_elect_one():
    k = tma_store_epilogue(STORE_SMEM, ir.FenceProxyAsync(), ir.ElectOne((SYNC,)))
    assert problems(k, contract=False) == [
        "IR line 13 (role consumer > elect_one > bar.sync): bar.sync is warpgroup-collective, but elect_one runs "
        "its body on one thread; move it out of elect_one",
    ]


def p_from_registers(*before_mma, pending=0) -> ir.Kernel:
    """The consumer writes a bf16 P tile to smem and multiplies it (the attention PV pattern)."""
    k = matmul(smem=matmul().smem + (ir.SmemDecl("P", "bf16", (2, 64, 64), 0),))
    k = edit(k, CONSUMER + (2,), ir.RegDecl("out", "bf16", (64, 64)))
    k = edit(k, CAST, ir.TileFill("out", ir.FloatConst(0.0)))
    k = edit(k, STORE, ir.WgmmaFence())
    mma = replace(MMA, a=ir.SmemRef("P", (V("wg"),)))
    body = counter_lets() + (ir.MbarrierWait(full(), V("ph")),) + before_mma + (
        ir.WgmmaFence(), mma, ir.WgmmaCommit(), ir.WgmmaWait(pending), ir.MbarrierArrive(empty()))
    return edit(k, CONSUMER_K, replace(statement_at(k, CONSUMER_K), body=body))


def test_wgmma_reads_generic_smem_writes_after_a_fence():
    write = ir.TileStoreSmem(ir.SmemRef("P", (V("wg"),)), "out")
    assert problems(p_from_registers(write, ir.FenceProxyAsync())) == []
    assert problems(p_from_registers(write)) == [
        f"IR line 47 ({WHERE_K} > wgmma.mma): at wg=0, tile=0, k=0 ({SAMPLE}) wgmma.mma reads P[wg], written by "
        f"tile.store_smem P[wg] (IR line 45) with generic stores; put `fence.proxy.async` between the write and "
        f"this read",
    ]


def test_generic_write_over_a_pending_wgmma_read():
    write = ir.TileStoreSmem(ir.SmemRef("P", (V("wg"),)), "out")
    assert problems(p_from_registers(write, ir.FenceProxyAsync(), pending=1)) == [
        f"IR line 45 ({WHERE_K} > tile.store_smem): at wg=0, tile=0, k=1 ({SAMPLE}) tile.store_smem overwrites "
        f"P[wg] while the wgmma reading it (IR line 48) may be pending; put `wgmma.wait 0` (or wait for that "
        f"group) before the write",
        f"IR line 51 ({WHERE_K} > mbarrier.arrive): consumer releases empty[s] (stage 0, at wg=0, tile=0, k=0 "
        f"({SAMPLE})) before the wgmma reading B[s] (IR line 48) has completed; {PENDING}",
    ]


# ---------------------------------------------------------------------------------------------
# setmaxnreg per role, named barriers per participating group, role names
# ---------------------------------------------------------------------------------------------

START = "its warps start with 168 registers per thread (65536 registers / 384 threads, in steps of 8)"


def with_setmaxnreg_twice():
    role = statement_at(matmul(), CONSUMER)
    return edit(matmul(), CONSUMER, replace(role, body=(role.body[0],) + role.body))


def one_consumer_warpgroup(producer_action="dec"):
    """256 threads: ptxas starts the kernel at the consumer's 240, below the launch share of 248."""
    k = matmul(roles=(producer(registers=24), consumer(warpgroups=1, registers=240)))
    return edit(k, PRODUCER + (0,), ir.Setmaxnreg(producer_action, 24))


ROLES = [
    pytest.param(lambda: edit(matmul(), PRODUCER + (0,), ir.Setmaxnreg("inc", 40)), [
        f"IR line 14 (role producer > setmaxnreg.inc): setmaxnreg.inc 40 in role producer: {START} and .inc can only "
        f"raise that: use setmaxnreg.dec 40 (the registers a .dec releases are what the other roles' setmaxnreg.inc "
        f"waits for)",
    ], id="setmaxnreg-producer-increases"),
    pytest.param(lambda: edit(matmul(), CONSUMER + (0,), ir.Setmaxnreg("dec", 232)), [
        f"IR line 33 (role consumer > setmaxnreg.dec): setmaxnreg.dec 232 in role consumer: {START} and .dec can only "
        f"lower that (ptxas rejects it): use setmaxnreg.inc 232",
    ], id="setmaxnreg-consumer-decreases"),
    pytest.param(lambda: one_consumer_warpgroup("inc"), [
        "IR line 14 (role producer > setmaxnreg.inc): setmaxnreg.inc 24 in role producer: its warps start with 240 "
        "registers per thread (ptxas starts the kernel at its largest setmaxnreg.inc target when that is below the "
        "launch share of 248) and .inc can only raise that: use setmaxnreg.dec 24 (the registers a .dec releases are "
        "what the other roles' setmaxnreg.inc waits for)",
    ], id="setmaxnreg-direction-with-256-threads"),
    pytest.param(lambda: edit(matmul(), PRODUCER + (0,), ir.WgmmaFence()), [
        "IR line 13 (role producer): role producer registers(40) has no setmaxnreg: its warps keep the 168 registers "
        "per thread they start with (65536 registers / 384 threads, in steps of 8), not the 40 of its budget, which "
        "the other roles' setmaxnreg count on; start its body with setmaxnreg.dec 40",
    ], id="setmaxnreg-missing-in-one-role"),
    pytest.param(with_setmaxnreg_twice, [
        "IR line 34 (role consumer > setmaxnreg.inc): a second setmaxnreg in role consumer (the first is at IR line "
        "33); a role sets its budget once, and two setmaxnreg without a warpgroup barrier between them are undefined: "
        "remove this one",
    ], id="setmaxnreg-twice"),
    pytest.param(lambda: edit(edit(matmul(), CONSUMER + (0,), ir.WgmmaFence()), CAST, ir.Setmaxnreg("inc", 232)), [
        f"IR line 50 ({WHERE_TILE} > setmaxnreg.inc): setmaxnreg inside role consumer > for tile: every warp of the "
        f"warpgroup must execute the same setmaxnreg once; put it at the top of role consumer's body",
    ], id="setmaxnreg-inside-a-loop"),
    pytest.param(lambda: edit(matmul(), CAST, ir.NamedBarrierSync(C(1), 128)), [
        f"IR line 50 ({WHERE_TILE} > bar.sync): bar.sync 1, 128: barrier 1 is reached by 256 threads (role consumer "
        f"wg 0, role consumer wg 1) but counts 128, so it completes once any 4 of their 8 warps arrive and orders "
        f"nothing; give each group of 128 threads its own id (as `bar.sync 1 + wg, 128` does per warpgroup) or count "
        f"them all: bar.sync 1, 256",
    ], id="named-barrier-shared-by-two-warpgroups"),
    pytest.param(lambda: edit(matmul(), CAST, ir.NamedBarrierSync(ir.add(1, "wg"), 256)), [
        f"IR line 50 ({WHERE_TILE} > bar.sync): bar.sync 1 + wg, 256: barrier 1 (wg = 0) is reached by 128 threads "
        f"(role consumer wg 0), fewer than the 256 it counts: it never completes (deadlock); count the threads that "
        f"reach it: bar.sync 1 + wg, 128",
    ], id="named-barrier-counts-more-than-reach-it"),
    pytest.param(lambda: edit(matmul(), CAST, ir.If(ir.eq("wg", 0), (ir.NamedBarrierSync(C(2), 256),))), [
        f"IR line 51 ({WHERE_TILE} > if > bar.sync): bar.sync 2, 256: barrier 2 is reached by 128 threads (role "
        f"consumer wg 0), fewer than the 256 it counts: it never completes (deadlock); count the threads that reach "
        f"it: bar.sync 2, 128",
    ], id="named-barrier-behind-a-branch-on-wg"),
    pytest.param(lambda: matmul(roles=(producer(registers=24), consumer(), producer(registers=24))), [
        "IR line 54 (role producer): role producer is declared twice (first at IR line 13); give each role its own name",
    ], id="role-declared-twice"),
]


@pytest.mark.parametrize("build, expected", ROLES)
def test_role_check(build, expected):
    assert problems(build(), contract=False) == expected


def ping_pong(sync_id=ir.add(3, "wg")) -> ir.Kernel:
    """FlashAttention-3's token between two consumer warpgroups, per tile: warpgroup w waits on
    3 + w, then arrives on the other's 4 - w; warpgroup 1 hands the first token, warpgroup 0
    takes it back."""
    k = edit(matmul(), CAST, ir.For("j", C(0), C(2), C(1), "serial", (
        ir.NamedBarrierSync(sync_id, 256), ir.NamedBarrierArrive(ir.sub(4, "wg"), 256))))
    k = edit(k, STORE, ir.If(ir.eq("wg", 0), (ir.NamedBarrierSync(C(3), 256),)))
    return edit(k, CONSUMER_TILE + (0,), ir.If(ir.eq("wg", 1), (ir.NamedBarrierArrive(C(3), 256),)))


def test_named_barrier_controls_verify():
    """Each warpgroup its own id; a token passed across warpgroups; the same kernel's other ids."""
    assert problems(edit(matmul(), CAST, ir.NamedBarrierSync(ir.add(1, "wg"), 128)), contract=False) == []
    assert problems(ping_pong(), contract=False) == []
    assert problems(tma_store_epilogue()) == []
    assert problems(ping_pong(C(3)), contract=False) == [     # both warpgroups wait on 3: none on 4
        f"IR line 54 ({WHERE_TILE} > for j > bar.arrive): bar.arrive 4 - wg, 256: barrier 4 (wg = 0) is reached by "
        f"128 threads (role consumer wg 0), fewer than the 256 it counts: it never completes (deadlock); count the "
        f"threads that reach it: bar.arrive 4 - wg, 128",
    ]


def test_setmaxnreg_controls_verify():
    """Producer down, consumers up, from the launch share; with 256 threads ptxas starts at 240."""
    assert problems(matmul(), contract=False) == []
    assert problems(one_consumer_warpgroup(), contract=False) == []
    no_realloc = matmul(roles=(replace(producer(), body=producer().body[1:]),
                               replace(consumer(), body=consumer().body[1:])))
    assert problems(no_realloc, contract=False) == []          # before reg_realloc: nothing to hand over


@pytest.mark.parametrize("overrides", [{}, {"mode": "pingpong"}, {"mma_inflight": 0}], ids=str)
def test_lowered_attention_kernels_verify(overrides):
    from attention_fusions import make_attention
    assert problems(ws.lower(make_attention(128, causal=True, lse=True), **overrides)) == []


# ---------------------------------------------------------------------------------------------
# Equivalent orders of the producer's acquires; the rule named when an order is wrong
# ---------------------------------------------------------------------------------------------

K_WAIT = "          mbarrier.wait k_empty[s] phase(ph ^ 1)\n"
V_WAIT = "          mbarrier.wait v_empty[s] phase(ph ^ 1)\n"
V_EXPECT = "          mbarrier.arrive_expect_tx v_full[s] bytes(32768)\n"


def attention_text() -> str:
    from pathlib import Path
    return (Path(__file__).parent / "golden" / "attention_causal_d128.ir").read_text()


def attention_problems(text: str) -> list[str]:
    from wsched.lowering.parser import parse_kernel
    return problems(parse_kernel(text))


@pytest.mark.parametrize("order", ["v_empty first", "both before the loads", "each twice"])
def test_equivalent_producer_wait_orders_verify(order):
    """Waiting for a stage earlier (or again) only delays the loads; the consumers' releases say
    which empty barrier belongs to which channel, not the order of the producer's waits."""
    text = attention_text()
    edited = {"v_empty first": text.replace(V_WAIT, "").replace(K_WAIT, V_WAIT + K_WAIT),
              "both before the loads": text.replace(V_WAIT, "").replace(K_WAIT, K_WAIT + V_WAIT),
              "each twice": text.replace(K_WAIT, K_WAIT * 2).replace(V_WAIT, V_WAIT * 2)}[order]
    assert edited != text
    assert attention_problems(edited) == []


WHERE_PRODUCER_K = "role producer > elect_one > for tile > for k"
FIRST_SAMPLE = "at tile=0, k=0 (batch0=256, batch1=384, S=320, T=192, section=8, cta_id=0, num_ctas=2)"


def test_wait_after_the_fill_names_the_acquire_rule():
    late = attention_text().replace(V_WAIT, "").replace(V_EXPECT, V_EXPECT + V_WAIT)
    assert attention_problems(late) == [
        f"IR line 62 ({WHERE_PRODUCER_K} > mbarrier.arrive_expect_tx): {FIRST_SAMPLE} the producer fills stage 0 "
        f"without waiting on v_empty first: its wait on v_empty (IR line 63) comes after the fill, move it above; "
        f"every fill waits for the stage to be free",
    ]
    both_late = attention_text().replace(K_WAIT, "").replace(V_WAIT, V_WAIT + K_WAIT)
    assert attention_problems(both_late) == [
        f"IR line 58 ({WHERE_PRODUCER_K} > mbarrier.arrive_expect_tx): the producer announces k_full[s] without first "
        f"waiting for the stage to be free; put `mbarrier.wait empty[...] phase(ph ^ 1)` (producer_acquire) before it",
    ]


def test_a_repeated_wait_with_the_other_parity_is_a_use():
    text = attention_text().replace(K_WAIT, K_WAIT + K_WAIT.replace("ph ^ 1", "ph"))
    assert attention_problems(text) == [
        f"IR line 59 ({WHERE_PRODUCER_K} > mbarrier.wait): {FIRST_SAMPLE} the producer waits on k_empty stage 0 with "
        f"phase(0), its 1st use of the stage; the parity must be 1, the consumer's phase 0 XOR 1 (the first pass "
        f"through a stage is free, each later one waits for the previous release)",
    ]


def test_a_release_counted_twice_is_caught_on_a_long_sample():
    """Only a stage the producer fills again shows its release count: the long sample reuses them."""
    release = "        mbarrier.arrive v_empty[last_s]\n"
    assert attention_problems(attention_text().replace(release, release * 2)) == [
        "IR line 121 (role consumer > for tile > for k > if > mbarrier.wait): the consumer releases its stages 1 or 2 "
        "times per use (batch0=1000, batch1=1030, S=968, T=1100, section=8, cta_id=1, num_ctas=2); release every use exactly "
        "the same number of times",
    ]


def test_a_release_by_one_thread_needs_the_warpgroup_past_its_wait():
    """A tile whose kv loop runs no step has no wgmma between the wait on Q and its release: the
    warpgroup's own bar.sync must gather its warps first (the control keeps it)."""
    from attention_fusions import make_attention
    from wsched.lowering.parser import parse_kernel
    text = print_kernel(ws.lower(make_attention(64, causal="bottom_right", lse=True)))
    assert problems(parse_kernel(text)) == []
    unsynced = text.replace("        bar.sync 1 + wg, 128\n        mbarrier.arrive q_empty[0]\n", "        mbarrier.arrive q_empty[0]\n")
    assert unsynced != text
    assert problems(parse_kernel(unsynced)) == [
        "IR line 161 (role consumer > for tile > if > mbarrier.arrive): at wg=0, tile=2 (batch0=1, batch1=1, S=320, "
        "T=192, section=8, cta_id=0, num_ctas=2) one thread releases q_empty stage 0 while the other warps of its "
        "warpgroup may not have passed the wait on q_full (IR line 104): no wgmma or bar.sync between them on this path, so the "
        "producer can complete q_full's next phase too and a late warp waits a phase behind for ever; put the "
        "warpgroup's `bar.sync 1 + wg, 128` before the release",
    ]


# ---------------------------------------------------------------------------------------------
# Linear tiles in the split-KV merge (docs/ir.md, "Linear tiles")
# ---------------------------------------------------------------------------------------------

MERGE_WHERE = "role consumer > for tile > if > if > for chunk > for first_split > for in_group"


@pytest.mark.parametrize("old, new, expected", [
    # a linear tile holds one row a thread: a [1, C] operand would need every row's columns
    ("tile.mul merge_part, merge_part, merge_mb", "tile.mul merge_part, merge_part, merge_r",
     f"IR line 208 ({MERGE_WHERE} > tile.mul): tile.mul merge_part: merge_r [1, 128] broadcast into the linear "
     f"tile merge_part [8, 128]; a linear tile's operands are tiles of its shape, [8, 1] (a value a row) or [1, 1]"),
    ("tile.mul merge_part, merge_part, merge_mb", "tile.mul merge_part, merge_part, m_blk",
     f"IR line 207 ({MERGE_WHERE} > tile.mul): tile.mul merge_part: the tiles lie in different layouts "
     f"(merge_part linear, m_blk fragment); an elementwise op combines tiles of one layout"),
    ("tile.load merge_lb <- part_l[src_split, work, wg * 64 + chunk * 8, 0]", "tile.load merge_lb <- tickets[work]",
     f"IR line 193 ({MERGE_WHERE} > tile.load): tile.load: merge_lb is a linear tile and tickets has rank 1; a "
     f"linear tile is read from and written to tensors of rank 2 or more (its rows, then columns)"),
], ids=["row-broadcast", "fragment-operand", "rank-1-tensor"])
def test_linear_tiles_in_the_decode_merge(old, new, expected):
    text = (Path(__file__).parent / "golden" / "attention_decode_split.ir").read_text()
    if new.endswith("merge_r"):
        text = text.replace("    reg merge_c: f32[8, 1] linear\n", "    reg merge_c: f32[8, 1] linear\n    reg merge_r: f32[1, 128] linear\n")
    assert old in text
    assert expected in [str(p) for p in verify_all(parse_kernel(text.replace(old, new)))]
