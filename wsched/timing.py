"""GPU timing, one definition for the benchmarks, the CLI and the autotuner: CUDA events around
each run, warm-up, the median of many runs."""

from __future__ import annotations

import statistics


def median_ms(fn, *, warmup: int = 10, iters: int = 50, device=None) -> float:
    """Median wall time of `fn()` on the GPU in milliseconds (each run bracketed by events on the
    current stream of `device`, default the current device)."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize(device)
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def rel_error(out, ref) -> float:
    out, ref = out.float(), ref.float()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))
