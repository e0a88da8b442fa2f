"""Decode attention (few queries, a long K/V cache) vs torch SDPA, timed side by side in one run.

    python benchmarks/decode.py [--s 1,4,16] [--quick] [--iters 50] [--lse]
    python benchmarks/decode.py --prebuild      # only build the kernels (for scripts/gpu-check.sh)

Cases: B in {1, 8, 64} x T in {1024, 8192, 32768} x heads H32/HK8 (GQA) and H32/HK32, D128, S
queries per sequence (default 1), bf16, no mask. Ours is the GQA fusion a user writes
(tests/attention_fusions.make_attention(128, gqa=True): Q [B, HK, G, S, D], K/V [B, HK, 1, T, D])
compiled with no schedule, so the kernel is the one `ws.compile` picks for the shape; the row
names its schedule. A case whose K/V would take over 40% of the free GPU memory is skipped.

Decode is bound by reading K and V: a row gives those bytes (B HK T D, 2 tensors, 2 bytes) over
our time in GB/s, and as a % of the plain-read bandwidth of the same run (`torch.sum` over a
1 GiB bf16 tensor, in the header). References, on the same K/V memory ([B, HK, T, D] views) and
Q as [B, H, S, D]: SDPA's cuDNN, flash and memory-efficient backends with enable_gqa=True; a
backend that does not take a case prints why and gets an empty column. "vs" columns are speedups
(reference time / our time). Our output is poisoned with NaN, then compared with the first
reference that ran (rel.err < 2e-2, else the row is marked FAIL and the script exits with 1).

Paged: the same keys copied into a paged cache ([pages, --page-size, HK, D], the pages of all
sequences shuffled, a block table, every sequence's length T) and run through
`make_paged_attention` (ws.paged + ws.key_lengths) compiled the same way; the "paged" column is
its time, "paged/contig" its time over ours on the contiguous cache (the target is within 5%), and
its output is checked against ours on the contiguous cache. It needs a second copy of K/V: where
that does not fit, the column is empty.

Timing: these kernels take microseconds, so events around each call (`wsched.timing.median_ms`)
would also count the host's launch time, and calls back to back would read K/V from L2. Here
each timed call is queued behind an L2 flush and a sleep kernel: the GPU reaches the start event
with the call already queued and a cold L2 (as one layer of a model's decode step finds it).
The median over `--iters` calls is reported, ours and the references timed the same way.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))
import wsched as ws  # noqa: E402
from attention_fusions import make_attention, make_paged_attention  # noqa: E402
from wsched.timing import rel_error  # noqa: E402

D, H = 128, 32
# (B, HK, T); H = 32 query heads throughout
CASES = [(B, HK, T) for HK in (8, 32) for B in (1, 8, 64) for T in (1024, 8192, 32768)]
QUICK = [(1, 8, 32768), (8, 8, 8192), (8, 32, 8192), (64, 32, 1024)]
REFERENCES = (("cuDNN", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION),
              ("efficient", SDPBackend.EFFICIENT_ATTENTION))
MAX_KV_SHARE = 0.4           # of the free GPU memory
TOLERANCE = 2e-2
SLEEP_CYCLES = 2_000_000     # ~1 ms at the H100's clock: the host queues the timed call meanwhile


def kv_bytes(B: int, HK: int, T: int) -> int:
    """Bytes of K and V a decode step reads: B HK T D, two tensors, bf16."""
    return B * HK * T * D * 2 * 2


class ColdTimer:
    """Median GPU µs of one call, each run queued behind an L2 flush and a sleep kernel."""

    def __init__(self, iters: int):
        l2 = torch.cuda.get_device_properties(0).L2_cache_size
        self.iters = iters
        self.flush = torch.empty(max(256 << 20, 4 * l2) // 4, dtype=torch.int32, device="cuda")
        self.host_bound = 0          # timed calls whose queueing outlasted the flush and the sleep
        self.last_host_bound = 0     # the same, in the last timing
        self.lead_us = self._lead_us()

    def _lead_us(self) -> float:
        """GPU time of the flush and the sleep: how long the host has to queue the timed call."""
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(5):
            start.record()
            self.flush.zero_()
            torch.cuda._sleep(SLEEP_CYCLES)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        return min(times)

    def __call__(self, fn) -> float:
        for _ in range(3):
            fn()
        times, host_bound = [], 0
        for _ in range(self.iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.flush.zero_()
            torch.cuda._sleep(SLEEP_CYCLES)
            t0 = time.perf_counter()
            start.record()
            fn()
            end.record()
            host_bound += (time.perf_counter() - t0) * 1e6 > self.lead_us
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        self.host_bound += host_bound
        self.last_host_bound = host_bound
        return statistics.median(times)


def plain_read_gbs(timer: ColdTimer) -> float:
    """GB/s of `torch.sum` over a 1 GiB bf16 tensor: a same-run yardstick for reading memory, not a
    ceiling (large decode rows read K/V a few % faster on an H100)."""
    x = torch.randn(1 << 29, device="cuda", dtype=torch.bfloat16)
    us = timer(lambda: x.sum())
    return (1 << 30) / us / 1e3


def sdpa(backend, q, k, v):
    def fn():
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    return fn


def first_line(error: Exception, caught) -> str:
    """Why a backend refused a case, short: SDPA puts its reasons in warnings, the error says only
    'No available kernel'."""
    lines = [line.strip() for w in caught for line in str(w.message).splitlines()]
    reasons = [line for line in lines if line and "not used because" not in line and not line.startswith("(")]
    return (reasons[0] if reasons else str(error).splitlines()[0]).split(". ")[0][:110]


def our_output(bound):
    outputs = list(bound.outputs.values())
    return outputs[0]    # O ([B, HK, G, S, D]); the LSE beside it with --lse


def paged_copy(x: torch.Tensor, page: int, order: torch.Tensor) -> torch.Tensor:
    """x [B, HK, 1, T, D] as a cache [B T / page, page, HK, D] whose page i (sequence-major) is
    stored at page order[i]."""
    B, HK, _, T, _ = x.shape
    pages = x.view(B, HK, T // page, page, D).permute(0, 2, 3, 1, 4).reshape(B * (T // page), page, HK, D)
    cache = torch.empty_like(pages)
    cache[order] = pages
    return cache


def run_paged(paged, timer, q, kk, v, o):
    """(µs, rel.err vs ours on the contiguous cache) of the paged kernel on the same keys."""
    kernel, page = paged
    B, HK, _, T, _ = kk.shape
    order = torch.randperm(B * (T // page), device="cuda")
    k_cache, v_cache = paged_copy(kk, page, order), paged_copy(v, page, order)
    table = order.view(B, T // page).int()
    lens = torch.full((B,), T, dtype=torch.int32, device="cuda")
    bound = kernel.bind(q, k_cache, v_cache, table, lens)
    for t in bound.outputs.values():
        t.fill_(float("nan"))
    bound()
    torch.cuda.synchronize()
    err = rel_error(our_output(bound).view(o.shape), o)
    us = timer(bound)
    del k_cache, v_cache
    return us, err


def run_case(k, timer, B, HK, T, S, kk, v, read_gbs, paged=None):
    """One row: ours and the references on fresh Q, the same K/V."""
    G = H // HK
    q = torch.randn(B, HK, G, S, D, device="cuda", dtype=torch.bfloat16)
    bound = k.bind(q, kk, v)
    chosen = k.kernel_for(q, kk, v) if hasattr(k, "kernel_for") else k
    for t in bound.outputs.values():
        t.fill_(float("nan"))
    bound()
    torch.cuda.synchronize()
    o = our_output(bound).view(B, H, S, D).clone()
    t_ours = timer(bound)
    host_bound = {"ours": timer.last_host_bound}
    q_ref, k_ref, v_ref = q.view(B, H, S, D), kk.view(B, HK, T, D), v.view(B, HK, T, D)
    times, ref, ref_name = {}, None, None
    for name, backend in REFERENCES:
        fn = sdpa(backend, q_ref, k_ref, v_ref)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                out = fn()
            except RuntimeError as e:   # a backend that does not take this case (or runs out of memory)
                print(f"  {name}: {first_line(e, caught)}")
                torch.cuda.empty_cache()
                continue
        if ref is None:
            ref, ref_name = out, name
        times[name] = timer(fn)
        host_bound[name] = timer.last_host_bound
    if ref is None:
        print("  no SDPA backend ran: the output is not checked")
    err = rel_error(o, ref) if ref is not None else float("nan")
    gbs = kv_bytes(B, HK, T) / t_ours / 1e3
    row = dict(case=f"B{B} H{H}/{HK} T{T} S{S}", schedule=chosen.schedule.short(), ours=t_ours, gbs=gbs,
               pct=100 * gbs / read_gbs, err=err, ref=ref_name, ok=err < TOLERANCE, **times)
    if paged is not None:
        paged_us, paged_err = run_paged(paged, timer, q, kk, v, o)
        row.update(paged=paged_us, paged_ok=paged_err < TOLERANCE)
        row["ok"] = row["ok"] and row["paged_ok"]
    print(f"{row['case']:>24}  ours {t_ours:8.1f} us {gbs:6.0f} GB/s ({row['pct']:3.0f}%)  "
          + "  ".join(f"{n} {times[n]:8.1f}" if n in times else f"{n} {'-':>8}" for n, _ in REFERENCES)
          + f" us  vs cuDNN {speedup(row, 'cuDNN')}  vs flash {speedup(row, 'flash')}  "
          f"rel.err {err:.1e} ({ref_name or 'none'})"
          + (f"  paged {row['paged']:8.1f} us ({row['paged'] / t_ours:4.2f}){'' if row['paged_ok'] else ' FAIL'}"
             if "paged" in row else "")
          + f"{'' if row['ok'] else '  FAIL'}  [{row['schedule']}]", flush=True)
    if any(host_bound.values()):
        print("  timed calls queued slower than the lead (their times may include launch latency): "
              + ", ".join(f"{n} {c}/{timer.iters}" for n, c in host_bound.items() if c))
    return row


def speedup(row, name) -> str:
    return f"{row[name] / row['ours']:5.2f}" if name in row else "     "


def prebuild(lse_options) -> None:
    """Build the kernels of this benchmark (the default and every per-shape variant) in parallel."""
    from concurrent.futures import ThreadPoolExecutor

    from prebuild import build     # scripts/prebuild.py: one build, its variants, one report line

    with ThreadPoolExecutor(max_workers=len(lse_options)) as pool:
        jobs = [(make(lse), {}) for lse in lse_options
                for make in (lambda lse: make_attention(D, gqa=True, lse=lse),
                             lambda lse: make_paged_attention(D, 16, lse=lse))]
        for line in pool.map(build, jobs):
            print(line, flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--s", default="1", help="queries per sequence, e.g. '1,4,16'")
    ap.add_argument("--quick", action="store_true", help=f"only {len(QUICK)} cases")
    ap.add_argument("--lse", action="store_true", help="the fusion also returns the logsumexp")
    ap.add_argument("--page-size", type=int, default=16, help="pages of the paged column (0: no paged column)")
    ap.add_argument("--prebuild", action="store_true", help="only build the kernels (with and without --lse)")
    args = ap.parse_args(argv)
    if args.prebuild:
        return prebuild((False, True))
    queries = [int(s) for s in args.s.split(",") if s]
    k = ws.compile(make_attention(D, gqa=True, lse=args.lse))
    paged_kernel = ws.compile(make_paged_attention(D, args.page_size, lse=args.lse)) if args.page_size else None
    timer = ColdTimer(args.iters)
    read_gbs = plain_read_gbs(timer)
    free, total = torch.cuda.mem_get_info()
    print(f"# {torch.cuda.get_device_name()}  torch {torch.__version__}  bf16 D{D}{' +lse' if args.lse else ''}, "
          f"median of {args.iters}, cold L2, each call queued behind {timer.lead_us:.0f} us of flush+sleep; "
          f"plain read (torch.sum, 1 GiB bf16) {read_gbs:.0f} GB/s; free {free / 2**30:.0f} of {total / 2**30:.0f} GiB")
    rows = []
    for B, HK, T in QUICK if args.quick else CASES:
        need = kv_bytes(B, HK, T)
        free, _ = torch.cuda.mem_get_info()
        if need > MAX_KV_SHARE * free:
            print(f"  B{B} H{H}/{HK} T{T}: skipped, K/V take {need / 2**30:.1f} GiB, over "
                  f"{MAX_KV_SHARE:.0%} of the {free / 2**30:.1f} GiB free")
            continue
        kk = torch.randn(B, HK, 1, T, D, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(B, HK, 1, T, D, device="cuda", dtype=torch.bfloat16)
        free, _ = torch.cuda.mem_get_info()
        paged = (paged_kernel, args.page_size) if paged_kernel and need < MAX_KV_SHARE * free else None
        for S in queries:
            rows.append(run_case(k, timer, B, HK, T, S, kk, v, read_gbs, paged))
        del kk, v
        torch.cuda.empty_cache()
    names = [n for n, _ in REFERENCES]
    print(f"\n| case | wsched µs | GB/s | % of read | {' | '.join(f'SDPA {n} µs' for n in names)} | vs cuDNN | "
          f"vs flash | rel.err | paged µs | paged/contig | schedule |\n|{'---|' * (len(names) + 9)}")
    for r in rows:
        refs = " | ".join(f"{r[n]:.1f}" if n in r else "" for n in names)
        print(f"| {r['case']} | {r['ours']:.1f} | {r['gbs']:.0f} | {r['pct']:.0f} | {refs} | "
              f"{speedup(r, 'cuDNN').strip()} | {speedup(r, 'flash').strip()} | {r['err']:.1e}"
              f"{'' if r['ok'] else ' FAIL'} | " + (f"{r['paged']:.1f} | {r['paged'] / r['ours']:.2f}" if 'paged' in r
                                                   else " | ") + f" | {r['schedule']} |")
    if timer.host_bound:
        print(f"# {timer.host_bound} timed calls took the host longer to queue than the flush+sleep lead: "
              f"their times may include launch latency")
    failed = [r["case"] for r in rows if not r["ok"]]
    if failed:
        print(f"# FAILED (rel.err >= {TOLERANCE} or no reference): {', '.join(failed)}")
        sys.exit(1)


if __name__ == "__main__":
    main()
