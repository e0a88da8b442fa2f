"""The schedules the compiler picks (the default, the per-call variants) never fail on a register
spill while a lighter schedule of the workload builds (`Workload.lighter`,
`kernel.build_without_spills`); a schedule the user gives is built as given. The builds are faked:
`CompiledKernel.compile_cuda` raises the BuildError ptxas's report gives for a spill."""

import pytest

import wsched as ws
from wsched.codegen.nvcc import BuildError
from wsched.kernel import CompiledKernel
from wsched.workloads import workload_for

from attention_fusions import make_attention, make_paged_attention


def spills_where(monkeypatch, spills, error=None):
    """compile_cuda raises a spill for schedules where `spills(schedule)`; records every build."""
    built = []

    def compile_cuda(self):
        built.append(self.schedule)
        if error is not None:
            raise error
        if spills(self.schedule):
            raise BuildError(f"register spills in {self.kernel.name!r} (spills are an error; allow_spills=True "
                             f"to accept them):\n  kernel {self.kernel.name!r}: 168 registers, 8 bytes spill stores, "
                             f"8 bytes spill loads, 8 bytes stack frame", spills=True)
        self.build = "built"
    monkeypatch.setattr(CompiledKernel, "compile_cuda", compile_cuda)
    return built


def shape(s):
    return (s.tile, s.mma_inflight)


def test_attention_offers_the_softmax_unoverlapped_then_fewer_keys():
    f = make_paged_attention(256, 32, causal=True, lengths=False, lse=True)
    default = ws.schedule_for(f)
    assert shape(default) == ((128, 64, 256), 1)
    assert [shape(s) for s in workload_for(f).lighter(f, default)] == [
        ((128, 64, 256), 0), ((128, 32, 256), 1), ((128, 32, 256), 0)]


def test_compile_builds_the_first_lighter_schedule_that_does_not_spill(monkeypatch):
    built = spills_where(monkeypatch, lambda s: s.bn == 128)
    f = make_attention(128, causal=True, lse=True)
    k = ws.compile(f, build=True)
    assert shape(k.primary.schedule) == ((128, 64, 128), 1)
    assert [shape(s) for s in built] == [((128, 128, 128), 1), ((128, 128, 128), 0), ((128, 64, 128), 1)]


def test_a_spill_of_every_candidate_names_each(monkeypatch):
    spills_where(monkeypatch, lambda s: True)
    f = make_attention(128, causal=True, lse=True)
    with pytest.raises(BuildError) as info:
        ws.compile(f, build=True)
    lines = str(info.value).splitlines()
    assert info.value.spills and lines[0] == (
        "attn_d128_causal_lse_bf16: the schedule the compiler picked and each lighter one spill registers (spills "
        "are build errors); pass a schedule of your own:")
    assert lines[1:] == [
        f"  {s}: kernel 'attn_d128_causal_lse_bf16': 168 registers, 8 bytes spill stores, 8 bytes spill loads, "
        f"8 bytes stack frame" for s in (
            "128x128x128 stages=3 consumers=2 regs=24/240 epilogue=direct",
            "128x128x128 stages=3 consumers=2 regs=24/240 epilogue=direct mma_inflight=0",
            "128x64x128 stages=3 consumers=2 regs=24/240 epilogue=direct",
            "128x64x128 stages=3 consumers=2 regs=24/240 epilogue=direct mma_inflight=0",
            "128x32x128 stages=3 consumers=2 regs=24/240 epilogue=direct",
            "128x32x128 stages=3 consumers=2 regs=24/240 epilogue=direct mma_inflight=0")]


def test_a_schedule_the_user_gives_is_built_as_given(monkeypatch):
    built = spills_where(monkeypatch, lambda s: True)
    f = make_attention(128, causal=True)
    with pytest.raises(BuildError, match=r"^register spills in 'attn_d128_causal_bf16'"):
        ws.compile(f, ws.schedule_for(f), build=True)
    with pytest.raises(BuildError, match=r"^register spills in 'attn_d128_causal_bf16'"):
        ws.compile(f, tile=(128, 64, 128), build=True)
    assert len(built) == 2


def test_other_build_errors_are_not_retried(monkeypatch):
    built = spills_where(monkeypatch, None, error=BuildError("nvcc failed: syntax error"))
    with pytest.raises(BuildError, match="^nvcc failed: syntax error$"):
        ws.compile(make_attention(64), build=True)
    assert len(built) == 1


def test_a_per_call_variant_that_spills_takes_a_lighter_schedule(monkeypatch):
    # the decode variant (64-row tiles, split-KV) spills at 128 keys a block: it runs with 64
    spills_where(monkeypatch, lambda s: s.consumer_warpgroups == 1 and s.bn == 128)
    f = make_attention(128, causal="bottom_right", lse=True, gqa=True)
    k = ws.compile(f, build=True)
    from attention_fusions import attention_inputs

    variant = k.choose(attention_inputs(1, 8, 1, 2000, 128, gqa_groups=4), 132)   # S = 1: the decode variant
    assert variant.schedule.consumer_warpgroups == 1 and variant.schedule.bn == 64 and variant.schedule.split_kv > 1
    assert not k.dropped
    assert k.describe().splitlines()[1].startswith("  64x64x128 stages=3 consumers=1")   # the schedule built


def test_a_spill_of_a_given_schedule_says_what_the_caller_can_do(monkeypatch):
    # ptxas's own report (codegen) offers allow_spills, which ws.compile does not take
    from wsched.codegen import build as codegen_build

    def spilling(source, **kwargs):
        raise BuildError("register spills in 'attn_d128_causal_bf16' (spills are an error; allow_spills=True to "
                         "accept them):\n  kernel 'attn_d128_causal_bf16': 168 registers, 8 bytes spill stores, "
                         "8 bytes spill loads, 8 bytes stack frame\n  source: /cache/kernel.cu", spills=True)
    monkeypatch.setattr(codegen_build, "compile_cuda", spilling)
    f = make_attention(128, causal=True)
    with pytest.raises(BuildError) as info:
        ws.compile(f, tile=(128, 64, 128), build=True)
    assert info.value.spills and str(info.value).splitlines() == [
        "register spills in 'attn_d128_causal_bf16' with the schedule 128x64x128 stages=3 consumers=2 regs=24/240 "
        "epilogue=direct (spills are build errors; fewer keys or columns per tile, or mma_inflight=0, need fewer "
        "registers, and ws.compile without a schedule tries such schedules itself):",
        "  kernel 'attn_d128_causal_bf16': 168 registers, 8 bytes spill stores, 8 bytes spill loads, 8 bytes stack "
        "frame",
        "  source: /cache/kernel.cu"]


def test_matmul_offers_no_mma_in_flight_then_narrower_tiles(monkeypatch):
    from fusions import gated

    built = spills_where(monkeypatch, lambda s: s.bn == 256)
    k = ws.compile(gated, build=True)
    assert shape(k.primary.schedule) == ((128, 128, 64), 1)
    assert [s.short() for s in built] == [
        "128x256x64 stages=4 consumers=2 regs=24/240 epilogue=tma_store",
        "128x256x64 stages=4 consumers=2 regs=24/240 epilogue=tma_store mma_inflight=0",
        "128x128x64 stages=4 consumers=2 regs=24/240 epilogue=tma_store"]


def test_a_lighter_schedule_that_fails_otherwise_says_it_was_a_fallback(monkeypatch):
    def compile_cuda(self):
        if self.schedule.bn == 128 and self.schedule.mma_inflight:
            raise BuildError("register spills in 'k':\n  kernel 'k': 168 registers, 8 bytes spill stores", spills=True)
        raise BuildError("nvcc failed: out of memory")
    monkeypatch.setattr(CompiledKernel, "compile_cuda", compile_cuda)
    with pytest.raises(BuildError) as info:
        ws.compile(make_attention(128), build=True)
    assert str(info.value) == (
        "attn_d128_bf16: the schedule 128x128x128 stages=3 consumers=2 regs=24/240 epilogue=direct spilled "
        "registers, and building the lighter 128x128x128 stages=3 consumers=2 regs=24/240 epilogue=direct "
        "mma_inflight=0 instead failed: nvcc failed: out of memory")
    assert not info.value.spills


def test_a_split_decode_variant_offers_its_tiles_unsplit_last():
    # 64x32x256 with split-KV and a top-left causal mask spilled 12 bytes (the merge's registers
    # beside the 256-wide O): no narrower tile is left, the unsplit one builds
    f = make_attention(256, causal=True, lse=True)
    variant = ws.compile(f, build=False).variants[0].schedule
    assert (variant.tile, variant.mma_inflight, variant.split_kv > 1) == ((64, 32, 256), 0, True)
    assert [(s.tile, s.mma_inflight, s.split_kv) for s in workload_for(f).lighter(f, variant)] == [
        ((64, 32, 256), 0, 1)]


def test_a_split_variant_that_spills_runs_unsplit(monkeypatch):
    spills_where(monkeypatch, lambda s: s.split_kv > 1 and s.consumer_warpgroups == 1)
    f = make_attention(256, causal=True, lse=True)
    k = ws.compile(f, build=True)
    from attention_fusions import attention_inputs

    variant = k.choose(attention_inputs(1, 8, 1, 2000, 256), 132)   # S = 1: the decode variant, unsplit
    assert (variant.schedule.tile, variant.schedule.split_kv, variant.schedule.consumer_warpgroups) == ((64, 32, 256), 1, 1)
    assert not k.dropped
