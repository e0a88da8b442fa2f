"""Schedule: the Hopper default, overrides, and every limit named with the amount it breaks."""

import re

import pytest

from wsched.schedule import ScheduleError, max_stages
from wsched.workloads.matmul.schedule import MatmulSchedule, default_schedule


def test_default_is_the_hopper_heuristic():
    s = default_schedule()
    assert s.tile == (128, 256, 64)
    assert (s.consumer_warpgroups, s.producer_registers, s.consumer_registers) == (2, 24, 240)
    # 4 operand stages of 48 KB fit beside the epilogue's 32 KB of staging slots; 5 do not.
    assert s.stages == 4 == max_stages(s)
    assert s.smem_bytes <= 232448
    assert s.register_use == 128 * 24 + 256 * 240 == 64512


def test_direct_epilogue_frees_room_for_a_fourth_stage():
    s = default_schedule(epilogue="direct")
    assert s.stages == 4


def test_every_field_can_be_overridden():
    s = default_schedule(tile=(128, 128, 64), stages=5, raster="column", swizzle_group=4,
                         producer_registers=24, consumer_registers=240, mma_inflight=0)
    assert (s.tile, s.stages, s.raster, s.swizzle_group) == ((128, 128, 64), 5, "column", 4)
    assert (s.producer_registers, s.consumer_registers, s.mma_inflight) == (24, 240, 0)


def test_one_stage_waits_for_every_mma():
    assert default_schedule(stages=1).mma_inflight == 0


def test_unknown_field_is_rejected():
    with pytest.raises(ScheduleError, match=r"unknown schedule field\(s\) \['stage'\]"):
        default_schedule(stage=3)


@pytest.mark.parametrize("kwargs, message", [
    (dict(stages=6), "shared memory 329728 bytes exceeds the 232448-byte limit by 97280 "
                     "(stages 6 x 49152 + epilogue 32768); use at most 4 stages"),
    (dict(tile=(128, 256, 40)), "BK=40 is not a multiple of 16 (the wgmma k extent); use 32"),
    (dict(tile=(96, 256, 64)), "BM=96 must be a multiple of 64 x consumer_warpgroups=128"),
    (dict(tile=(128, 260, 64)), "BN=260 must be a multiple of 8 in [8, 256]"),
    (dict(producer_registers=40, consumer_registers=240), "register budget exceeded: 128 x 40 + 256 x 240 = 66560 > 64512, "
                                   "the registers a CTA of 384 threads holds (168 per thread), by 2048"),
    # the 65536 of the register file is not the budget: the CTA holds 384 x 168 (this hung on an H100)
    (dict(producer_registers=32, consumer_registers=240), "register budget exceeded: 128 x 32 + 256 x 240 = 65536 > 64512, "
                                   "the registers a CTA of 384 threads holds (168 per thread), by 1024: "
                                   "setmaxnreg.inc would wait forever for the rest"),
    (dict(producer_registers=42, consumer_registers=232), "producer_registers=42 must be a multiple of 8 in [24, 256]"),
    (dict(mode="pingpong"), "a consumer warpgroup's accumulators [128, 256] hold 256 fp32 registers per thread"),
    (dict(epilogue="smem"), "epilogue 'smem' is not one of 'tma_store', 'direct'"),
    (dict(stages=1, mma_inflight=1), "mma_inflight=1 keeps one stage in use while the next is loaded"),
])
def test_invalid_schedules_say_which_limit_and_by_how_much(kwargs, message):
    base = dict(tile=(128, 256, 64), stages=3)
    base.update(kwargs)
    with pytest.raises(ScheduleError, match=re.escape(message)):
        MatmulSchedule(**base)


# --- what the lowering implements: the schedule accepts exactly that -------------------------

@pytest.mark.parametrize("kwargs, message", [
    (dict(tile=(128, 40, 64)), "BN=40 is not supported for matmul: use 64, 128, 192, 256"),
    (dict(tile=(192, 128, 64), consumer_warpgroups=3, consumer_registers=160),
     "consumer_warpgroups=3 is not supported: use 1 or 2 (with 3, a thread starts with 128 registers"),
    (dict(consumer_registers=160), "consumer_registers=160 is below the 168 registers a thread starts with "
                                   "(65536 / 384 threads): setmaxnreg.inc only raises it; use at least 168"),
    (dict(producer_registers=176, consumer_registers=176),
     "producer_registers=176 is above the 168 registers a thread starts with (65536 / 384 threads): "
     "setmaxnreg.dec only lowers it; use at most 168"),
    (dict(swizzle_group=33), "swizzle_group is 33; it must be in [1, 32]"),
    (dict(swizzle_group=2**31), "swizzle_group is 2147483648; it must be in [1, 32]"),
    (dict(operand_bytes=4, tile=(128, 256, 32)), "operand_bytes=4 is not supported: wgmma operands are bf16 or f16"),
    (dict(output_bytes=3), "output_bytes=3 must be one of 2, 4, 6, 8"),
    (dict(stages=5, tile=(128, 256, 64)), "use at most 4 stages"),
    (dict(stages=2.5), "stages=2.5 must be an int, not float"),
    (dict(stages=True), "stages=True must be an int, not bool"),
    (dict(stages="3"), "stages='3' must be an int, not str"),
    (dict(tile=(128, 256)), "tile=(128, 256) must be a tuple of three ints (BM, BN, BK)"),
    (dict(tile=(128.0, 256, 64)), "tile=(128.0, 256, 64) must be a tuple of three ints (BM, BN, BK)"),
    (dict(cluster=(1, 1)), "cluster=(1, 1) must be a tuple of three ints (x, y, z)"),
    (dict(mode=None), "mode None is not one of 'cooperative', 'pingpong'"),
    (dict(raster=1), "raster 1 is not one of 'row', 'column'"),
    (dict(mma_inflight=True), "mma_inflight=True must be an int, not bool"),
])
def test_what_the_lowering_cannot_emit_is_rejected_by_field(kwargs, message):
    base = dict(tile=(128, 256, 64), stages=3)
    base.update(kwargs)
    with pytest.raises(ScheduleError, match=re.escape(message)):
        MatmulSchedule(**base)


def test_one_stage_too_many_says_how_many_fit_in_the_singular():
    from wsched.workloads.attention.schedule import AttentionSchedule
    with pytest.raises(ScheduleError, match=re.escape("use at most 1 stage, a smaller tile")):
        AttentionSchedule(tile=(128, 128, 256), stages=2, mma_inflight=0)


@pytest.mark.parametrize("kwargs, message", [
    (dict(tile=(128, 256, 128)), "BN=256 keys per block with head dim 128, mma_inflight=1 and 2 consumer "
                                 "warpgroup(s) needs more registers than a consumer thread has (168): ptxas "
                                 "spills; use BN <= 192"),
    (dict(tile=(128, 128, 256)), "BN=128 keys per block with head dim 256, mma_inflight=1 and 2 consumer "
                                 "warpgroup(s) needs more registers"),
    (dict(tile=(128, 128, 160)), "head dim (BK) 160 is not one of 64, 96, 128, 192, 256"),
    (dict(epilogue="tma_store"), "attention stores O and LSE with epilogue='direct'"),
    (dict(mode="pingpong", consumer_warpgroups=1, tile=(64, 128, 128), consumer_registers=256),
     "it needs consumer_warpgroups=2 and mma_inflight=1"),
])
def test_attention_takes_what_its_registers_hold(kwargs, message):
    from wsched.workloads.attention.schedule import AttentionSchedule
    base = dict(tile=(128, 128, 128), stages=1)
    base.update(kwargs)
    with pytest.raises(ScheduleError, match=re.escape(message)):
        AttentionSchedule(**base)


def test_lists_and_integer_types_are_normalised():
    import numpy as np
    s = MatmulSchedule(tile=[128, np.int64(128), 64], stages=np.int32(2), cluster=[1, 1, 1])
    assert s.tile == (128, 128, 64) and type(s.tile[1]) is int
    assert type(s.stages) is int and s.cluster == (1, 1, 1)
    assert hash(s) == hash(MatmulSchedule(tile=(128, 128, 64), stages=2))


def test_one_consumer_warpgroup_defaults_to_its_rows_and_registers():
    s = default_schedule(consumer_warpgroups=1)
    assert (s.tile[0], s.consumer_registers) == (64, 256)
    assert default_schedule().consumer_registers == 240


def test_the_base_schedule_is_not_a_schedule_of_any_workload():
    from wsched.schedule import Schedule
    with pytest.raises(ScheduleError, match=r"Schedule is the shared base of the workloads' schedules; build one "
                                            r"with ws\.schedule_for\(fusion, \*\*fields\)"):
        Schedule()


@pytest.mark.parametrize("consumers, producer, expected", [(2, 24, 240), (2, 32, 232), (2, 40, 232), (2, 48, 224),
                                                           (1, 24, 256), (1, 40, 256)])
def test_default_consumer_registers_stay_within_the_ctas_pool(consumers, producer, expected):
    # setmaxnreg moves registers within the 168 x 384 (or 248 x 256) a CTA holds, not the 65536 of
    # the register file: 32 / 240 with two consumer warpgroups hung on an H100 (a paged cache's producer)
    from wsched.schedule import default_consumer_registers
    from wsched.target import register_pool

    assert default_consumer_registers(consumers, producer) == expected
    assert 128 * (producer + consumers * expected) <= register_pool(128 * (1 + consumers))


def test_the_default_raster_group_balances_a_waves_operand_rows():
    """g rows of BM x (wave / g) columns of BN: least rows read at g = sqrt(wave x BN / BM)."""
    import wsched as ws
    from fusions import matmul
    from wsched.workloads.matmul.schedule import balanced_swizzle_group

    assert [balanced_swizzle_group(t) for t in ((128, 256, 64), (128, 128, 64), (64, 128, 64), (256, 128, 64))] == [
        16, 11, 16, 8]
    assert ws.schedule_for(matmul).swizzle_group == 16
    assert ws.schedule_for(matmul, tile=(128, 128, 64)).swizzle_group == 11
    assert ws.schedule_for(matmul, swizzle_group=4).swizzle_group == 4      # an override stays
    assert ws.schedule_for(matmul, raster="column").swizzle_group == 8      # groups of columns: BM and BN swap
