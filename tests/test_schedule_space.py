"""The schedules a workload accepts are the schedules its lowering implements: over the whole field
space (hypothesis), a schedule either raises a ScheduleError whose every problem names a field, or
it lowers, verifies and emits CUDA for a fusion of its workload; every schedule of each workload's
`schedule_space` does; and (nvcc) a sample of the corners builds for sm_90a without spills."""

from __future__ import annotations

import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import wsched as ws
from attention_fusions import make_attention, make_paged_attention
from fusions import linear_relu_residual, mlp, scaled_silu_f32
from wsched.codegen import build
from wsched.codegen.emit import emit_kernel
from wsched.lowering.pipeline import lower_partition
from wsched.schedule import ScheduleError
from wsched.workloads.attention.schedule import HEAD_DIMS, AttentionSchedule
from wsched.workloads.matmul.schedule import MatmulSchedule


@ws.fusion
def bf16_and_f32_outputs(a: ws.Tensor[ws.bf16, "M", "K"], b: ws.Tensor[ws.bf16, "K", "N"]):
    y = ws.gelu(ws.matmul(a, b))
    return y.to(ws.bf16), y


@ws.fusion
def three_output_dtypes(a: ws.Tensor[ws.bf16, "M", "K"], b: ws.Tensor[ws.bf16, "K", "N"]):
    y = ws.matmul(a, b)
    return y.to(ws.bf16), y.to(ws.f16), y


# Matmul fusions by the bytes their outputs stage per element (the schedule's output_bytes).
MATMUL_FUSIONS = {2: (mlp, linear_relu_residual), 4: (scaled_silu_f32,), 6: (bf16_and_f32_outputs,),
                  8: (three_output_dtypes,)}
# The heaviest attention variant (causal bottom-right mask, LSE output, GQA) per head dim.
ATTENTION_FUSIONS = {d: make_attention(d, causal="bottom_right", lse=True, gqa=True) for d in HEAD_DIMS}
PAGED16_D128 = make_paged_attention(128, 16, causal=True, lse=True)   # its producer needs 40 registers

# Every word by which a problem may name the field it is about.
FIELD_WORDS = ("tile", "BM", "BN", "BK", "head dim", "stages", "consumer_warpgroups", "consumer warpgroup",
               "mode", "producer_registers", "consumer_registers", "raster", "swizzle_group", "epilogue",
               "mma_inflight", "cluster", "operand_bytes", "output_bytes", "split_k")


def lowers_verifies_and_emits(fusion, schedule):
    kernel = lower_partition(ws.partition(fusion, schedule), debug=True)   # verified after every pass
    return emit_kernel(kernel)


def assert_names_its_fields(error: ScheduleError):
    header, *problems = str(error).splitlines()
    assert header.startswith("invalid schedule ") and problems, str(error)
    for problem in problems:
        assert any(word in problem for word in FIELD_WORDS), f"names no field: {problem}"


def check(schedule_type, fields, data):
    """Either a ScheduleError naming the fields, or a schedule that lowers, verifies and emits."""
    try:
        schedule = schedule_type(**fields)
    except ScheduleError as e:
        assert_names_its_fields(e)
        return None
    if schedule_type is MatmulSchedule:
        fusion = data.draw(st.sampled_from(MATMUL_FUSIONS[schedule.output_bytes]), label="fusion")
    else:
        fusion = ATTENTION_FUSIONS[schedule.head_dim]
    lowers_verifies_and_emits(fusion, schedule)
    return schedule


# --- well-typed schedules, many of them valid ------------------------------------------------

@st.composite
def typed_fields(draw, workload: str):
    consumers = draw(st.sampled_from([1, 2]))
    bn = draw(st.sampled_from([16, 32, 48, 64, 128, 192, 256] if workload == "attention" else [64, 128, 192, 256]))
    bk = draw(st.sampled_from(HEAD_DIMS)) if workload == "attention" else 64
    producer = draw(st.sampled_from([24, 32, 40]))
    start = 248 if consumers == 1 else 168
    consumer = draw(st.integers(start // 8, (512 - producer) // consumers // 8).map(lambda r: min(256, 8 * r)))
    split = dict(split_k=draw(st.sampled_from([1, 2, 16])),
                 cluster=draw(st.sampled_from([(1, 1, 1), (2, 1, 1), (1, 2, 1), (4, 1, 1), (1, 4, 1)]))
                 ) if workload == "matmul" else {}
    mode = draw(st.sampled_from(["cooperative", "pingpong"]))
    rows = 64 * (draw(st.sampled_from([1, 2])) if workload == "matmul" else 1)     # per warpgroup
    bm = rows * (1 if workload == "matmul" and mode == "pingpong" else consumers)
    return dict(**split, tile=(bm, bn, bk), consumer_warpgroups=consumers, stages=draw(st.integers(1, 5)),
                mode=mode,
                producer_registers=producer, consumer_registers=consumer,
                raster=draw(st.sampled_from(["row", "column"])), swizzle_group=draw(st.integers(1, 32)),
                epilogue=draw(st.sampled_from(["direct"] if workload == "attention" else ["tma_store", "direct"])),
                mma_inflight=draw(st.sampled_from([0, 1])),
                output_bytes=draw(st.sampled_from([2, 4, 6, 8])))


# --- the whole field space: any value of any field, wrong types included ----------------------

ANY_VALUE = {
    "tile": st.one_of(st.tuples(st.sampled_from([64, 128, 192, 256, 0, -64, 96]),
                                st.sampled_from([8, 16, 32, 40, 48, 56, 64, 72, 128, 192, 256, 260]),
                                st.sampled_from([16, 32, 64, 128, 256, 96])),
                      st.sampled_from([None, (128, 256), [128, 256, 64], (128.0, 256, 64), (True, 256, 64),
                                       "128x256x64", (128, 256, 64, 1)])),
    "stages": st.one_of(st.integers(-1, 8), st.sampled_from([2.5, "3", None, True, 2**40])),
    "consumer_warpgroups": st.sampled_from([1, 2, 0, 3, 4, -1, 1.0, None, True, 2**31]),
    "mode": st.sampled_from(["cooperative", "pingpong", None, 1, "Cooperative"]),
    "producer_registers": st.sampled_from([24, 32, 40, 168, 176, 256, 23, 0, -8, "24", 24.0]),
    "consumer_registers": st.sampled_from([168, 200, 232, 240, 248, 256, 24, 160, 1000, None, 240.0]),
    "raster": st.sampled_from(["row", "column", None, "diagonal", 0]),
    "swizzle_group": st.one_of(st.integers(-2, 40), st.sampled_from([2**31, 1.5, "8", True])),
    "epilogue": st.sampled_from(["tma_store", "direct", None, "TMA", 0]),
    "mma_inflight": st.sampled_from([0, 1, 2, -1, True, None, 1.0]),
    "cluster": st.sampled_from([(1, 1, 1), [1, 1, 1], (2, 1, 1), (1, 1), None, (1.0, 1, 1)]),
    "operand_bytes": st.sampled_from([2, 1, 4, 2.0, None]),
    "output_bytes": st.sampled_from([2, 4, 6, 8, 1, 3, 16, None, 2.0]),
}
ANY_MATMUL_VALUE = {"split_k": st.sampled_from([1, 4, 16, 0, 17, -1, 2.0, None, True])}


@st.composite
def any_fields(draw, workload: str):
    """A well-typed schedule with up to three fields set to any value of the field's space."""
    fields = draw(typed_fields(workload))
    space = {**ANY_VALUE, **(ANY_MATMUL_VALUE if workload == "matmul" else {})}
    for name in draw(st.lists(st.sampled_from(sorted(space)), max_size=3, unique=True)):
        fields[name] = draw(space[name])
    return fields


SETTINGS = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
WORKLOADS = [(MatmulSchedule, "matmul"), (AttentionSchedule, "attention")]


@pytest.mark.parametrize("schedule_type, workload", WORKLOADS, ids=[w for _, w in WORKLOADS])
@SETTINGS
@given(data=st.data())
def test_any_schedule_is_rejected_by_field_or_lowers_verifies_and_emits(schedule_type, workload, data):
    check(schedule_type, data.draw(any_fields(workload), label="fields"), data)


@pytest.mark.parametrize("schedule_type, workload", WORKLOADS, ids=[w for _, w in WORKLOADS])
@SETTINGS
@given(data=st.data())
def test_every_valid_schedule_lowers_verifies_and_emits(schedule_type, workload, data):
    check(schedule_type, data.draw(typed_fields(workload), label="fields"), data)


# --- each workload's schedule space ------------------------------------------------------------

@pytest.mark.parametrize("fusion", [mlp, linear_relu_residual, scaled_silu_f32, bf16_and_f32_outputs,
                                    *ATTENTION_FUSIONS.values(), PAGED16_D128], ids=lambda f: f.name)
def test_every_schedule_of_the_space_lowers_verifies_and_emits(fusion):
    space = list(ws.workload_for(fusion).schedule_space(fusion))
    assert space and ws.schedule_for(fusion) in space
    for schedule in space:
        emit_kernel(lower_partition(ws.partition(fusion, schedule)))   # verified once, at the end


# --- nvcc: the corners build without spills ---------------------------------------------------

CORNERS = {
    "matmul_one_consumer_bn256_residual": (linear_relu_residual, dict(consumer_warpgroups=1)),
    "matmul_bn64_bf16_and_f32_staged": (bf16_and_f32_outputs, dict(tile=(128, 64, 64))),
    "matmul_split_k_bf16_and_f32_staged": (bf16_and_f32_outputs, dict(split_k=16)),
    "matmul_split_k_one_consumer_residual": (linear_relu_residual, dict(consumer_warpgroups=1, split_k=16)),
    "matmul_stream_k_bf16_and_f32_staged": (bf16_and_f32_outputs, dict(stream_k=True)),
    "attention_d128_bn192_pingpong": (ATTENTION_FUSIONS[128], dict(tile=(128, 192, 128), stages=2, mode="pingpong")),
    "attention_d256_one_consumer_bn128": (ATTENTION_FUSIONS[256], dict(tile=(64, 128, 256), consumer_warpgroups=1,
                                                                        mma_inflight=0)),
}


@pytest.mark.nvcc
@pytest.mark.parametrize("case", sorted(CORNERS))
def test_corners_of_the_space_build_for_sm90a_without_spills(case, tmp_path_factory):
    fusion, overrides = CORNERS[case]
    emitted = emit_kernel(ws.lower(fusion, **overrides))
    result = build.compile_cuda(emitted.source, name=emitted.name, cache_dir=tmp_path_factory.mktemp("space"))
    res = result.resources[emitted.name]
    assert (res.spill_stores, res.spill_loads, res.stack_bytes) == (0, 0, 0)
    assert not [w for w in result.warnings if re.search(r"C7508|setmaxnreg", w)]


@pytest.mark.parametrize("paged", [True, False], ids=["paged16", "contiguous"])
def test_the_attention_space_fits_the_fusion_and_holds_the_per_call_variants(paged):
    """The search space (autotuner, GPU fuzzer) is fitted to the fusion — a paged cache's producer
    needs 40 registers for 8 page indices, which a 24-register schedule refuses — and holds the
    decode-side kernels ws.compile picks per call (64-row tiles, split-KV, GQA packing), so a search
    at a decode shape can find them."""
    from wsched.autotune import candidates_for

    f = (make_paged_attention(128, 16, causal=True, lse=True) if paged
         else make_attention(128, causal="bottom_right", lse=True, gqa=True))
    workload = ws.workload_for(f)
    space = list(workload.schedule_space(f))
    variants = [v.schedule for v in workload.variants(f, workload.default_schedule(f))]
    assert len(variants) == 2 and all(v in space and v in candidates_for(f) for v in variants)
    assert any(s.consumer_warpgroups == 1 and s.pack_gqa and s.splits_kv for s in space)
    producers = {s.producer_registers for s in space if s.bn == 128 and s.consumer_warpgroups == 2}
    assert producers == ({40, 48} if paged else {24})   # 48: with split-KV's range beside the page indices
