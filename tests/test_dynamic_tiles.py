"""Tiles taken from a counter (lowering/passes/dynamic_tiles.py): where attention's tiles differ
in work (causal, sliding windows, packed sequences) each CTA takes its next tile from a global
counter that the producer hands to the consumers through a two-slot ring; the simulator runs the
CTAs against one counter (and checks that the launch leaves it at zero), the verifier checks the
loop's form."""

import re

import pytest
import torch

import wsched as ws
from wsched.lowering import ir
from wsched.lowering.parser import parse_kernel
from wsched.lowering.printer import print_kernel
from wsched.lowering.verify import VerifyError, verify
from wsched.workloads.attention.schedule import MAX_SPLIT_KV

from attention_fusions import attention_inputs, make_attention, make_paged_attention, make_variant


def compiled(fusion, **overrides):
    schedule = ws.schedule_for(fusion, **overrides)
    return ws.CompiledKernel(fusion, schedule, ws.partition(fusion, schedule), ws.lower(fusion, schedule),
                             cuda_source="")


def tile_loops(kernel):
    return [(r.name, s) for r in kernel.roles() for s in ir.walk(r.body) if isinstance(s, ir.For) and s.var == "tile"]


def test_causal_tiles_come_from_the_counter_in_both_roles():
    kernel = ws.lower(make_attention(64, causal=True, lse=True))
    assert [(role, loop.iteration) for role, loop in tile_loops(kernel)] == [("producer", "dynamic"), ("consumer", "dynamic")]
    text = print_kernel(kernel)
    assert "workspace tile_counter: i32[1] zeroed" in text and "i32 section = max(1, num_sms / 16)" in text
    assert text.count("for tile in dynamic(cta_id, num_tiles, tile_next) {") == 2
    assert "atomic.inc tile_slot[tile_s] <- tile_counter[0] wrap(num_tiles - 1)" in text
    assert "mbarrier.init tile_full arrivals(1)\n  mbarrier.init tile_empty arrivals(2)\n  fence.mbarrier_init" in text


@pytest.mark.parametrize("fusion, overrides", [
    (make_attention(64), {}),                                                   # tiles of equal work
    (make_attention(64, causal="bottom_right", lse=True), {"split_kv": MAX_SPLIT_KV}),   # split-KV units
    (make_paged_attention(256, 16, causal=True, lse=True), {}),                 # no register margin
], ids=["not-causal", "split-kv", "paged-d256"])
def test_static_tile_loops_where_the_counter_does_not_apply(fusion, overrides):
    kernel = ws.lower(fusion, **overrides)
    assert {loop.iteration for _, loop in tile_loops(kernel)} == {"persistent"}
    assert "tile_counter" not in print_kernel(kernel)


@pytest.mark.parametrize("variant, num_sms, seed", [("causal", 32, 0), ("window", 5, 1), ("causal", 3, 2)])
def test_ctas_take_tiles_from_the_counter_and_match_the_reference(variant, num_sms, seed):
    """More tiles than CTAs, tiles of 1..4 kv blocks; on 32 SMs the order walks sections of 2
    heads. Outputs poisoned (the simulator's fresh outputs are NaN); the counter is left at 0."""
    f = make_variant(64, variant, window=200)
    k = compiled(f)
    assert {loop.iteration for _, loop in tile_loops(k.kernel)} == {"dynamic"}
    q, kk, v = attention_inputs(3, 4, 500, 500, 64, seed=seed)   # 12 heads x 4 m-blocks = 48 tiles
    o, lse = k.simulate(q, kk, v, num_sms=num_sms, seed=seed)
    ro, rlse = f.reference(q, kk, v)
    assert float((o.float() - ro.float()).norm() / ro.float().norm()) < 1e-2
    assert float((lse - rlse).norm() / rlse.norm()) < 1e-3


def test_a_dynamic_loop_takes_its_next_tile_from_a_var_its_body_sets():
    text = print_kernel(ws.lower(make_attention(64, causal=True)))
    bad = text.replace("for tile in dynamic(cta_id, num_tiles, tile_next)", "for tile in dynamic(cta_id, num_tiles, 1)", 1)
    with pytest.raises(VerifyError, match=re.escape(
            "dynamic(cta_id, num_tiles, 1): the next value of a dynamic loop is a `var` declared before the loop "
            "that its body sets (`set 1 = ...`)")):
        verify(parse_kernel(bad))
    unset = text.replace("        set tile_next = fetched + num_ctas\n", "", 1)
    with pytest.raises(VerifyError, match=re.escape("the next value of a dynamic loop is a `var` declared before "
                                                    "the loop that its body sets (`set tile_next = ...`)")):
        verify(parse_kernel(unset))
