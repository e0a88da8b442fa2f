"""Matmul with thread-block clusters and TMA multicast: the CTAs of a cluster take output tiles next
to each other (along M they share a B tile, along N an A tile), each loads one piece of the shared
tile and multicasts it to all; a stage is free once the consumers of every CTA have read it.

Every layer: the schedule's rules, the golden IR, the verifier's messages, the simulator against
torch (odd shapes, K < BK, fewer and more tiles than clusters, every stage reused, batched), the
simulator catching a broken cluster protocol, the emitted CUDA, and nvcc.
"""

from __future__ import annotations

import re
import shutil

import pytest
import torch

import wsched as ws
from fusions import gated, inputs_for, linear_relu_residual, matmul, mlp
from wsched.codegen.emit import emit_kernel
from wsched.lowering.parser import parse_kernel
from wsched.lowering.printer import print_kernel
from wsched.lowering.simulate import DeadlockError, ProtocolError, simulate
from wsched.lowering.verify import VerifyError, verify
from wsched.schedule import ScheduleError


from test_simulate_lowered import check, rel_error   # simulated against torch, outputs poisoned


# --- the schedule --------------------------------------------------------------------------------

def test_cluster_shapes_the_matmul_schedule_takes():
    assert ws.schedule_for(matmul, cluster=(2, 1, 1)).short().endswith("cluster=2x1x1")
    with pytest.raises(ScheduleError, match=re.escape(
            "cluster (2, 2, 1): use (n, 1, 1) (CTAs on tiles along M, sharing B) or (1, n, 1) (along N, sharing A) "
            "with n in (1, 2, 4)")):
        ws.schedule_for(matmul, cluster=(2, 2, 1))
    with pytest.raises(ScheduleError, match=re.escape(
            "cluster (2, 1, 1) with split_k=4: a cluster's CTAs walk whole tiles together; use split_k=1 or "
            "cluster (1, 1, 1)")):
        ws.schedule_for(matmul, cluster=(2, 1, 1), split_k=4)
    with pytest.raises(ScheduleError, match=re.escape(
            "cluster (2, 1, 1) with mode 'pingpong': clusters are built for the cooperative schedule; use "
            "mode='cooperative' or cluster (1, 1, 1)")):
        ws.schedule_for(matmul, cluster=(2, 1, 1), mode="pingpong")
    with pytest.raises(ScheduleError, match=re.escape(
            "cluster (1, 2, 1) with BM=256: each CTA loads 256/2 rows of the shared A tile, which must be whole "
            "8-row swizzle atoms within one block of 64 rows; use a cluster along M or BM <= 128")):
        ws.schedule_for(matmul, cluster=(1, 2, 1), tile=(256, 128, 64))


def test_attention_takes_no_cluster():
    from attention_fusions import make_attention

    with pytest.raises(ScheduleError, match=re.escape(
            "cluster (2, 1, 1): the attention workload has no cluster schedule; use (1, 1, 1)")):
        ws.schedule_for(make_attention(64), cluster=(2, 1, 1))


# --- the kernel ----------------------------------------------------------------------------------

def test_cluster_kernel_ir_is_golden(golden):
    golden.check("matmul_cluster.ir", print_kernel(ws.lower(matmul, cluster=(2, 1, 1))))


@pytest.mark.parametrize("cluster", [(2, 1, 1), (1, 2, 1)])
def test_every_pass_leaves_a_kernel_that_verifies(monkeypatch, cluster):
    monkeypatch.setenv("WSCHED_DEBUG", "1")   # verify after every pass
    k = ws.lower(gated, cluster=cluster)
    assert "cluster.sync" in print_kernel(k.ir_after["insert_barriers"])


def test_the_cluster_protocol_in_the_ir():
    text = print_kernel(ws.lower(mlp, cluster=(1, 2, 1)))
    assert "cluster(2, 1, 1)" in text
    assert "grid(min(num_sms / 2, ceil_div(M, 128) * ceil_div(ceil_div(N, 256), 2)) * 2)" in text
    # A is shared along N: each CTA loads 64 of its 128 rows (one warpgroup's block), multicast to both
    assert "tensormap a: bf16[M, K] box(64, 64) swizzle(128)" in text
    assert "tma.load A[s, cluster_rank] <- a[m0 + cluster_rank * 64, k * 64] bar(full[s]) multicast(3)" in text
    assert "tma.load B[s, 0] <- b[k * 64, n0] bar(full[s])\n" in text
    assert "let tile_n = cluster_tile_n * 2 + cluster_rank" in text
    assert "mbarrier.init empty arrivals(4)" in text and "cluster.sync" in text and "syncthreads" not in text
    assert text.count("mbarrier.arrive empty[prev_s] cta(0)") == text.count("mbarrier.arrive empty[prev_s] cta(1)") == 1
    assert "let tail_it = ceil_div(max(num_tiles - cluster_id, 0), num_clusters) * k_tiles" in text
    plain = print_kernel(ws.lower(mlp))
    for word in ("cluster_rank", "multicast", "cta(", "cluster.sync", "tail_it"):
        assert word not in plain


def test_a_piece_of_a_64_row_tile_lies_inside_its_block():
    text = print_kernel(ws.lower(matmul, cluster=(1, 4, 1), tile=(64, 256, 64), consumer_warpgroups=1))
    assert ("tma.load A[s, cluster_rank * 16 / 64] row(cluster_rank * 16 % 64) <- a[m0 + cluster_rank * 16, k * 64] "
            "bar(full[s]) multicast(15)") in text


# Odd shapes (an odd count of tile rows leaves the last pair's second CTA past M), K < BK, fewer and
# more tiles than clusters, K long enough that every stage is reused.
SHAPES = [(200, 136, 152), (96, 72, 40), (520, 264, 640), (136, 520, 72)]
FAMILIES = {
    "2x1": (matmul, dict(cluster=(2, 1, 1), tile=(128, 128, 64))),
    "1x2": (mlp, dict(cluster=(1, 2, 1), tile=(128, 128, 64))),
    "4x1_bn64": (matmul, dict(cluster=(4, 1, 1), tile=(128, 64, 64))),
    "1x4_bm64": (matmul, dict(cluster=(1, 4, 1), tile=(64, 128, 64), consumer_warpgroups=1)),
    "2x1_residual_direct_k_major": (linear_relu_residual, dict(cluster=(2, 1, 1), tile=(128, 128, 64),
                                                               epilogue="direct")),
    "2x1_gated_one_stage": (gated, dict(cluster=(2, 1, 1), tile=(128, 128, 64), stages=1, mma_inflight=0)),
    "1x2_default_tile": (matmul, dict(cluster=(1, 2, 1))),
    "2x1_column_raster": (mlp, dict(cluster=(2, 1, 1), tile=(128, 64, 64), raster="column", swizzle_group=2)),
}


@pytest.mark.parametrize("family", FAMILIES)
def test_cluster_families_match_torch(family):
    fusion, overrides = FAMILIES[family]
    k = ws.compile(fusion, build=False, **overrides)
    for i, (M, N, K) in enumerate(SHAPES):
        check(k, fusion, M, N, K, seed=i, num_sms=4 if i % 2 else 8)


@pytest.mark.parametrize("seed", range(3))
def test_several_interleavings_and_one_cluster_resident(seed):
    # 2 SMs hold one cluster of 2: the 10 tile pairs run one after another on it
    check(ws.compile(matmul, build=False, cluster=(2, 1, 1), tile=(128, 64, 64)), matmul, 300, 264, 200,
          seed=seed, num_sms=2)


def test_batched_matmul_in_clusters():
    from test_batched_matmul import bmm, inputs

    k = ws.compile(bmm, build=False, cluster=(2, 1, 1), tile=(128, 128, 64))
    x = inputs(bmm, dict(B=3, M=200, N=136, K=152), 0)
    out = k.simulate(*x, num_sms=4)
    assert rel_error(out, bmm.reference(*x)) < 1e-2


# --- a broken cluster protocol -------------------------------------------------------------------

def _simulate_text(text: str, seed: int = 0):
    k = ws.compile(matmul, build=False, cluster=(2, 1, 1), tile=(128, 64, 64))
    a, b = inputs_for(matmul, 300, 136, 320, seed=1)
    edited = parse_kernel(text)
    args = {"M": 300, "N": 136, "K": 320, "a": a, "b": b,
            "out": torch.full((300, 136), float("nan"), dtype=torch.bfloat16)}
    simulate(edited, args, num_sms=4, seed=seed)
    return k, args


def _cluster_text() -> str:
    return print_kernel(ws.lower(matmul, cluster=(2, 1, 1), tile=(128, 64, 64)))


def test_the_unedited_text_runs():
    _, args = _simulate_text(_cluster_text())
    a, b = inputs_for(matmul, 300, 136, 320, seed=1)
    assert rel_error(args["out"], matmul.reference(a, b)) < 1e-2


@pytest.mark.parametrize("seed", range(2))
def test_consumers_that_free_only_their_own_stage_deadlock(seed):
    # each consumer arrives only on its own CTA's empty barrier, which waits for four arrivals
    text = re.sub(r"\n *mbarrier\.arrive empty\[(\w+)\] cta\(1\)", "", _cluster_text()).replace(" cta(0)", "")
    assert "cta(" not in text
    with pytest.raises(DeadlockError):
        _simulate_text(text, seed)


@pytest.mark.parametrize("seed", range(2))
def test_a_producer_without_its_tail_is_caught(seed):
    text = _cluster_text()
    text = re.sub(r"\n *let tail_it = [^\n]*\n *for tail in serial\(0, \d+, 1\) \{[^}]*\}", "", text)
    assert "tail_it" not in text
    with pytest.raises(ProtocolError, match="exits before it knows of"):
        _simulate_text(text, seed)


@pytest.mark.parametrize("seed", range(2))
def test_a_tail_that_skips_a_stage_is_caught(seed):
    # the last phase of the stage the tail skips is never waited for: a peer's release may land
    # on this CTA's barrier after it exits
    text = _cluster_text().replace("for tail in serial(0, 4, 1)", "for tail in serial(1, 4, 1)")
    with pytest.raises(ProtocolError, match=r"exits before it knows of the arrival on its barrier empty\[\d\] .*"
                                            r"which no warpgroup of CTA \d waited for"):
        _simulate_text(text, seed)


def test_the_inits_must_be_made_visible_to_the_peers():
    text = _cluster_text().replace("cluster.sync", "syncthreads")
    with pytest.raises(VerifyError, match=re.escape(
            "nothing makes a CTA's barrier inits visible to its peers: after the last mbarrier.init put "
            "`fence.mbarrier_init` and then `cluster.sync`")):
        verify(parse_kernel(text), contract=False)


def test_expect_tx_must_count_the_peers_pieces():
    text = _cluster_text().replace("bytes(24576)", "bytes(20480)")
    with pytest.raises(VerifyError, match=re.escape("expect_tx announces 20480 bytes but the loads into full[s] "
                                                    "deliver 24576")):
        verify(parse_kernel(text))


def test_cluster_clauses_are_checked_by_the_verifier():
    plain = print_kernel(ws.lower(matmul, tile=(128, 64, 64)))
    text = plain.replace("mbarrier.arrive empty[prev_s]", "mbarrier.arrive empty[prev_s] cta(1)")
    with pytest.raises(VerifyError, match=re.escape(
            "cta(1) in a kernel without a cluster (cluster(1, 1, 1)); give the kernel cluster(n, 1, 1) with n >= 2, "
            "or drop cta")):
        verify(parse_kernel(text), contract=False)
    text = _cluster_text().replace("multicast(3)", "multicast(4)")
    with pytest.raises(VerifyError, match=re.escape(
            "multicast(4): the mask has one bit per CTA rank; with 2 CTAs in the cluster it is in [1, 3]")):
        verify(parse_kernel(text), contract=False)
    text = _cluster_text().replace("cluster(2, 1, 1)", "cluster(1, 2, 1)")
    with pytest.raises(VerifyError, match=re.escape(
            "cluster(1, 2, 1): the grid is one-dimensional, so a cluster is consecutive CTAs along x; use "
            "cluster(2, 1, 1)")):
        verify(parse_kernel(text), contract=False)


# --- CUDA ----------------------------------------------------------------------------------------

def test_emitted_cuda_spells_the_cluster_protocol():
    src = emit_kernel(ws.lower(linear_relu_residual, cluster=(2, 1, 1))).source   # w [N, K]: one box of B
    assert '__launch_bounds__(384, 1) __cluster_dims__(2, 1, 1) linear_relu_residual(' in src
    assert "wsp::cluster_sync();" in src
    assert "wsp::mbar_arrive_cluster(&empty_bar[prev_s], 1);" in src
    assert ("wsp::tma_load_2d_multicast(smem_B + s * 32768 + cluster_rank * 128 * 128, &w, &full_bar[s], 3, "
            "k * 64, n0 + cluster_rank * 128);") in src


@pytest.mark.nvcc
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
@pytest.mark.parametrize("overrides", [dict(cluster=(2, 1, 1)), dict(cluster=(1, 2, 1)),
                                       dict(cluster=(4, 1, 1), tile=(128, 128, 64))], ids=str)
def test_cluster_kernels_build_for_sm90a(overrides):
    k = ws.compile(mlp, **overrides)
    assert k.build.resources[k.kernel.name].spill_stores == 0
