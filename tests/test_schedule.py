"""Schedule: the Hopper default, overrides, and every limit named with the amount it breaks."""

import re

import pytest

from wsched.schedule import ScheduleError, max_stages
from wsched.workloads.matmul.schedule import MatmulSchedule, default_schedule


def test_default_is_the_hopper_heuristic():
    s = default_schedule()
    assert s.tile == (128, 256, 64)
    assert (s.consumer_warpgroups, s.producer_registers, s.consumer_registers) == (2, 24, 240)
    # 3 operand stages of 48 KB fit beside the 64 KB epilogue staging buffer; 4 do not.
    assert s.stages == 3 == max_stages(s)
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
    (dict(stages=6), "shared memory 362496 bytes exceeds the 232448-byte limit by 130048 "
                     "(stages 6 x 49152 + epilogue 65536); use at most 3 stages"),
    (dict(tile=(128, 256, 40)), "BK=40 is not a multiple of 16 (the wgmma k extent); use 32"),
    (dict(tile=(96, 256, 64)), "BM=96 must be a multiple of 64 x consumer_warpgroups=128"),
    (dict(tile=(128, 260, 64)), "BN=260 must be a multiple of 8 in [8, 256]"),
    (dict(producer_registers=40, consumer_registers=240), "register budget exceeded: 128 x 40 + 256 x 240 = 66560 > 65536 "
                                   "per SM by 1024"),
    (dict(producer_registers=42, consumer_registers=232), "producer_registers=42 must be a multiple of 8 in [24, 256]"),
    (dict(mode="pingpong"), "mode 'pingpong' is not implemented for matmul yet; use 'cooperative'"),
    (dict(epilogue="smem"), "epilogue 'smem' is not one of 'tma_store', 'direct'"),
    (dict(stages=1, mma_inflight=1), "mma_inflight=1 keeps one stage in use while the next is loaded"),
])
def test_invalid_schedules_say_which_limit_and_by_how_much(kwargs, message):
    base = dict(tile=(128, 256, 64), stages=3)
    base.update(kwargs)
    with pytest.raises(ScheduleError, match=re.escape(message)):
        MatmulSchedule(**base)
