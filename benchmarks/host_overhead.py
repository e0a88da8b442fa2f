"""Host time of one call of a compiled kernel, next to a Triton kernel launch, in the same run.

    python benchmarks/host_overhead.py [--calls 200] [--repeats 50] [--shape 128x256x64]

Rows, each as µs of host time per call and as a ratio to the Triton launch:

    k(a, b)                the eager call of one compiled kernel (`ws.compile(matmul, schedule)`)
                           on a layout seen before, launched by the native path
                           (codegen/native.py): layouts matched, output allocated, data pointers
                           and cached tensor maps set, the launch, all from C
    ws.compile(matmul)(a, b)  the default, whose per-shape choice (wsched/dispatch.py) keeps the
                           chosen kernels' plans in its own native launcher
    k(a, b, out=)          the same into a given output (no allocation)
    k.op(a, b)             the same through torch's dispatcher (the custom op)
    the native launcher alone  `k(a, b)` without the Python method around the C call
    ..., Python path       the same calls with the native path off (WSCHED_NATIVE_LAUNCH=0): the
                           layout key, the cached plan, packing and a cuda-python launch in Python
    document k(q, k, v, doc_q, doc_k)  an attention kernel with a document mask (B1 H2 S256 D64): its
                           spans table computed per call by a helper kernel launched before it
                           (native path: both launches from C), and the same on the Python path
    bound()                `k.bind(a, b)` once, then only the launch
    bare cuLaunchKernel    the same cubin's function through cuda-python, arguments packed once
    bare, (values, types)  the same with cuda-python packing the argument tuple on every call
    Triton launch          a @triton.jit kernel adding 1 to one element
    torch.empty            allocating the output alone, for scale
    torch a + a            an elementwise torch op, for scale

How it is measured: a tiny matmul (default 128x256x64: one CTA, a few µs on the GPU). A round
times, for every row in turn, a tight loop of `--calls` calls with `time.perf_counter_ns` after a
synchronize; the host time per call is loop time / calls, the median over `--repeats` rounds (the
rows interleaved, so the host's drift during the run hits each alike). Why the GPU does
not throttle the loop: a launch waits for the GPU only when the launch queue is full, and a loop
of 200 launches on an idle GPU stays far below its depth (about a thousand launches). The GPU
time per kernel is printed too (CUDA events around launches queued behind a sleep kernel, so the
GPU runs them back to back): where it is below the host time per call, the GPU drained the
queue as fast as the host filled it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
import wsched as ws  # noqa: E402
from attention_fusions import make_variant, variant_inputs  # noqa: E402
from fusions import inputs_for, matmul  # noqa: E402


def host_us(rows: dict, calls: int, repeats: int) -> dict[str, float]:
    """Median host µs per call of each row's function over `repeats` rounds; a round times a tight
    loop of `calls` calls of every row in turn, so a drift of the host's speed during the run
    hits every row alike."""
    for fn in rows.values():
        for _ in range(20):
            fn()
    times = {name: [] for name in rows}
    for _ in range(repeats):
        for name, fn in rows.items():
            torch.cuda.synchronize()
            t0 = time.perf_counter_ns()
            for _ in range(calls):
                fn()
            times[name].append((time.perf_counter_ns() - t0) / calls)
    torch.cuda.synchronize()
    return {name: statistics.median(t) / 1e3 for name, t in times.items()}


def gpu_us(fn, calls: int) -> float:
    """GPU µs per kernel of `fn`, back to back: `calls` launches queued behind a sleep kernel
    (~25 ms, far longer than queueing them takes), then timed by CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(50_000_000)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / calls


def bare_launches(k, a, b):
    """Two bare cuLaunchKernel calls of the kernel's function (loaded here from its cubin into
    torch's context): with the arguments packed once, and with cuda-python packing them."""
    from cuda.bindings import driver

    from wsched.codegen.cuda_driver import check_cuda, init_driver
    from wsched.codegen.launch import PackedArguments, _marshal_args

    init_driver(a.device)
    module = check_cuda(driver.cuModuleLoadData(Path(k.build.cubin_path).read_bytes()), "cuModuleLoadData")
    function = check_cuda(driver.cuModuleGetFunction(module, k.kernel.name.encode()), "cuModuleGetFunction")
    check_cuda(driver.cuFuncSetAttribute(
        function, driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
        k.kernel.smem_bytes), "cuFuncSetAttribute")
    grid, pairs, outs = k.launch_args((a, b))
    packed, params = PackedArguments(pairs), _marshal_args(pairs)
    stream = torch.cuda.current_stream(a.device).cuda_stream
    shape = (grid, 1, 1, k.kernel.threads, 1, 1, k.kernel.smem_bytes, stream)

    def packed_once():
        driver.cuLaunchKernel(function, *shape, packed.address, 0)

    def tuple_each_call():
        driver.cuLaunchKernel(function, *shape, params, 0)

    return packed_once, tuple_each_call, (module, outs)   # the module and outputs kept alive


def triton_launch():
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def add_one(x_ptr):
        tl.store(x_ptr, tl.load(x_ptr) + 1)

    x = torch.zeros(1, device="cuda")
    return lambda: add_one[(1,)](x)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200, help="calls per timed loop")
    parser.add_argument("--repeats", type=int, default=50, help="timed loops; the median is reported")
    parser.add_argument("--shape", default="128x256x64", help="MxNxK of the matmul")
    args = parser.parse_args()
    M, N, K = (int(s) for s in args.shape.split("x"))

    k = ws.compile(matmul, ws.schedule_for(matmul))   # one kernel: the launch path itself
    chooser = ws.compile(matmul)                        # the default: a per-shape choice in front
    a, b = inputs_for(matmul, M, N, K, device="cuda")
    bound = k.bind(a, b)
    out = {"out": torch.empty(M, N, dtype=torch.bfloat16, device="cuda")}
    packed_once, tuple_each_call, keep = bare_launches(k, a, b)
    python_path = ws.compile(matmul, ws.schedule_for(matmul))
    python_path._native = False                       # what WSCHED_NATIVE_LAUNCH=0 gives
    document = make_variant(64, "document", name="host_document")
    kd, kd_python = (ws.compile(document, ws.schedule_for(document)) for _ in range(2))
    kd_python._native = False
    doc_args = variant_inputs(document, 1, 2, 256, 256, 64, device="cuda", documents=3)
    rows = {
        "k(a, b)": lambda: k(a, b),
        "k(a, b, out=)": lambda: k(a, b, out=out),
        "ws.compile(matmul)(a, b)": lambda: chooser(a, b),
        "k.op(a, b)": lambda: k.op(a, b),
        "the native launcher alone": lambda: k._natives[None]((a, b)),
        "k(a, b), Python path": lambda: python_path(a, b),
        "k(a, b, out=), Python path": lambda: python_path(a, b, out=out),
        "document k(q, k, v, doc_q, doc_k)": lambda: kd(*doc_args),
        "document k(...), Python path": lambda: kd_python(*doc_args),
        "bound() (k.bind(a, b))": bound,
        "bare cuLaunchKernel": packed_once,
        "bare, (values, types)": tuple_each_call,
    }
    triton = triton_launch()
    if triton is not None:
        rows["Triton launch (1-element add)"] = triton
    rows["torch.empty (the output)"] = lambda: torch.empty(M, N, dtype=torch.bfloat16, device="cuda")
    rows["torch a + a"] = lambda: a + a

    print(f"host time per call, {torch.cuda.get_device_name()}, matmul {M}x{N}x{K} "
          f"(grid {bound.grid}), median of {args.repeats} rounds of {args.calls} calls a row; the default "
          f"ws.compile(matmul) runs {chooser.kernel_for(a, b).schedule.short()} at this shape")
    times = host_us(rows, args.calls, args.repeats)
    reference = times.get("Triton launch (1-element add)")
    for name, us in times.items():
        ratio = f"{us / reference:5.2f}x Triton" if reference else ""
        print(f"  {name:32s} {us:7.2f} us  {ratio}")
    own = times["k(a, b)"] - times["torch.empty (the output)"] - times["bare cuLaunchKernel"]
    print(f"  k(a, b) - torch.empty - bare cuLaunchKernel: {own:.2f} us of wsched's own host work")
    hits = [kernel._natives[None].stats()["hits"] if None in kernel._natives else 0 for kernel in (k, kd)]
    print(f"  native path: {'on' if k._native else 'OFF (' + ws.codegen.native.available.reason + ')'}; "
          f"launcher hits: matmul {hits[0]}, document {hits[1]}")
    ours_gpu = gpu_us(bound, args.calls)
    triton_gpu = gpu_us(triton, args.calls) if triton else None
    kept_up = ours_gpu < times["bound() (k.bind(a, b))"] and (
        triton is None or triton_gpu < times["Triton launch (1-element add)"])
    print(f"  GPU time per kernel: ours {ours_gpu:.2f} us"
          + (f", Triton {triton_gpu:.2f} us" if triton else "")
          + (" (below the host times: the GPU kept up with every loop)" if kept_up else
             f" (above a host time: the queue grew during the loop, by less than {args.calls} launches)"))
    ref = matmul.reference(a, b).float()
    err = float((k(a, b).float() - ref).norm() / ref.norm())
    print(f"  k(a, b) relative error vs torch: {err:.1e}")
    del keep


if __name__ == "__main__":
    main()
