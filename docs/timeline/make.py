"""Regenerate the pictures of docs/timeline.md.

    python docs/timeline/make.py                 # simulator traces (CPU): *_sim.json / *_sim.png
    python docs/timeline/make.py --gpu           # GPU traces (Hopper): *_gpu.json (+ .png with matplotlib)
    python docs/timeline/make.py --png FILE.json ...   # draw the PNG of a saved trace

The default matmul (tests/fusions.py:mlp), the same in ping-pong mode, and causal attention
(tests/attention_fusions.py),
each at a size where every CTA takes more than one tile. --gpu also times the untraced and the
traced kernel (CUDA events, median of 20) to show what the stamps cost.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "tests"))

from attention_fusions import make_attention  # noqa: E402
from fusions import mlp  # noqa: E402

from wsched import timeline  # noqa: E402
from wsched.timing import median_ms, rel_error  # noqa: E402

ATTENTION = make_attention(128, causal=True)
PINGPONG = {"mode": "pingpong"}
SIMULATED = [("mlp_sim", mlp, {"M": 512, "N": 512, "K": 1024}, {}),
             ("mlp_pingpong_sim", mlp, {"M": 512, "N": 512, "K": 1024}, PINGPONG),
             ("attention_causal_sim", ATTENTION, {"B": 1, "H": 2, "S": 512, "T": 512}, {})]
ON_GPU = [("mlp_gpu", mlp, {"M": 4096, "N": 4096, "K": 1024}, {}),
          ("mlp_pingpong_gpu", mlp, {"M": 4096, "N": 4096, "K": 1024}, PINGPONG),
          ("attention_causal_gpu", ATTENTION, {"B": 1, "H": 16, "S": 2048, "T": 2048}, {})]
GPU_JSON_CTAS = 4   # the committed JSON keeps the CTAs the PNG shows (the whole grid is ~20 MB)


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ModuleNotFoundError:
        return False
    return True


def simulated(out: Path) -> None:
    for name, fusion, sizes, overrides in SIMULATED:
        trace = timeline.trace_simulated(fusion, sizes, out / f"{name}.json", **overrides)
        print(f"{name}: {len(trace.events)} events, {trace.meta['steps']} steps")


def _median_ms(fn, batch: int = 10) -> float:
    """Median time of one call, timed over `batch` back-to-back launches (the host's work
    overlaps the GPU's)."""
    return median_ms(lambda: [fn() for _ in range(batch)], warmup=3, iters=20) / batch


def on_gpu(out: Path) -> None:
    import wsched as ws

    png = _has_matplotlib()
    for name, fusion, sizes, overrides in ON_GPU:
        trace = timeline.trace_gpu(fusion, sizes, out / f"{name}.json", png=png, ctas=GPU_JSON_CTAS, **overrides)
        compiled = ws.compile(fusion, build=True, **overrides)
        traced = timeline.TracedKernel(compiled)
        tensors = timeline.random_inputs(fusion, sizes, "cuda")
        capacity = trace.meta["capacity"]
        _, records = traced.launch(tensors, capacity)
        plain_ms = _median_ms(lambda: compiled(*tensors))
        traced_ms = _median_ms(lambda: traced.launch(tensors, capacity, records))
        expected = fusion.reference(*tensors)
        got, _ = traced(*tensors, capacity=capacity)
        got, expected = (got if isinstance(got, tuple) else (got,)), (expected if isinstance(expected, tuple)
                                                                   else (expected,))
        error = max(rel_error(g, e) for g, e in zip(got, expected))
        meta = {k: trace.meta.get(k) for k in ("stamps", "truncated_streams", "ns_per_cycle",
                                               "globaltimer_resolution_ns", "device")}
        print(f"{name}: {len(trace.ctas)} CTAs, {len(trace.events)} events, kernel {plain_ms * 1e3:.1f} µs "
              f"untraced / {traced_ms * 1e3:.1f} µs traced, traced output "
              f"rel. error {error:.2e}; {meta}", flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpu", action="store_true", help="trace the GPU runs instead of the simulator")
    parser.add_argument("--png", nargs="+", metavar="FILE.json", help="draw the PNG of saved traces")
    parser.add_argument("--out", type=Path, default=HERE, help="where to write (default: docs/timeline)")
    args = parser.parse_args(argv)
    if args.png:
        for path in map(Path, args.png):
            timeline.write_png(timeline.read_json(path), path.with_suffix(".png"))
            print(f"wrote {path.with_suffix('.png')}")
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    (on_gpu if args.gpu else simulated)(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
