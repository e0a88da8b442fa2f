"""The two IR additions a paged KV cache needs, in every layer: `ld.global` (one i32 element of an
input: a page of the page table, a sequence's length) and `tma.load ... row(r)` (a box that fills
rows r .. r + rows - 1 of a 2-D smem sub-array: one page of a block of keys).

A small kernel gathers a 32-key block from two 16-row pages of a paged cache (`ld.global` of each
page index by the producer's elected thread, one row load per page and 64-column chunk), and its
consumer warpgroup computes Q @ K^T with wgmma and masks the keys beyond a length it reads with
`ld.global`: text, verifier messages, the simulator against torch (and its errors), and the CUDA.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from wsched.codegen import build
from wsched.codegen.emit import emit_kernel
from wsched.lowering import ir
from wsched.lowering.parser import parse_kernel
from wsched.lowering.printer import print_kernel, print_stmt
from wsched.lowering.simulate import ProtocolError, RaceError, simulate
from wsched.lowering.verify import verify_all

from test_simulator import matmul_kernel

C, V = ir.IntConst, ir.Var
PAGES, PAGE_ROWS, D = 5, 16, 128
FULL = ir.BarRef("full", C(0))


def paged_kernel(*, row: ir.Expr = ir.mul("j", PAGE_ROWS), page_index: ir.Expr = V("j"), pages: int = 2,
                 table: ir.Param = ir.GlobalParam("table", "i32", (C(2),)),
                 key_ref: ir.SmemRef = ir.SmemRef("K", (C(0), V("c2")))) -> ir.Kernel:
    """acc[64, 32] = Q[64, 128] @ K^T, K's 32 rows gathered from `pages` pages of kc (16 rows each),
    keys at or beyond lens[0] masked to -inf, stored to out."""
    loads = (
        ir.MbarrierArriveExpectTx(FULL, C(64 * D * 2 + pages * PAGE_ROWS * D * 2)),
        ir.For("c", C(0), C(2), C(1), "unroll",
               (ir.TmaLoad(ir.SmemRef("Q", (C(0), V("c"))), "q", (C(0), ir.mul("c", 64)), FULL),)),
        ir.For("j", C(0), C(pages), C(1), "serial", (
            ir.LoadGlobal("page", "table", (page_index,)),
            ir.For("c2", C(0), C(2), C(1), "unroll",
                   (ir.TmaLoad(key_ref, "kc", (V("page"), C(0), ir.mul("c2", 64)), FULL, row),)))))
    compute = (
        ir.RegDecl("acc", "f32", (64, 32)),
        ir.MbarrierWait(FULL, C(0)),
        ir.WgmmaFence(),
        ir.Wgmma("acc", ir.SmemRef("Q", (C(0),)), ir.SmemRef("K", (C(0),)), "k", "k", C(0)),
        ir.WgmmaCommit(), ir.WgmmaWait(0),
        ir.LoadGlobal("n", "lens", (C(0),)),
        ir.TileMask("acc", C(0), C(0), V("n")),
        ir.TileStoreGlobal("out", (C(0), C(0)), "acc"))
    return ir.Kernel(
        "paged",
        (ir.TensorMapParam("q", "bf16", (C(64), C(D)), (64, 64), 128),
         ir.TensorMapParam("kc", "bf16", (V("P"), C(PAGE_ROWS), C(D)), (1, PAGE_ROWS, 64), 128),
         table, ir.GlobalParam("lens", "i32", (C(1),)), ir.GlobalParam("out", "f32", (C(64), C(32))),
         ir.ScalarParam("P", "i32")),
        C(1), (1, 1, 1),
        (ir.SmemDecl("Q", "bf16", (1, 2, 64, 64), 128), ir.SmemDecl("K", "bf16", (1, 2, 32, 64), 128)),
        (ir.BarrierDecl("full", 1),),
        (ir.MbarrierInit("full", 1), ir.FenceMbarrierInit(), ir.SyncThreads(),
         ir.Role("producer", 1, 40, (ir.Setmaxnreg("dec", 40), ir.ElectOne(loads))),
         ir.Role("consumer", 1, 232, (ir.Setmaxnreg("inc", 232),) + compute)))


def run(kernel: ir.Kernel, *, seed: int, table=(3, 1), length: int = 27, pages: int = PAGES):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(64, D, generator=gen).to(torch.bfloat16)
    kc = torch.randn(pages, PAGE_ROWS, D, generator=gen).to(torch.bfloat16)
    table = torch.tensor(table, dtype=torch.int32)
    out = torch.full((64, 32), float("nan"))
    simulate(kernel, {"q": q, "kc": kc, "table": table, "lens": torch.tensor([length], dtype=torch.int32),
                      "out": out, "P": pages}, seed=seed)
    keys = kc[table.long()].reshape(-1, D)
    ref = q.float() @ keys.float().T
    ref[:, length:] = float("-inf")
    return out, ref


# --- text ----------------------------------------------------------------------------------------

def test_both_nodes_print_and_parse_back():
    k = paged_kernel()
    text = print_kernel(k)
    assert "      ld.global page = table[j]\n" in text
    assert "          tma.load K[0, c2] row(j * 16) <- kc[page, 0, c2 * 64] bar(full[0])\n" in text
    assert "        tma.load Q[0, c] <- q[0, c * 64] bar(full[0])\n" in text      # no row: no clause
    assert "    ld.global n = lens[0]\n" in text
    assert parse_kernel(text) == k


@pytest.mark.parametrize("text", [
    "ld.global kv_len_b = lens[b0]",
    "ld.global page = block_table[b0, min(k * 8 + 3, MP - 1)]",
    "tma.load K[s, 1] row(r * 16) <- k_cache[page, 0, b1, 64] bar(k_full[s])",
    "tma.load K[s, 1] row(0) <- k_cache[page, 0, b1, 64] bar(k_full[s])",
])
def test_statement_spellings(text):
    (stmt,) = parse_kernel(f"kernel k() grid(1) cluster(1, 1, 1) {{\n  {text}\n}}\n").body
    assert print_stmt(stmt) == text


def test_row_is_the_last_field_and_defaults_to_none():
    load = ir.TmaLoad(ir.SmemRef("A", (C(0),)), "a", (C(0), C(0)), FULL)
    assert load.row is None and load != ir.TmaLoad(load.dst, "a", load.coords, FULL, C(0))
    (stmt,) = parse_kernel("kernel k() grid(1) cluster(1, 1, 1) {\n  tma.load K[s, 1] row(0) <- c[0, 0] "
                           "bar(f[s])\n}\n").body
    assert stmt.row == C(0)     # row(0) is kept: it says the box may be shorter than the sub-array


# --- verifier ------------------------------------------------------------------------------------

WHERE_PAGE = "IR line 16 (role producer > elect_one > for j > ld.global page)"
WHERE_LOAD = "IR line 18 (role producer > elect_one > for j > for c2 > tma.load)"
VERIFY_CASES = {
    "ld-global-of-a-workspace": (
        dict(table=ir.WorkspaceParam("table", "i32", (C(2),))),
        f"{WHERE_PAGE}: ld.global reads table, a workspace, which the kernel writes; ld.global reads through "
        f"the read-only data cache, valid only for data no CTA writes during the kernel: read a kernel input "
        f"(a `global` param)"),
    "ld-global-of-f32": (
        dict(table=ir.GlobalParam("table", "f32", (C(2),))),
        f"{WHERE_PAGE}: ld.global reads table, which is f32; it reads an i32 element (a page index or a "
        f"length): declare `global table: i32[...]`"),
    "ld-global-coordinates": (
        dict(table=ir.GlobalParam("table", "i32", (C(1), C(2)))),
        f"{WHERE_PAGE}: ld.global table[...] gives 1 coordinate but table is i32[1, 2]; give one coordinate "
        f"per dim"),
    "ld-global-of-a-tensormap": (
        dict(table=ir.TensorMapParam("table", "i32", (C(4),), (4,), 0)),
        f"{WHERE_PAGE}: tensor `table` is a tensormap param, not a global param (declared: lens, out)"),
    "row-misaligned": (
        dict(row=C(4)),
        f"{WHERE_LOAD}: tma.load K[0, c2] row(4): the box(1, 16, 64) would start 4 rows = 512 bytes into "
        f"K[0, c2], not on the 1024-byte alignment swizzle(128) needs (8 rows of its 128-byte span, where its "
        f"pattern repeats); use a row that is a multiple of 8"),
    "row-past-the-sub-array": (
        dict(row=C(24)),
        f"{WHERE_LOAD}: tma.load K[0, c2] row(24): the box(1, 16, 64) fills rows 24 .. 39 but K[0, c2] has 32; "
        f"the box must land inside the sub-array: row(r) with 0 <= r <= 16"),
    "row-negative": (
        dict(row=C(-8)),
        f"{WHERE_LOAD}: tma.load K[0, c2] row(-8): the box(1, 16, 64) fills rows -8 .. 7 but K[0, c2] has 32; "
        f"the box must land inside the sub-array: row(r) with 0 <= r <= 16"),
    "row-into-a-chunked-sub-array": (
        dict(key_ref=ir.SmemRef("K", (C(0),))),
        f"{WHERE_LOAD}: tma.load K[0] row(j * 16): K[0] is bf16[2, 32, 64]; a row offset fills rows of a 2-D "
        f"[rows, width] sub-array: index all but the last two dims of K"),
}


@pytest.mark.parametrize("case", sorted(VERIFY_CASES))
def test_verifier_messages(case):
    changes, expected = VERIFY_CASES[case]
    assert [d.message for d in verify_all(paged_kernel(**changes), contract=False)] == [expected]


def test_the_kernel_is_sound_and_a_bound_name_is_not_rebound():
    assert verify_all(paged_kernel(), contract=False) == []
    text = print_kernel(paged_kernel()).replace("    ld.global n = lens[0]\n", "    let n = 32\n    ld.global n = lens[0]\n")
    assert [d.message for d in verify_all(parse_kernel(text), contract=False)] == [
        "IR line 32 (role consumer > ld.global n): `n` is already declared as a let at IR line 31 (names are "
        "unique in the IR); rename one of them"]


def test_the_row_box_must_be_as_wide_as_the_sub_array():
    k = paged_kernel()
    params = tuple(ir.TensorMapParam("kc", "bf16", p.shape, (1, 8, 32), 128) if p.name == "kc" else p
                   for p in k.params)
    assert [d.message for d in verify_all(dataclasses.replace(k, params=params), contract=False)] == [
        f"{WHERE_LOAD}: tma.load K[0, c2] row(j * 16): the box(1, 8, 32) of tensormap kc has rows of 32 bf16 but "
        f"K[0, c2] is bf16[32, 64]; the box's inner extent must be the sub-array's width, 64"]


def test_tma_row_step_follows_the_swizzle():
    assert ir.tma_row_step(ir.SmemDecl("K", "bf16", (2, 128, 64), 128)) == (1024, 8)
    assert ir.tma_row_step(ir.SmemDecl("K", "bf16", (2, 128, 32), 64)) == (512, 8)
    assert ir.tma_row_step(ir.SmemDecl("K", "bf16", (2, 128, 64), 0)) == (128, 1)
    assert ir.tma_row_step(ir.SmemDecl("K", "bf16", (2, 128, 16), 0)) == (128, 4)


# --- simulator -----------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(3))
def test_gathered_pages_match_torch(seed):
    """Pages 3 and 1 of 5 into rows 0-15 and 16-31 of each 64-column chunk; 27 of the 32 keys
    valid (outputs poisoned with NaN first)."""
    out, ref = run(paged_kernel(), seed=seed)
    assert not torch.isnan(out).any()
    assert torch.equal(torch.isinf(out), torch.isinf(ref))
    valid = ref[:, :27]
    assert ((out[:, :27] - valid).norm() / valid.norm()).item() < 1e-2


def test_the_same_page_twice_and_a_full_length():
    out, ref = run(paged_kernel(), seed=7, table=(4, 4), length=32)
    assert ((out - ref).norm() / ref.norm()).item() < 1e-2
    assert torch.equal(out[:, :16], out[:, 16:])


def test_a_row_load_writes_only_its_rows():
    """One page loaded: rows 16-31 of K are never written, and the wgmma reading all of K[0] is
    reported (a row load writes, and is race-checked on, exactly its rows)."""
    with pytest.raises(RaceError, match=r"read of slot K\[0\] before any write to it .*reader CTA 0 consumer wg0: "
                                        r"wgmma\.mma acc, Q\[0\], K\[0\]"):
        run(paged_kernel(pages=1), seed=0, table=(3, 1))


RUN_ERRORS = {
    "ld-global-outside-its-tensor": (
        dict(page_index=ir.add("j", 1)),
        "ld.global reads table[2], outside table [2]: it would read out of bounds on the GPU; clamp the "
        "coordinates to the tensor (e.g. min(i, n - 1)): CTA 0 producer wg0: ld.global page = table[2] "
        "(IR line 16; loop j=1)"),
    "row-off-the-swizzle-atom": (
        dict(row=ir.mul("j", 12)),
        "tma.load into K[0, 0] at row(12): the box would start 1536 bytes into K[0, 0], not on the 1024-byte "
        "alignment its swizzle(128) and TMA need (on the GPU its rows would land swizzled as other rows, or the "
        "copy faults); use a row that is a multiple of 8: CTA 0 producer wg0: tma.load K[0, 0] row(12) <- "
        "kc[1, 0, 0] bar(full[0]) (IR line 18; loop j=1, c2=0)"),
    "row-past-the-sub-array": (
        dict(row=ir.mul("j", 24)),
        "tma.load into K[0, 0] at row(24): the box's 16 rows would land in rows 24 .. 39, outside the 32 rows of "
        "K[0, 0] (outside the buffer on the GPU); a row load needs 0 <= row <= 16: CTA 0 producer wg0: tma.load "
        "K[0, 0] row(24) <- kc[1, 0, 0] bar(full[0]) (IR line 18; loop j=1, c2=0)"),
}


@pytest.mark.parametrize("case", sorted(RUN_ERRORS))
def test_run_time_errors(case):
    """What only a run shows: an element index, or a row, computed from the loop variables."""
    changes, expected = RUN_ERRORS[case]
    with pytest.raises(ProtocolError) as info:
        run(paged_kernel(**changes), seed=0)
    assert str(info.value) == expected


# --- emitter -------------------------------------------------------------------------------------

def test_emitted_cuda():
    src = emit_kernel(paged_kernel()).source
    assert "        const int page = __ldg(&table[j]);\n" in src
    assert ("          wsp::tma_load_3d(smem_K + c2 * 4096 + j * 16 * 128, &kc, &full_bar[0], c2 * 64, 0, page);\n"
            in src)
    assert "        wsp::tma_load_2d(smem_Q + c * 8192, &q, &full_bar[0], c * 64, 0);\n" in src
    assert "    const int n = __ldg(&lens[0]);\n" in src


def test_emitted_cuda_of_a_constant_row_and_a_two_dim_table():
    k = paged_kernel(row=C(16), pages=1, table=ir.GlobalParam("table", "i32", (C(3), C(2))))
    k = parse_kernel(print_kernel(k).replace("ld.global page = table[j]", "ld.global page = table[2, j]"))
    src = emit_kernel(k).source
    assert "const int page = __ldg(&table[(2) * 2 + j]);" in src
    assert "wsp::tma_load_3d(smem_K + c2 * 4096 + 2048, &kc, &full_bar[0], c2 * 64, 0, page);" in src


@pytest.mark.nvcc
def test_the_kernel_compiles_for_sm90a(tmp_path):
    emitted = emit_kernel(paged_kernel())
    result = build.compile_cuda(emitted.source, name=emitted.name, cache_dir=tmp_path)
    res = result.resources[emitted.name]
    assert (res.spill_stores, res.spill_loads, res.stack_bytes) == (0, 0, 0)


# --- the load/compute contract: both nests bounded by what they read ------------------------------

def length_bounded_matmul(consumer_reads: str = "ks[0]") -> ir.Kernel:
    """The simulator tests' pipelined matmul with its k-step count read from memory by each side
    (`ld.global`, one name per role) instead of computed from K."""
    text = print_kernel(matmul_kernel())
    text = text.replace("global c: bf16[M, N])", "global c: bf16[M, N], global ks: i32[2])")
    text = text.replace("  let k_tiles = ceil_div(K, 32)\n", "")
    producer, consumer = text.split("  role consumer")
    producer = producer.replace("    elect_one {\n", "    elect_one {\n      ld.global load_k_tiles = ks[0]\n")
    producer = producer.replace("k_tiles", "load_k_tiles").replace("load_load_k_tiles", "load_k_tiles")
    consumer = consumer.replace("    reg out_t: bf16[64, 64]\n",
                                f"    reg out_t: bf16[64, 64]\n    ld.global mma_k_tiles = {consumer_reads}\n")
    consumer = consumer.replace(" k_tiles", " mma_k_tiles")
    return parse_kernel(producer + "  role consumer" + consumer)


def test_both_sides_reading_the_same_element_keep_the_contract():
    """The verifier's contract compares both nests' loop bounds with each `ld.global` standing
    for the element it reads, and runs them on the host with every element read as the sample's
    size; the simulator runs the real values."""
    k = length_bounded_matmul()
    assert "      ld.global load_k_tiles = ks[0]\n" in print_kernel(k)
    assert verify_all(k) == []
    m, n, kk = 200, 130, 100
    gen = torch.Generator().manual_seed(5)
    a = torch.randn(m, kk, generator=gen).to(torch.bfloat16)
    b = torch.randn(n, kk, generator=gen).to(torch.bfloat16)
    c = torch.full((m, n), float("nan"), dtype=torch.bfloat16)
    ks = torch.tensor([-(-kk // 32), 0], dtype=torch.int32)
    simulate(k, {"M": m, "N": n, "K": kk, "a": a, "b": b, "c": c, "ks": ks}, num_sms=3)
    ref = a.float() @ b.float().T
    assert ((c.float() - ref).norm() / ref.norm()).item() < 1e-2


def test_the_contract_runs_both_sides_with_the_read_values():
    text = print_kernel(length_bounded_matmul()).replace("mbarrier.wait full[s] phase(ph)",
                                                        "mbarrier.wait full[s] phase(ph ^ 1)")
    assert [d.message for d in verify_all(parse_kernel(text))] == [
        "IR line 47 (role consumer > for tile > for k > mbarrier.wait): at wg=0, tile=0, k=0 (M=256, N=384, K=320, "
        "cta_id=0, num_ctas=2, every ld.global reads 256) the consumer waits on full stage 0 with phase(1), the 1st "
        "use of the stage, which completes phase 0; the parity must be 0 (phase = (it / S) & 1)"]


def test_sides_reading_different_elements_break_the_contract():
    messages = [d.message for d in verify_all(length_bounded_matmul(consumer_reads="ks[1]"))]
    assert messages[0].endswith(
        "the consumer's for k runs serial(0, ks(1), 1) but the producer's for k (IR line 20) runs "
        "serial(0, ks(0), 1); the load and compute nests must traverse the same (tile, k) order"), messages
