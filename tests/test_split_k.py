"""Split-K matmul: the k range of an output tile split across CTAs, fp32 partials in a workspace,
a ticket per (tile, consumer warpgroup), and the last unit to arrive summing the partials in split
order and running the fused epilogue.

The IR nodes it needs (host params, workspaces, `fence.acq_rel.gpu`, `atomic.inc`, `ld.shared`)
in every layer: golden IR, the verifier's messages, the simulator's semantics (the ticket, the
release/acquire ordering of partials between CTAs, the workspace left zeroed), the emitter's
CUDA, and the simulator against torch over split counts 1..8, odd shapes and several interleavings.
"""

from __future__ import annotations

import re

import pytest
import torch

import wsched as ws
from fusions import gated, inputs_for, linear_relu_residual, matmul, mlp, scaled_silu_f32, simulated_under_interleavings
from wsched.codegen import build
from wsched.codegen.emit import emit_kernel
from wsched.lowering import ir
from wsched.lowering.parser import parse_kernel
from wsched.lowering.printer import print_kernel
from wsched.lowering.simulate import ProtocolError, RaceError, simulate
from wsched.lowering.verify import VerifyError, verify_all
from wsched.schedule import ScheduleError

V, C = ir.Var, ir.IntConst


def rel_error(out, ref) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


@pytest.fixture(scope="module")
def split_matmul():
    return ws.compile(matmul, split_k=8, split_min_steps=1, build=False)


# --- the kernel --------------------------------------------------------------------------------

def test_split_k_final_ir_is_golden(golden):
    golden.check("matmul_split_k.ir", print_kernel(ws.lower(matmul, split_k=4)))


def test_the_split_count_is_a_host_param_and_split_1_builds_the_plain_kernel():
    plain, split = print_kernel(ws.lower(matmul)), print_kernel(ws.lower(matmul, split_k=4))
    assert "i32 splits = min(min(4, max(1, ceil_div(K, 64) / 8)), max(1, num_sms / (ceil_div(M, 128) * ceil_div(N, 256))))" in split
    assert "workspace partials: f32[splits, M, N] fragments, workspace tickets: i32[ceil_div(M, 128) * ceil_div(N, 256) * 2] zeroed" in split
    assert "grid(min(num_sms, ceil_div(M, 128) * ceil_div(N, 256) * splits))" in split
    for word in ("splits", "partials", "tickets", "atomic.inc", "fence.acq_rel.gpu"):
        assert word not in plain


def test_split_k_field_is_checked():
    with pytest.raises(ScheduleError, match=r"split_k=0 must be an int in \[1, 16\] \(the most CTAs one output tile's k "
                                            r"range is split across; 1: no split\)"):
        ws.schedule_for(matmul, split_k=0)
    assert ws.schedule_for(matmul, split_k=4).short().endswith("split_k=4")


# --- the simulator against torch --------------------------------------------------------------

@pytest.mark.parametrize("splits", range(1, 9))
def test_split_counts_1_to_8_match_torch(split_matmul, splits):
    """One output tile (M 33, N 200: partial in both), 9 k steps (K 520: the last one partial) over
    3 stages; `num_sms` = the split count, so the host rule picks exactly it."""
    a, b = inputs_for(matmul, 33, 200, 520, seed=splits)
    out = split_matmul.simulate(a, b, num_sms=splits)      # outputs NaN-poisoned first
    assert not torch.isnan(out.float()).any()
    assert rel_error(out, matmul.reference(a, b)) < 1e-2


@pytest.mark.parametrize("M, N, K, num_sms", [
    (200, 256, 1000, 8),    # 2 tiles, 4 splits each on 8 SMs; 16 k steps: every stage reused
    (300, 520, 320, 4),     # 9 tiles, more than the SMs: no split
    (1, 64, 40, 4),         # K < BK: one k step, nothing to split
    (130, 520, 640, 16),    # 6 tiles, 2 splits each; the second tile row one row deep
])
def test_fewer_and_more_tiles_than_sms(split_matmul, M, N, K, num_sms):
    a, b = inputs_for(matmul, M, N, K, seed=M)
    out = split_matmul.simulate(a, b, num_sms=num_sms)
    assert not torch.isnan(out.float()).any()
    assert rel_error(out, matmul.reference(a, b)) < 1e-2


def test_ctas_walk_several_units_with_different_k_ranges(split_matmul):
    """splits = 3 given explicitly on 2 SMs: each CTA takes several (tile, split) units whose
    k ranges differ (10 k steps: 3, 3, 4), so the ring counter runs on across them."""
    a, b = inputs_for(matmul, 100, 264, 640, seed=3)
    out = torch.full((100, 264), float("nan"), dtype=torch.bfloat16)
    report = simulate(split_matmul.kernel, {"M": 100, "N": 264, "K": 640, "splits": 3, "a": a, "b": b, "out": out},
                      num_sms=2, seed=1)
    assert report.num_ctas == 2
    assert rel_error(out, matmul.reference(a, b)) < 1e-2


def test_the_sum_is_the_same_bits_whichever_unit_arrives_last(split_matmul):
    runs = simulated_under_interleavings(split_matmul, 64, 128, 1024, num_sms=8)
    assert all(torch.equal(runs[0][0], out) for out, _ in runs[1:])


@pytest.mark.parametrize("fusion", [mlp, gated, linear_relu_residual, scaled_silu_f32], ids=lambda f: f.name)
def test_fused_epilogues_run_on_the_sum(fusion):
    k = ws.compile(fusion, split_k=4, split_min_steps=1, build=False)
    x = inputs_for(fusion, 33, 264, 512, seed=2)
    out = k.simulate(*x, num_sms=4)
    assert not torch.isnan(out.float()).any()
    assert rel_error(out, fusion.reference(*x)) < 1e-2


def test_direct_epilogue_with_split_k():
    k = ws.compile(gated, split_k=4, split_min_steps=1, epilogue="direct", build=False)
    x = inputs_for(gated, 17, 128, 512, seed=4)
    assert rel_error(k.simulate(*x, num_sms=4), gated.reference(*x)) < 1e-2


# --- the protocol is checked by the simulator ------------------------------------------------

def _mutant_run(text: str):
    a, b = inputs_for(matmul, 64, 256, 640, seed=1)
    out = torch.full((64, 256), float("nan"), dtype=torch.bfloat16)
    simulate(parse_kernel(text), {"M": 64, "N": 256, "K": 640, "a": a, "b": b, "out": out}, num_sms=4)


def _drop_line(text: str, pattern: str, which: int = 0) -> str:
    lines = text.split("\n")
    hits = [i for i, line in enumerate(lines) if re.fullmatch(pattern, line.strip())]
    return "\n".join(lines[:hits[which]] + lines[hits[which] + 1:])


RACE = r"tile\.load of partials reads elements another warpgroup stored with no synchronisation between the store " \
       r"and this load: .* reader CTA \d consumer wg[01]: tile\.load part_t <- partials\[\d, \d+, \d+\] .*; writer " \
       r"CTA \d consumer wg[01]: tile\.store partials"


@pytest.mark.parametrize("which", [0, 1], ids=["release", "acquire"])
def test_a_missing_gpu_fence_is_a_race(split_matmul, which):
    with pytest.raises(RaceError, match=RACE):
        _mutant_run(_drop_line(split_matmul.ir, r"fence\.acq_rel\.gpu", which))


def test_partials_read_without_the_ticket_are_a_race(split_matmul):
    text = split_matmul.ir.replace("set last_split = ticket == splits - 1", "set last_split = 1")
    with pytest.raises(RaceError, match=RACE):
        _mutant_run(text)


def test_partials_stored_after_the_ticket_are_a_race(split_matmul):
    """The warpgroup's barrier before the elected thread's release: without it the other
    threads' partials are not released."""
    lines = split_matmul.ir.split("\n")
    i = next(i for i, line in enumerate(lines) if "tile.store partials" in line) + 2   # after the store's loop
    assert lines[i].strip() == "bar.sync 1 + wg, 128"
    with pytest.raises(RaceError, match=RACE):
        _mutant_run("\n".join(lines[:i] + lines[i + 1:]))


def test_the_ticket_read_needs_the_warpgroup_barrier(split_matmul):
    lines = split_matmul.ir.split("\n")
    i = next(i for i, line in enumerate(lines) if "ld.shared ticket" in line)
    with pytest.raises(RaceError, match=r"ld\.shared reads ticket_slot\[[01]\] that consumer wg[01] \(elected thread\) "
                                        r"wrote with no barrier of the warpgroup in between"):
        _mutant_run("\n".join(lines[:i - 1] + lines[i:]))


def test_tickets_must_wrap_back_to_zero(split_matmul):
    with pytest.raises(ProtocolError, match=r"workspace tickets is declared zeroed but the kernel left 2 element\(s\) "
                                            r"non-zero .*\(a ticket counter must wrap back to 0"):
        _mutant_run(split_matmul.ir.replace("wrap(splits - 1)", "wrap(splits)"))


# --- the IR nodes in the verifier, the simulator and the emitter -----------------------------

def _ticket_kernel(*consumer: ir.Stmt, params=()) -> ir.Kernel:
    base = (ir.ScalarParam("M", "i32"), ir.HostParam("n", "i32", ir.emax(1, ir.div("num_sms", "M"))),
            ir.WorkspaceParam("tickets", "i32", (V("M"),), zeroed=True))
    return ir.Kernel("tickets", base + params, ir.mul("M", "n"), (1, 1, 1),
                     (ir.SmemDecl("slot", "i32", (1, 1), 0), ir.SmemDecl("wide", "f32", (1, 2), 0)), (),
                     (ir.Role("consumer", 1, 232, consumer),))


SLOT = ir.SmemRef("slot", (C(0),))
TICKET = ir.AtomicInc(SLOT, "tickets", (ir.div("cta_id", "n"),), ir.sub("n", 1))
SYNC = ir.NamedBarrierSync(C(1), 128)


def test_node_text_round_trips():
    k = _ticket_kernel(ir.ElectOne((ir.FenceGpu(), TICKET, ir.FenceGpu())), SYNC, ir.LoadShared("t", SLOT))
    text = print_kernel(k)
    assert text.startswith("kernel tickets(i32 M, i32 n = max(1, num_sms / M), workspace tickets: i32[M] zeroed)")
    assert "      atomic.inc slot[0] <- tickets[cta_id / n] wrap(n - 1)\n" in text
    assert "    ld.shared t = slot[0]\n" in text
    assert parse_kernel(text) == k


def test_every_unit_learns_whether_it_was_last():
    """M tiles of n units (CTAs) each take a ticket of their tile: it counts 0, 1, .., n - 1 and
    wraps back to 0, so exactly one unit of each tile reads n - 1 (and stores 1)."""
    k = _ticket_kernel(
        ir.RegDecl("one", "f32", (1, 1)),
        ir.ElectOne((ir.FenceGpu(), TICKET, ir.FenceGpu())), SYNC, ir.LoadShared("t", SLOT),
        ir.If(ir.eq("t", ir.sub("n", 1)), (ir.TileFill("one", ir.FloatConst(1.0)),),
              (ir.TileFill("one", ir.FloatConst(0.0)),)),
        ir.TileStoreGlobal("last", (V("cta_id"),), "one"),
        params=(ir.GlobalParam("last", "f32", (ir.mul("M", "n"),)),))
    last = torch.full((6,), float("nan"))
    tickets = torch.zeros(2, dtype=torch.int32)
    for seed in range(3):
        simulate(k, {"M": 2, "tickets": tickets, "last": last}, num_sms=6, seed=seed)   # n = 3
        assert tickets.tolist() == [0, 0]
        assert last.view(2, 3).sum(1).tolist() == [1.0, 1.0]


VERIFY_CASES = {
    "atomic-outside-elect": (
        lambda: _ticket_kernel(TICKET),
        "IR line 5 (role consumer > atomic.inc): atomic.inc is one thread's read-modify-write; put it inside "
        "elect_one (with the fence.acq_rel.gpu around it on the same thread)"),
    "atomic-on-f32": (
        lambda: _ticket_kernel(ir.ElectOne((ir.AtomicInc(SLOT, "w", (C(0),), C(1)),)),
                               params=(ir.WorkspaceParam("w", "f32", (V("M"),)),)),
        "IR line 6 (role consumer > elect_one > atomic.inc): atomic.inc on w, which is f32; the counter is an "
        "i32 tensor"),
    "ld-shared-of-two": (
        lambda: _ticket_kernel(ir.LoadShared("t", ir.SmemRef("wide", (C(0),)))),
        "IR line 5 (role consumer > ld.shared t): ld.shared: `wide[0]` is f32[2] of wide; it must select one i32 "
        "element (declare e.g. `smem wide: i32[n, 1]` and index all but the last dim)"),
    "host-param-reads-later-param": (
        lambda: ir.Kernel("h", (ir.HostParam("n", "i32", V("M")), ir.ScalarParam("M", "i32")), C(1), (1, 1, 1),
                          (), (), ()),
        "IR line 1 (kernel h > scalar n): the value of host param n reads `M`; host-side expressions may read "
        "scalar params (and num_sms in the grid) only"),
}


@pytest.mark.parametrize("case", sorted(VERIFY_CASES))
def test_verifier_messages(case):
    build_kernel, expected = VERIFY_CASES[case]
    assert [d.message for d in verify_all(build_kernel(), contract=False)] == [expected]


def test_emitted_cuda_of_the_ticket(split_matmul):
    src = split_matmul.cuda_source
    assert "//   host      splits = min(min(8, max(1, ceil_div(K, 64) / 1)), max(1, num_sms / (ceil_div(M, 128) * " \
           "ceil_div(N, 256)))) (computed per call)" in src
    assert "    int splits,\n" in src and "    float* __restrict__ partials,\n    int* __restrict__ tickets) {" in src
    assert re.search(r"wsp::fence_acq_rel_gpu\(\);\n\s+\*reinterpret_cast<int\*>\(smem_ticket_slot \+ wg \* 4\) = "
                     r"wsp::atomic_inc\(tickets \+ out_tile \* 2 \+ wg, splits - 1\);\n\s+wsp::fence_acq_rel_gpu\(\);",
                     src)
    assert "const int ticket = *reinterpret_cast<volatile int*>(smem_ticket_slot + wg * 4);" in src


@pytest.mark.nvcc
@pytest.mark.parametrize("fusion", [matmul, gated, scaled_silu_f32, linear_relu_residual], ids=lambda f: f.name)
def test_split_k_kernels_build_without_spills(fusion, tmp_path_factory):
    emitted = emit_kernel(ws.lower(fusion, split_k=8))
    result = build.compile_cuda(emitted.source, name=emitted.name, cache_dir=tmp_path_factory.mktemp("splitk"))
    res = result.resources[emitted.name]
    assert (res.spill_stores, res.spill_loads, res.stack_bytes) == (0, 0, 0)
    # wgmma is the only writer of the accumulator: ptxas keeps the k loop's wgmmas in flight
    assert not [w for w in result.warnings if "C7514" in w]


@pytest.mark.parametrize("value", [None, 2.0, "4"])
def test_a_split_k_of_the_wrong_type_is_named(value):
    from wsched.workloads.matmul.schedule import MatmulSchedule

    with pytest.raises(ws.ScheduleError, match=rf"split_k={value!r} must be an int in \[1, 16\]"):
        MatmulSchedule(tile=(128, 256, 64), split_k=value)


def test_the_partials_lie_in_whole_fragment_strips_at_odd_sizes():
    """A weight of 201 rows (nk: N odd, direct stores) and 33 rows of x: the partials are held in
    fragment order (`fragments`), each split's [33, 201] padded to whole [64, 8] strips, [64, 208];
    the padding is stored and never read back into the output."""
    from fusions import linear_relu_residual

    k = ws.compile(linear_relu_residual, split_k=4, split_min_steps=1, epilogue="direct", build=False)
    inputs = inputs_for(linear_relu_residual, 33, 201, 640, seed=5)
    _, scalars, _ = k._bind_inputs(inputs)
    params = k._host_params(scalars, 4)
    partials = next(p for p in k.kernel.params if p.name == "partials")
    assert partials.fragments and params["splits"] == 4
    assert k._workspace(partials, params, "cpu").numel() == 4 * 64 * 208
    out = k.simulate(*inputs, num_sms=4)
    assert out.shape == (33, 201) and not torch.isnan(out.float()).any()
    assert rel_error(out, linear_relu_residual.reference(*inputs)) < 1e-2


@pytest.mark.parametrize("K, num_sms, splits", [
    (728, 132, 1),     # 12 k steps: no split of fewer than 8
    (1024, 132, 2),    # 16 k steps: two splits of 8
    (4096, 132, 8),    # 64 k steps: 8 splits of 8 (16 would fill the SMs, but are shorter)
    (4096, 4, 4),      # the SMs bound it first
])
def test_the_host_splits_no_unit_shorter_than_split_min_steps(K, num_sms, splits):
    """One 128x256 output tile (M 72, N 200): the default `split_min_steps` (8) bounds the split
    count where the SMs would take more; split_min_steps=1 splits as far as the k steps go."""
    from wsched.workloads.matmul.schedule import MIN_K_STEPS_PER_SPLIT

    assert MIN_K_STEPS_PER_SPLIT == 8
    k = ws.compile(matmul, split_k=16, build=False)
    _, scalars, _ = k._bind_inputs(inputs_for(matmul, 72, 200, K, seed=0))
    assert k._host_params(scalars, num_sms)["splits"] == splits
    one = ws.compile(matmul, split_k=16, split_min_steps=1, build=False)
    assert one._host_params(scalars, num_sms)["splits"] == min(16, -(-K // 64), num_sms)


@pytest.mark.parametrize("value", [0, 2.0])
def test_a_bad_split_min_steps_is_named(value):
    with pytest.raises(ws.ScheduleError, match=rf"split_min_steps={value!r} must be an int >= 1 \(the fewest k "
                                               r"steps a split-K unit takes; default 8\)"):
        ws.schedule_for(matmul, split_k=4, split_min_steps=value)
