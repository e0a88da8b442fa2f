"""Timelines (wsched/timeline.py): the simulator's trace events, the Chrome / Perfetto JSON and
the PNG, the instrumented CUDA build (off by default and byte-identical when off), decoding a
GPU record buffer, and (gpu) a traced run on the device."""

from __future__ import annotations

import difflib
import json
import re
import sys

import pytest
import torch

import wsched as ws
from wsched import timeline
from wsched.inputs import random_inputs
from wsched.codegen.emit import emit_kernel
from wsched.lowering.parser import parse_kernel
from wsched.lowering.simulate import SimulationError, simulate
from wsched.lowering.simulate.trace import (ARRIVE, BEGIN, END, STORE, TILE, TMA_LOAD, TMA_STORE, WAIT, WGMMA,
                                            WGMMA_WAIT, roles_of)

from attention_fusions import make_attention
from fusions import mlp

MLP_SIZES = {"M": 256, "N": 512, "K": 256}          # 4 tiles of 128 x 256, 4 k steps each
ATTENTION = make_attention(128, causal=True)
ATTENTION_SIZES = {"B": 1, "H": 1, "S": 384, "T": 384}


@pytest.fixture(scope="module")
def mlp_kernel():
    return ws.compile(mlp, build=False)


@pytest.fixture(scope="module")
def mlp_trace(mlp_kernel):
    tensors = random_inputs(mlp, MLP_SIZES, "cpu")
    outputs, trace = timeline.simulate_trace(mlp_kernel, tensors, num_sms=2)
    return tensors, outputs, trace


def _simulation_args(compiled, tensors):
    inputs, scalars, sizes = compiled._bind_inputs(tensors)
    outs = compiled._outputs(sizes, "cpu")
    return {**compiled._kernel_views({**inputs, **outs}, scalars), **scalars}


# --- the simulator's events ---------------------------------------------------------------------


def test_simulator_records_every_warpgroup_of_every_cta(mlp_trace, mlp_kernel):
    _, _, trace = mlp_trace
    assert (trace.source, trace.clock, trace.kernel) == ("simulator", "steps", "mlp")
    assert trace.roles == (("producer", 0, 1), ("consumer", 1, 2))
    assert trace.ctas == [0, 1]
    for cta in trace.ctas:
        for role, _, count in trace.roles:
            for wg in range(count):
                assert trace.track(cta, role, wg), (cta, role, wg)


def test_simulator_events_follow_the_protocol(mlp_trace):
    _, _, trace = mlp_trace
    k_steps, tiles_per_cta = 4, 2
    for cta in trace.ctas:
        producer = trace.track(cta, "producer", 0)
        categories = [e.category for e in producer]
        assert categories.count(TILE) == tiles_per_cta
        assert categories.count(WAIT) == tiles_per_cta * k_steps                     # wait empty[s]
        assert categories.count(ARRIVE) == tiles_per_cta * k_steps                   # arrive_expect_tx full[s]
        loads = [e for e in producer if e.category == TMA_LOAD]
        assert len(loads) == tiles_per_cta * k_steps * 5                        # A + 4 B boxes per stage
        assert all(e.end > e.begin for e in loads)                              # issue -> landed
        assert {e.label for e in loads} >= {"tma.load A → full[0]", "tma.load B → full[1]"}
        assert all(e.label.startswith("wait empty[") for e in producer if e.category == WAIT)
        for wg in range(2):
            consumer = trace.track(cta, "consumer", wg)
            waits = [e for e in consumer if e.category == WAIT]
            assert [e.label for e in waits][:3] == ["wait full[0]", "wait full[1]", "wait full[2]"]
            groups = [e for e in consumer if e.category == WGMMA]
            assert len(groups) == tiles_per_cta * k_steps                       # one commit group per k step
            assert all(e.end >= e.begin for e in groups)
            assert sum(e.category == WGMMA_WAIT for e in consumer) == tiles_per_cta * (k_steps + 1)
            assert sum(e.category == TMA_STORE for e in consumer) == tiles_per_cta * 4
            assert any(e.category == STORE and e.label == "tile.store_smem C_bf16" for e in consumer)
        for e in trace.events:
            assert e.begin <= e.end and e.args.get("line") is None or isinstance(e.args["line"], int)


def test_a_consumer_wait_ends_after_the_loads_it_waits_for(mlp_trace):
    """The clock is consistent across warpgroups: full[s] completes when its last load lands."""
    _, _, trace = mlp_trace
    loads = [e for e in trace.track(0, "producer", 0) if e.category == TMA_LOAD][:5]   # stage 0, k 0
    first_wait = next(e for e in trace.track(0, "consumer", 0) if e.category == WAIT)
    assert first_wait.label == "wait full[0]"
    assert first_wait.end >= max(e.end for e in loads)


def test_tracing_changes_neither_the_run_nor_the_outputs(mlp_trace, mlp_kernel):
    tensors, outputs, trace = mlp_trace
    args = _simulation_args(mlp_kernel, tensors)
    plain = simulate(mlp_kernel.kernel, args, num_sms=2)
    assert plain.trace is None
    assert plain.steps == trace.meta["steps"]
    assert torch.equal(args["out"], outputs)


def test_a_failed_simulation_carries_the_trace_so_far(mlp_kernel):
    text = str(mlp_kernel.kernel)
    broken = re.sub(r"\n *mbarrier\.arrive empty\[last_s\]", "", text)
    assert broken != text
    kernel = parse_kernel(broken)
    args = _simulation_args(mlp_kernel, random_inputs(mlp, MLP_SIZES, "cpu"))
    with pytest.raises(SimulationError) as failure:
        simulate(kernel, args, num_sms=2, trace=True)
    trace = failure.value.trace
    blocked = [e for e in trace.track(0, "producer", 0) if e.category == WAIT]
    assert blocked and trace.meta["steps"] > 0


# --- JSON and PNG -------------------------------------------------------------------------------


def test_chrome_trace_schema(mlp_trace):
    _, _, trace = mlp_trace
    data = json.loads(json.dumps(timeline.chrome_trace(trace)))
    assert data["otherData"]["source"] == "simulator" and data["otherData"]["kernel"] == "mlp"
    events = data["traceEvents"]
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert names == {(c, t): n for c in (0, 1) for t, n in enumerate(["producer wg0", "consumer wg0", "consumer wg1"])}
    assert {e["args"]["name"] for e in events if e["name"] == "process_name"} == {"CTA 0", "CTA 1"}
    opened = {}
    for e in events:
        assert e["ph"] in {"M", "X", "i", "b", "e"}
        assert isinstance(e["pid"], int)
        if e["ph"] == "M":
            continue
        assert isinstance(e["tid"], int) and e["ts"] >= 0 and e["name"] and e["cat"]
        if e["ph"] == "X":
            assert e["dur"] >= 0
        elif e["ph"] == "i":
            assert e["s"] == "t"
        elif e["ph"] == "b":
            opened[e["id"]] = e
        else:
            start = opened.pop(e["id"])
            assert (start["name"], start["cat"], start["pid"]) == (e["name"], e["cat"], e["pid"])
            assert e["ts"] >= start["ts"]
    assert not opened
    assert {e["cat"] for e in events if e["ph"] == "b"} == {TMA_LOAD, WGMMA}


def test_json_round_trip_and_cta_selection(tmp_path, mlp_trace):
    _, _, trace = mlp_trace
    key = lambda e: (e.cta, e.role, e.warpgroup, e.category, e.label, e.begin, e.end)  # noqa: E731
    back = timeline.read_json(timeline.write_json(trace, tmp_path / "t.json"))
    assert sorted(map(key, back.events)) == sorted(map(key, trace.events))
    assert (back.roles, back.sms, back.meta["steps"]) == (trace.roles, trace.sms, trace.meta["steps"])
    one = timeline.read_json(timeline.write_json(trace, tmp_path / "one.json", ctas=[1]))
    assert one.ctas == [1]


def test_trace_simulated_writes_json_and_png(tmp_path):
    pytest.importorskip("matplotlib")
    trace = timeline.trace_simulated(ATTENTION, ATTENTION_SIZES, tmp_path / "attention.json", num_sms=2)
    assert json.loads((tmp_path / "attention.json").read_text())["traceEvents"]
    assert (tmp_path / "attention.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert trace.meta["fusion"] == ATTENTION.name and trace.meta["sizes"] == ATTENTION_SIZES
    labels = {e.label for e in trace.events}
    assert {"wait k_full[0]", "wait v_full[0]", "wait q_empty[0]", "tile.store o"} <= labels


def test_png_without_matplotlib_says_what_to_install(tmp_path, monkeypatch, mlp_trace):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ModuleNotFoundError, match=r"wsched\[trace\]"):
        timeline.write_png(mlp_trace[2], tmp_path / "x.png")


# --- the instrumented CUDA build ----------------------------------------------------------------


def test_tracing_off_emits_the_same_cuda(mlp_kernel):
    untraced = emit_kernel(mlp_kernel.kernel)
    assert untraced.source == mlp_kernel.cuda_source == emit_kernel(mlp_kernel.kernel, trace=False).source
    assert "wsp_trace" not in untraced.source and untraced.trace_sites is None


@pytest.mark.parametrize("fusion", [mlp, ATTENTION], ids=["mlp", "attention"])
def test_traced_cuda_is_the_untraced_cuda_plus_stamps(fusion):
    kernel = ws.compile(fusion, build=False).kernel
    plain = emit_kernel(kernel).source.splitlines()
    traced = emit_kernel(kernel, trace=True)
    lines = traced.source.splitlines()
    added = []
    for op, i1, i2, j1, j2 in difflib.SequenceMatcher(None, plain, lines, autojunk=False).get_opcodes():
        if op == "replace":   # the last parameter gains a comma, the trace's parameters follow
            assert i2 - i1 == 1 and plain[i1] == lines[j1].removesuffix(",") + ") {", (plain[i1:i2], lines[j1:j2])
            added += lines[j1 + 1:j2]
        else:
            assert op in ("equal", "insert"), (op, plain[i1:i2])
            added += lines[j1:j2] if op == "insert" else []
    allowed = re.compile(r"\s*(if \(threadIdx\.x % 128 == 0\) \{|\}|wsp_trace\.stamp<[01]>\(\d+, .*\);|"
                         r"wsp::Trace wsp_trace\(.*\);|// trace: .*|//   trace .*|"
                         r"uint4\* __restrict__ wsp_trace_buffer,|const int wsp_trace_capacity\) \{)$")
    assert [line for line in added if not allowed.fullmatch(line)] == []
    stamps = [int(m) for m in re.findall(r"wsp_trace\.stamp<[01]>\((\d+),", traced.source)]
    assert sorted(stamps) == list(range(1, len(traced.trace_sites) + 1))
    edges = [s.edge for s in traced.trace_sites]
    assert edges.count(BEGIN) == edges.count(END) > 0


@pytest.mark.nvcc
@pytest.mark.parametrize("fusion", [mlp, ATTENTION], ids=["mlp", "attention"])
def test_instrumented_cuda_builds_like_the_untraced(fusion, tmp_path):
    from wsched.codegen.build import compile_cuda

    compiled = ws.compile(fusion, ws.schedule_for(fusion), build=False)
    plain = compile_cuda(compiled.cuda_source, name="plain", cache_dir=tmp_path)
    traced = timeline.TracedKernel(compiled)
    build = compile_cuda(traced.emitted.source, name="traced", cache_dir=tmp_path)
    name = compiled.kernel.name
    assert build.resources[name].spill_stores == build.resources[name].stack_bytes == 0
    assert build.resources[name].registers == plain.resources[name].registers
    assert len(build.warnings) == len(plain.warnings)   # no wgmma serialization or injected fences


@pytest.mark.nvcc
def test_a_traced_build_that_spills_builds_with_a_warning(tmp_path, monkeypatch):
    """A split-KV decode step builds without spills within its 255 registers; its stamps push the
    traced build over (~120 bytes): the trace is still taken, the spills named."""
    from wsched.workloads.attention.schedule import MAX_SPLIT_KV

    monkeypatch.setenv("WSCHED_CACHE_DIR", str(tmp_path))
    compiled = ws.compile(make_attention(128, gqa=True), tile=(64, 128, 128), consumer_warpgroups=1,
                          split_kv=MAX_SPLIT_KV, pack_gqa=True, build=False)
    traced = timeline.TracedKernel(compiled)
    with pytest.warns(UserWarning, match=r"the traced build of attn_d128_gqa_bf16 spills registers "
                                         r"\(attn_d128_gqa_bf16: \d+ bytes stored, \d+ loaded\)"):
        traced.compile_cuda()
    assert traced.spills["attn_d128_gqa_bf16"][0] > 0


# --- decoding a GPU record buffer ---------------------------------------------------------------


def test_decode_gpu_records(mlp_kernel):
    emitted = emit_kernel(mlp_kernel.kernel, trace=True)
    sites = emitted.trace_sites

    def site(category, edge, label):
        return next(i for i, s in enumerate(sites, 1) if (s.category, s.edge, s.label) == (category, edge, label))

    capacity, ns_per_cycle, sm = 8, 0.5, 7
    records = torch.zeros((1, 3, 2, capacity, 4), dtype=torch.int64)
    stamps = [(site(WAIT, BEGIN, "wait full[{}]"), 2, 1000), (site(WAIT, END, "wait full[{}]"), 2, 3000),
              (site("wgmma.commit", "at", "wgmma.commit"), 0, 3100),
              (site(WGMMA_WAIT, BEGIN, "wgmma.wait {}"), 0, 3200), (site(WGMMA_WAIT, END, "wgmma.wait {}"), 0, 9000)]
    for n, (index, value, clock) in enumerate(stamps):    # consumer wg0 (warpgroup 1), its thread 0
        records[0, 1, 0, n] = torch.tensor([4_000_000_000 + int(clock * ns_per_cycle), clock, index | sm << 16, value])
    records[0, 0, 1, :] = torch.tensor([4_000_001_000, 2000, site(TILE, "at", "tile {}") | sm << 16, 0])   # full
    records = ((records + 2**31) % 2**32 - 2**31).to(torch.int32)     # uint32 words in int32 storage
    trace = timeline.decode_gpu_records(records, sites, roles_of(mlp_kernel.kernel), "mlp")
    assert trace.meta["truncated_streams"] == 1 and trace.meta["ns_per_cycle"] == pytest.approx(ns_per_cycle)
    assert trace.sms == {0: sm} and trace.clock == "ns"
    consumer = {e.category: e for e in trace.track(0, "consumer", 0)}
    assert consumer[WAIT].label == "wait full[2]"
    assert (consumer[WAIT].begin, consumer[WAIT].end) == pytest.approx((0, 1000))
    assert (consumer[WGMMA].begin, consumer[WGMMA].end) == pytest.approx((1050, 4000))   # commit -> retired
    assert consumer[WGMMA_WAIT].label == "wgmma.wait 0"
    assert [e.label for e in trace.track(0, "producer", 0)] == ["tile 0"] * capacity


# --- on the GPU ---------------------------------------------------------------------------------


@pytest.mark.gpu
def test_trace_gpu_matmul(tmp_path):
    sizes = {"M": 512, "N": 512, "K": 512}
    tensors = random_inputs(mlp, sizes, "cuda")
    trace = timeline.trace_gpu(mlp, sizes, tmp_path / "mlp.json", inputs=tensors, png=False)
    assert trace.source == "gpu" and trace.clock == "ns" and not trace.meta["truncated_streams"]
    assert len(trace.ctas) == 8                                   # 8 tiles, 8 CTAs
    for cta in trace.ctas:
        producer = trace.track(cta, "producer", 0)
        assert sum(e.category == TMA_LOAD for e in producer) == 8 * 5
        assert sum(e.category == WAIT for e in producer) == 8
        for wg in range(2):
            consumer = trace.track(cta, "consumer", wg)
            assert sum(e.category == WGMMA for e in consumer) == 8
            assert all(0 <= e.begin <= e.end < 1e7 for e in consumer)
    assert json.loads((tmp_path / "mlp.json").read_text())["otherData"]["source"] == "gpu"
    compiled = ws.compile(mlp, ws.schedule_for(mlp))   # the schedule trace_gpu traced (no per-shape choice)
    outputs, _ = timeline.TracedKernel(compiled)(*tensors)
    assert torch.equal(outputs, compiled(*tensors))               # the stamps change no result
