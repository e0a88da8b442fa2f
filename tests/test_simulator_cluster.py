"""The simulator's thread-block clusters with TMA multicast (sm_90): a cluster's CTAs resident
together, `cluster.sync`, arrivals on a peer's barriers (`mbarrier.arrive ... cta(r)`) and
multicast loads (`tma.load ... multicast(mask)`) into every CTA whose rank bit is set.

`cluster_ir` is the fixture: C[M, N] = A[M, K] @ B[N, K]^T where the n CTAs of a cluster share
the rows of A (each loads 64 / n of them and multicasts them to all) and each computes its own
64 columns of C, over a ring of 2 stages reused k_tiles times. A consumer frees a stage on every
CTA of the cluster (empty barriers count consumers x n arrivals), and the producer's tail waits
for the last phase of each stage before it finishes. `mutate` breaks it in one named way; each
break is caught on every seed, with its message."""

from __future__ import annotations

import re

import pytest
import torch

from wsched.lowering.parser import parse_kernel
from wsched.lowering.simulate import (DeadlockError, ProtocolError, RaceError, SimulationError, VerifyError,
                                      simulate)

MUTATIONS = ("own_empty", "own_stage_only", "syncthreads", "skipped_cluster_sync", "no_tail", "local_bytes",
             "long_bytes", "grid", "mask_at_run_time", "rank_at_run_time", "peer_bit_only")

TAIL = "a peer may still arrive on or multicast into a CTA's smem after it exits; wait for those phases " \
       "before exiting (the producer's tail)"


def cluster_ir(n: int = 2, k_tiles: int = 5, stages: int = 2, clusters: int = 2, *, mutate: str | None = None) -> str:
    assert mutate is None or mutate in MUTATIONS, mutate
    rows = 64 // n                 # the rows of A's tile each CTA loads and multicasts
    everyone = (1 << n) - 1
    tile_bytes = 64 * 64 * 2
    expect = {"local_bytes": rows * 64 * 2 + tile_bytes, "long_bytes": 3 * tile_bytes}.get(mutate, 2 * tile_bytes)
    a_load = f"tma.load A[s] row(rank * {rows}) <- a[m0 + rank * {rows}, k * 64] bar(full[s])"
    if mutate == "peer_bit_only":   # the own rows by a plain load, the multicast to the peers only
        a_load = f"{a_load}\n        {a_load} multicast({everyone} - (1 << rank))"
    else:
        a_load += f" multicast({'rank + 4' if mutate == 'mask_at_run_time' else everyone})"
    release = {"own_empty": "mbarrier.arrive empty[s]", "own_stage_only": "mbarrier.arrive empty[s]",
               "rank_at_run_time": "mbarrier.arrive empty[s] cta(rank + 1)"}.get(
        mutate, "\n      ".join(f"mbarrier.arrive empty[s] cta({r})" for r in range(n)))
    tail = "" if mutate == "no_tail" else f"""
      for k in serial(k_tiles, k_tiles + {stages}, 1) {{
        let s = k % {stages}
        let ph = k / {stages} & 1
        mbarrier.wait empty[s] phase(ph ^ 1)
      }}"""
    sync = {"syncthreads": "syncthreads",
            "skipped_cluster_sync": "if K < 0 {\n    cluster.sync\n  }\n  syncthreads"}.get(mutate, "cluster.sync")
    grid = "num_sms" if mutate == "grid" else str(n * clusters)
    return f"""\
kernel mc(i32 M, i32 N, i32 K, tensormap a: bf16[M, K] box({rows}, 64) swizzle(128), tensormap b: bf16[N, K] box(64, 64) swizzle(128), global c: f32[M, N]) grid({grid}) cluster({n}, 1, 1) {{
  smem A: bf16[{stages}, 64, 64] swizzle(128)
  smem B: bf16[{stages}, 64, 64] swizzle(128)
  barrier full[{stages}]
  barrier empty[{stages}]
  let rank = cta_id % {n}
  let m0 = cta_id / {n} * 64
  let k_tiles = ceil_div(K, 64)
  mbarrier.init full arrivals(1)
  mbarrier.init empty arrivals({1 if mutate == "own_stage_only" else n})
  fence.mbarrier_init
  {sync}
  role producer warpgroups(1) registers(40) {{
    setmaxnreg.dec 40
    elect_one {{
      for k in serial(0, k_tiles, 1) {{
        let s = k % {stages}
        let ph = k / {stages} & 1
        mbarrier.wait empty[s] phase(ph ^ 1)
        mbarrier.arrive_expect_tx full[s] bytes({expect})
        {a_load}
        tma.load B[s] <- b[rank * 64, k * 64] bar(full[s])
      }}{tail}
    }}
  }}
  role consumer warpgroups(1) registers(232) {{
    setmaxnreg.inc 232
    reg acc: f32[64, 64]
    tile.fill acc, 0.0
    for k in serial(0, k_tiles, 1) {{
      let s = k % {stages}
      let ph = k / {stages} & 1
      mbarrier.wait full[s] phase(ph)
      wgmma.fence
      wgmma.mma acc, A[s], B[s] major(k, k) accumulate(1)
      wgmma.commit
      wgmma.wait 0
      {release}
    }}
    tile.store c[m0, rank * 64] <- acc
  }}
}}
"""


def run_cluster(n: int = 2, k_tiles: int = 5, clusters: int = 2, *, seed: int = 0, num_sms: int | None = None,
                mutate: str | None = None, trace: bool = False):
    m, nn, k = 64 * clusters, 64 * n, 64 * k_tiles
    gen = torch.Generator().manual_seed(7 + n)
    a = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    b = torch.randn(nn, k, generator=gen).to(torch.bfloat16)
    c = torch.full((m, nn), float("nan"))
    report = simulate(parse_kernel(cluster_ir(n, k_tiles, clusters=clusters, mutate=mutate)),
                      {"M": m, "N": nn, "K": k, "a": a, "b": b, "c": c}, num_sms=num_sms or n, seed=seed, trace=trace)
    return c, a.float() @ b.float().T, report


# ---------------------------------------------------------------------------------------------
# Numbers
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("waves", [True, False])   # one cluster resident at a time, or both
def test_two_cta_multicast_ring_matches_torch(seed, waves):
    c, expected, report = run_cluster(2, seed=seed, num_sms=2 if waves else 4)
    torch.testing.assert_close(c, expected, rtol=1e-4, atol=1e-3)
    assert report.num_ctas == 4
    assert report.tma_loads == 4 * 5 * 2                       # per CTA and k: its rows of A (multicast), B
    assert report.tma_bytes_loaded == 4 * 5 * (2 * 4096 + 8192)   # the multicast lands in both CTAs


@pytest.mark.parametrize("seed", range(2))
def test_four_cta_multicast_ring_matches_torch(seed):
    c, expected, _ = run_cluster(4, seed=seed, num_sms=8)
    torch.testing.assert_close(c, expected, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("seed", range(2))
def test_multicast_with_the_issuers_bit_clear(seed):
    c, expected, _ = run_cluster(2, seed=seed, mutate="peer_bit_only")
    torch.testing.assert_close(c, expected, rtol=1e-4, atol=1e-3)


MULTICAST_TO_PEER = """\
kernel to_peer(tensormap x: bf16[64, 64] box(64, 64) swizzle(0), tensormap out: bf16[64, 64] box(64, 64) swizzle(0)) grid(2) cluster(2, 1, 1) {
  smem X: bf16[1, 64, 64] swizzle(0)
  barrier full[1]
  let rank = cta_id % 2
  mbarrier.init full arrivals(1)
  fence.mbarrier_init
  cluster.sync
  if rank == 0 {
    tma.load X[0] <- x[0, 0] bar(full[0]) multicast(2)
  } else {
    mbarrier.arrive_expect_tx full[0] bytes(8192)
    mbarrier.wait full[0] phase(0)
    tma.store out[0, 0] <- X[0]
    tma.commit
    tma.wait 0
  }
}
"""


@pytest.mark.parametrize("seed", range(4))
def test_multicast_into_the_peer_only_lands_there(seed):
    """CTA 0 loads into CTA 1's smem only; its bytes may land before CTA 1's arrive_expect_tx (the
    tx-count goes below zero until then)."""
    x = torch.randn(64, 64).to(torch.bfloat16)
    out = torch.full((64, 64), float("nan"), dtype=torch.bfloat16)
    simulate(parse_kernel(MULTICAST_TO_PEER), {"x": x, "out": out}, num_sms=2, seed=seed)
    assert torch.equal(out, x)


def test_trace_of_a_cluster_kernel():
    _, _, report = run_cluster(2, k_tiles=2, clusters=1, trace=True)
    loads = [e for e in report.trace.events if e.category == "tma.load"]
    assert {e.label for e in loads} == {"tma.load A → full[0]", "tma.load A → full[0] (CTA 1)",
                                        "tma.load A → full[0] (CTA 0)", "tma.load A → full[1]",
                                        "tma.load A → full[1] (CTA 1)", "tma.load A → full[1] (CTA 0)",
                                        "tma.load B → full[0]", "tma.load B → full[1]"}
    assert all(e.end >= e.begin for e in loads)
    assert sum(e.label.startswith("arrive empty") for e in report.trace.events) == 2 * 2 * 2


# ---------------------------------------------------------------------------------------------
# Protocol bugs, each caught on every seed
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(3))
def test_consumer_freeing_only_its_own_ctas_stage_deadlocks(seed):
    with pytest.raises(DeadlockError, match=r"CTA \d producer wg0: mbarrier.wait empty\[0\] phase\(0\) — barrier at "
                                            r"phase parity 0, 1 of 2 arrivals pending"):
        run_cluster(2, seed=seed, mutate="own_empty")


@pytest.mark.parametrize("seed", range(3))
def test_consumer_freeing_only_its_own_ctas_stage_races_with_the_peers_multicast(seed):
    """The same with empty barriers that count the CTA's own consumers only: no deadlock, but a
    producer multicasts into a peer's stage that the peer's consumers have not freed for it."""
    with pytest.raises(RaceError, match=r"TMA load into slot A\[0\] rows (0 .. 31|32 .. 63) of CTA (?P<peer>\d) is "
                                        r"not ordered after the previous write to it: writer CTA (?!(?P=peer))\d "
                                        r"producer wg0: tma.load A\[0\] .* multicast\(3\) \(IR line \d+; loop "
                                        r"k=2\); previous .*; a multicast writes into its peers' smem, so the consumers of each peer "
                                        r"free the stage on the issuing CTA's barrier too \(`mbarrier.arrive ... "
                                        r"cta\([01]\)`\), and the issuer waits for that before it loads"):
        run_cluster(2, seed=seed, mutate="own_stage_only")


def test_syncthreads_instead_of_cluster_sync_is_the_verifiers_to_report():
    with pytest.raises(VerifyError, match=r"nothing makes a CTA's barrier inits visible to its peers: after the last "
                                          r"mbarrier.init put `fence.mbarrier_init` and then `cluster.sync`"):
        run_cluster(2, mutate="syncthreads")


@pytest.mark.parametrize("seed", range(3))
def test_cluster_sync_that_never_runs_leaves_peer_inits_invisible(seed):
    """The verifier sees a cluster.sync after the fence, but it never runs: a peer's multicast
    onto a barrier whose init it does not know of."""
    with pytest.raises(ProtocolError, match=r"mbarrier full\[0\] of CTA (\d) used before its mbarrier.init is visible "
                                            r"to this warpgroup of CTA (?!\1)\d \(missing cluster.sync after "
                                            r"fence.mbarrier_init\?\): CTA \d producer wg0: tma.load A\[0\] "
                                            r"row\((0|32)\) <- a\[\d+, 0\] bar\(full\[0\]\) multicast\(3\) "
                                            r"\(IR line \d+; loop k=0\)"):
        run_cluster(2, seed=seed, mutate="skipped_cluster_sync")


@pytest.mark.parametrize("seed", range(6))
def test_missing_producer_tail_is_caught_on_every_seed(seed):
    """Without the tail a CTA may exit while a peer's consumer still has to free a stage on it.
    At exit it must know (happens-before) of every arrival on its barriers, so the bug is
    reported whether or not the late arrival happened to come after the exit (then at that
    arrival, with the same words)."""
    with pytest.raises(ProtocolError, match=r"CTA (?P<cta>\d) exits before it knows of the arrival on its barrier "
                                            r"empty\[[01]\] by CTA (?!(?P=cta))\d consumer wg0: mbarrier.arrive "
                                            r"empty\[[01]\] cta\((?P=cta)\) \(IR line \d+; loop k=[34]\)"
                                            r"( \(it joins phase \d+, which no warpgroup of CTA (?P=cta) waited for\)"
                                            r"|, which comes after CTA \d \(rank \d of the cluster\) exited): "
                                            + re.escape(TAIL)):
        run_cluster(2, seed=seed, mutate="no_tail")


@pytest.mark.parametrize("seed", range(6))
def test_expect_tx_of_the_local_rows_only(seed):
    """Each CTA announces its own rows of A and its B, not the rows its peer multicasts: the
    phase completes early, so a load lands past it or a consumer reads rows still in flight."""
    with pytest.raises(SimulationError, match=r"expect_tx mismatch on full\[0\] \(CTA \d\): expected 12288 "
                                              r"bytes, TMA delivered 16384|read of slot A\[0\] before (any write to "
                                              r"it|its TMA load completed)"):
        run_cluster(2, seed=seed, mutate="local_bytes")


@pytest.mark.parametrize("seed", range(2))
def test_expect_tx_beyond_what_arrives_deadlocks_showing_tx(seed):
    with pytest.raises(DeadlockError, match=r"mbarrier.wait full\[0\] phase\(0\) — barrier at phase parity 0, 0 of 1 "
                                            r"arrivals pending, tx 8192 \(expected 24576 bytes, TMA delivered 16384\)"):
        run_cluster(2, seed=seed, mutate="long_bytes")


def test_grid_not_a_multiple_of_the_cluster():
    with pytest.raises(SimulationError, match=r"grid num_sms = 3 is not a multiple of the cluster cluster\(2, 1, 1\)"):
        run_cluster(2, mutate="grid", num_sms=3)


def test_fewer_sms_than_the_cluster():
    with pytest.raises(SimulationError, match=r"num_sms = 2 is less than the cluster cluster\(4, 1, 1\): a "
                                              r"cluster's 4 CTAs are resident at once"):
        run_cluster(4, num_sms=2)


@pytest.mark.parametrize("seed", range(2))
def test_multicast_mask_out_of_range_at_run_time(seed):
    with pytest.raises(ProtocolError, match=r"multicast\([45]\): the mask has one bit per CTA rank; with 2 CTAs in the "
                                            r"cluster it is in \[1, 3\]: CTA \d producer wg0: tma.load A\[0\] "
                                            r"row\((0|32)\) <- a\[\d+, 0\] bar\(full\[0\]\) multicast\([45]\)"):
        run_cluster(2, seed=seed, mutate="mask_at_run_time")


@pytest.mark.parametrize("seed", range(2))
def test_peer_rank_out_of_range_at_run_time(seed):
    with pytest.raises(ProtocolError, match=r"cta\(2\): the rank of a CTA in a cluster of 2 is in \[0, 1\]: CTA \d "
                                            r"consumer wg0: mbarrier.arrive empty\[0\] cta\(2\) \(IR line \d+; "
                                            r"loop k=0\)"):
        run_cluster(2, seed=seed, mutate="rank_at_run_time")


ARRIVE_ON_PEER = """\
kernel on_peer(global out: f32[1, 1]) grid(2) cluster(2, 1, 1) {
  barrier done[1]
  let rank = cta_id % 2
  mbarrier.init done arrivals(1)
  fence.mbarrier_init
  cluster.sync
  if rank == 0 {
    mbarrier.arrive done[0] cta(1)
  }
  WAIT
}
"""


@pytest.mark.parametrize("seed", range(8))
def test_arrival_on_a_peer_that_does_not_wait_for_it(seed):
    """CTA 1 exits without waiting for CTA 0's arrival on its barrier: reported at its exit if the
    arrival came first, at the arrival if the exit came first, in the same words."""
    with pytest.raises(ProtocolError, match=r"CTA 1 exits before it knows of the arrival on its barrier done\[0\] by "
                                            r"CTA 0 wg0: mbarrier.arrive done\[0\] cta\(1\) \(IR line 8\)"
                                            r"( \(it joins phase 0, which no warpgroup of CTA 1 waited for\)"
                                            r"|, which comes after CTA 1 \(rank 1 of the cluster\) exited): "
                                            + re.escape(TAIL)):
        simulate(parse_kernel(ARRIVE_ON_PEER.replace("WAIT", "")), {"out": torch.zeros(1, 1)}, num_sms=2, seed=seed)
    waited = ARRIVE_ON_PEER.replace("WAIT", "if rank == 1 {\n    mbarrier.wait done[0] phase(0)\n  }")
    simulate(parse_kernel(waited), {"out": torch.zeros(1, 1)}, num_sms=2, seed=seed)


@pytest.mark.parametrize("seed", range(6))
def test_multicast_into_a_peer_that_does_not_wait_for_it(seed):
    """CTA 1 announces the bytes but never waits for them: a multicast may land in it, be in flight
    or come after it exits; each is reported at once as the exit that does not know of it."""
    unwaited = MULTICAST_TO_PEER.replace("    mbarrier.wait full[0] phase(0)\n    tma.store out[0, 0] <- X[0]\n"
                                         "    tma.commit\n    tma.wait 0\n", "")
    with pytest.raises(ProtocolError, match=r"CTA 1 exits before it knows of the multicast into its smem X\[0\] by "
                                            r"CTA 0 wg0: tma.load X\[0\] <- x\[0, 0\] bar\(full\[0\]\) multicast\(2\) "
                                            r"\(IR line 9\)( \(it completes phase 0 of its barrier full\[0\], which no "
                                            r"warpgroup of CTA 1 waited for\)|, which is still in flight|, which comes "
                                            r"after CTA 1 \(rank 1 of the cluster\) exited): " + re.escape(TAIL)):
        simulate(parse_kernel(unwaited), {"x": torch.zeros(64, 64), "out": torch.zeros(64, 64)}, num_sms=2, seed=seed)
