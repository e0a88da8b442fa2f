"""The workload seam: matching, schedules, the route each workload takes through the one
pipeline, the names the lowering reserves, and no workload checks outside the plug-ins."""

import re
import subprocess
from pathlib import Path

import pytest

import wsched as ws
from wsched.lowering import ir, pipeline
from wsched.names import LOWERING_NAMES
from wsched.schedule import ScheduleError
from wsched.target import SMEM_LIMIT
from wsched.workloads import ATTENTION, MATMUL, WORKLOADS, workload_for, workload_named
from wsched.workloads.attention.schedule import AttentionSchedule
from wsched.workloads.matmul.schedule import MatmulSchedule

from attention_fusions import make_attention, make_biased
from fusions import linear_relu_residual, matmul, mlp, scaled_silu_f32

ROOT = Path(__file__).resolve().parent.parent


def test_each_fusion_is_taken_by_one_workload():
    assert workload_for(mlp) is MATMUL and workload_for(make_attention(128)) is ATTENTION
    assert isinstance(ws.schedule_for(mlp), MatmulSchedule)
    assert isinstance(ws.schedule_for(make_attention(64)), AttentionSchedule)
    assert ws.schedule_for(make_attention(256)).head_dim == 256


def test_a_fusion_no_workload_takes_names_every_reason():
    @ws.fusion
    def three(a: ws.Tensor[ws.bf16, "M", "K"], b: ws.Tensor[ws.bf16, "K", "N"], c: ws.Tensor[ws.bf16, "N", "P"]):
        return ws.matmul(ws.matmul(a, b).to(ws.bf16), c)

    with pytest.raises(ScheduleError, match=re.escape(
            "no workload takes three: attention needs matmul -> softmax -> matmul (found 2 matmul(s), "
            "0 softmax(es)); matmul needs exactly one matmul (found 2)")):
        ws.schedule_for(three)


def test_a_schedule_of_another_workload_is_refused():
    with pytest.raises(ScheduleError, match="mlp is taken by the matmul workload; its schedule must be a MatmulSchedule, not AttentionSchedule"):
        MATMUL.partition(mlp, ws.schedule_for(make_attention(128)))
    with pytest.raises(ScheduleError, match=r"unknown workload 'conv'; known: attention, matmul"):
        workload_named("conv")


@pytest.mark.parametrize("workload, fusion", [(MATMUL, mlp), (MATMUL, scaled_silu_f32), (ATTENTION, make_attention(64)),
                                              (ATTENTION, make_attention(256, causal=True))],
                         ids=["mlp", "silu_f32", "attn64", "attn256"])
def test_schedule_space_holds_the_default_and_only_valid_schedules(workload, fusion):
    space = list(workload.schedule_space(fusion))
    assert len(space) > 5 and len(set(space)) == len(space)
    assert all(type(s) is workload.schedule_type and s.smem_bytes <= SMEM_LIMIT for s in space)
    assert workload.default_schedule(fusion) in space
    # every schedule of the space partitions the fusion
    for s in space[:: max(1, len(space) // 6)]:
        assert workload.partition(fusion, s).schedule == s


def test_pipeline_docstring_lists_every_route():
    """The routes printed in lowering/pipeline.py's docstring are the ones the pipeline runs."""
    doc = " ".join(pipeline.__doc__.split())
    for workload in WORKLOADS:
        names = [s.name + (f" (if {s.condition})" if s.condition else "") for s in pipeline.route(workload)]
        assert f"{workload.name}: {', '.join(names)}" in doc, workload.name
    assert pipeline.pass_names(ATTENTION, ws.schedule_for(make_attention(64), mma_inflight=0)) == (
        "build_loops", "circular_buffer", "insert_barriers", "lower_tma", "lower_mma", "epilogue", "defer_row_loads",
        "dynamic_tiles", "reg_realloc")
    # dynamic_tiles leaves a kernel without a tile counter (not causal) as it is, defer_row_loads
    # one without per-row score inputs
    assert "pingpong" in pipeline.pass_names(ATTENTION, ws.schedule_for(make_attention(64), mode="pingpong"))


@pytest.mark.parametrize("fusion, overrides", [
    (matmul, {}), (mlp, dict(epilogue="direct")), (linear_relu_residual, {}), (scaled_silu_f32, {}),
    (make_attention(128, causal=True, lse=True), {}), (make_attention(64, causal="bottom_right", gqa=True), {}),
    (make_attention(64), dict(mode="pingpong")),
    (make_biased(lambda s, i, j, u, p: s + u * (j - i) + 0.5 * (j - i)), {}),
    # split-KV: the merge's chunks, groups and linear tiles
    (make_attention(128, causal="bottom_right", lse=True, gqa=True),
     dict(tile=(64, 128, 128), consumer_warpgroups=1, split_kv=32, pack_gqa=True)),
    (make_biased(lambda s, i, j, u, p: s + u * (j - i), d=128, align="bottom_right"),
     dict(tile=(64, 128, 128), consumer_warpgroups=1, split_kv=32))], ids=lambda x: getattr(x, "name", str(x)))
def test_every_name_the_lowering_declares_is_reserved(fusion, overrides):
    """A fusion input named like any of these is renamed (`param_name`), so the set must hold
    every name a pass invents."""
    kernel = ws.lower(fusion, **overrides)
    params = {p.name for p in kernel.params}
    declared = {b.name for b in kernel.barriers} | {b.name for b in kernel.smem} | {r.name for r in kernel.roles()}
    for s in ir.walk(kernel.body):
        if isinstance(s, (ir.Let, ir.RegDecl)):
            declared.add(s.name)
        elif isinstance(s, ir.For):
            declared.add(s.var)
    invented = {n for n in declared - params
                if not re.fullmatch(r"(b|batch|rest|out)\d+|C_\w+|\w+_t|\w+_full|\w+_empty|K", n)}
    assert invented <= LOWERING_NAMES, sorted(invented - LOWERING_NAMES)


def test_no_workload_checks_outside_the_plug_ins():
    found = subprocess.run(["grep", "-rnE", r"kind ==|\.kind\b|workload(\.name)? ?==|isinstance\([^)]*(Matmul|Attention)(Schedule|Payload|Workload)",
                            "wsched", "lowering", "codegen"],
                           cwd=ROOT, capture_output=True, text=True).stdout.splitlines()
    assert [line for line in found if not line.startswith("wsched/workloads/")] == []
