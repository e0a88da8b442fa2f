"""The custom op of a compiled kernel on the GPU: torch.compile(fullgraph=True) over a block of two
kernels and over attention with LSE, torch.export, CUDA graph capture and replay, and the host
overhead of a call.

Outputs are poisoned: with deterministic algorithms on, torch fills every `torch.empty` with NaN
(`torch.utils.deterministic.fill_uninitialized_memory`), so an output the kernel never wrote
stays NaN; captured outputs are filled with NaN before each replay.

`python tests/test_gpu_torch_ops.py` prints the host overhead table alone.
"""

from __future__ import annotations

import statistics
import time

import pytest
import torch

import wsched as ws

from attention_fusions import attention_inputs
from fusions import inputs_for, matmul
from test_torch_ops import Block, attention_lse, kernel

pytestmark = pytest.mark.gpu

ROWS = (999, 1500)        # no tile divides them; the second is a new shape for torch.compile
D, F = 512, 1024


@pytest.fixture
def poisoned():
    """Every torch.empty filled with NaN while the test runs."""
    was = torch.are_deterministic_algorithms_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)   # warn_only: cuBLAS in the references
    torch.utils.deterministic.fill_uninitialized_memory = True
    yield
    torch.use_deterministic_algorithms(was)
    torch.utils.deterministic.fill_uninitialized_memory = fill


def block_and_input(rows: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return Block(D, F).cuda(), torch.randn(rows, D, generator=g).bfloat16().cuda()


def check(got, want, reference=None, exact=True):
    """`got` has no NaN, equals `want` (the same kernels run eagerly: bit for bit where `exact`)
    and is close to the torch reference."""
    assert not torch.isnan(got).any(), f"{int(torch.isnan(got).sum())} outputs never written"
    torch.testing.assert_close(got, want, **({"rtol": 0, "atol": 0} if exact else {}))
    if reference is not None:
        error = float((got.float() - reference.float()).norm() / reference.float().norm())
        assert error < 1e-2, error


def test_torch_compile_fullgraph_over_two_kernels_matches_eager(poisoned):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    block, _ = block_and_input(ROWS[0])
    compiled = torch.compile(block, fullgraph=True)
    for seed, rows in enumerate(ROWS):
        _, x = block_and_input(rows, seed)
        check(compiled(x), block(x), block.reference(x))
    assert not counters["graph_break"]


def test_torch_compile_reduce_overhead_replays_the_kernels_in_a_cuda_graph(poisoned):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    block, _ = block_and_input(ROWS[0])
    compiled = torch.compile(block, fullgraph=True, mode="reduce-overhead")
    for seed in range(4):   # warm-up, record, then replays
        _, x = block_and_input(ROWS[0], seed)
        check(compiled(x).clone(), block(x), block.reference(x))
    assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])


def test_torch_compile_fullgraph_over_attention_with_lse(poisoned):
    torch._dynamo.reset()
    k = kernel(attention_lse)

    def step(q, key, v):   # torch ops on both sides of the kernel, fused by inductor
        o, lse = k(q * 1.0, key, v)
        return o.float().sum(-1), lse * 2.0

    q, key, v = attention_inputs(2, 4, 333, 333, 128, device="cuda")
    got, want = torch.compile(step, fullgraph=True)(q, key, v), step(q, key, v)
    o, lse = attention_lse.reference(q, key, v)
    check(got[0], want[0], o.float().sum(-1), exact=False)   # inductor may sum in another order
    check(got[1], want[1], lse * 2.0, exact=False)


def test_torch_export_of_a_module_calling_a_kernel(poisoned):
    block, x = block_and_input(ROWS[0])
    exported = torch.export.export(block, (x,))
    assert [n.target for n in exported.graph.nodes if n.op == "call_function"] == [block.up.op, block.down.op]
    check(exported.module()(x), block(x), block.reference(x))


def capture(fn, *static_inputs):
    """Warm `fn` up on a side stream (loads the modules, encodes the TMA maps), then capture it."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn(*static_inputs)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.graphs.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = fn(*static_inputs)
    return graph, outputs if isinstance(outputs, tuple) else (outputs,)


def replay(graph, static_inputs, static_outputs, new_inputs):
    for static, new in zip(static_inputs, new_inputs):
        static.copy_(new)
    for out in static_outputs:
        out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    return static_outputs


def test_cuda_graph_capture_and_replay_on_new_inputs(poisoned):
    block, x = block_and_input(ROWS[0])
    graph, outputs = capture(block, x)
    for seed in (1, 2):
        _, new = block_and_input(ROWS[0], seed)
        (got,) = replay(graph, [x], outputs, [new])
        check(got, block(new), block.reference(new))


def test_cuda_graph_capture_of_attention_with_lse(poisoned):
    k = kernel(attention_lse)
    static = attention_inputs(1, 4, 300, 300, 128, device="cuda")
    graph, outputs = capture(k, *static)
    new = attention_inputs(1, 4, 300, 300, 128, device="cuda", seed=5)
    got = replay(graph, static, outputs, new)
    for g, want, ref in zip(got, k(*new), attention_lse.reference(*new)):
        check(g, want, ref)


# -- host overhead ------------------------------------------------------------------------------

def host_microseconds(fn, n: int = 1000) -> float:
    """Median host time of one call, the GPU idle before each (so the launch queue never blocks)."""
    for _ in range(50):
        fn()
    times = []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - t0)
    torch.cuda.synchronize()
    return statistics.median(times) / 1e3


def measure_host_overhead() -> dict[str, float]:
    """Host µs per call of a 256³ matmul kernel: `k(a, b)`, `k.op(a, b)`, the launch alone
    (`LoadedKernel.launch` with arguments prepared once), the bare `cuLaunchKernel`; next to a
    trivial Triton kernel and a torch add."""
    from cuda.bindings import driver

    from wsched.codegen.launch import _marshal_args

    k = ws.compile(matmul)
    a, b = inputs_for(matmul, 256, 256, 256, device="cuda")
    k(a, b)
    plan, args, _ = k._prepare((a, b), None)
    params = _marshal_args(args)
    function = k._loaded._functions[a.device.index]
    stream = driver.CUstream(torch.cuda.current_stream().cuda_stream)
    times = {
        "k(a, b)": host_microseconds(lambda: k(a, b)),
        "k.op(a, b)": host_microseconds(lambda: k.op(a, b)),
        "launch only (LoadedKernel.launch)": host_microseconds(
            lambda: k._loaded.launch(plan.grid, args, device=plan.device)),
        "bare cuLaunchKernel": host_microseconds(lambda: driver.cuLaunchKernel(
            function, plan.grid, 1, 1, k._loaded.threads, 1, 1, k._loaded.smem_bytes, stream, params, 0)),
        "torch a + a": host_microseconds(lambda: a + a),
    }
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return times

    @triton.jit
    def add_one(x_ptr, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n) + 1, mask=i < n)

    x = torch.zeros(128, device="cuda")
    times["trivial Triton kernel"] = host_microseconds(lambda: add_one[(1,)](x, 128, BLOCK=128))
    return times


def test_host_overhead_of_a_call_over_the_launch():
    times = measure_host_overhead()
    print("\n" + "\n".join(f"  {name:36s} {us:7.2f} us" for name, us in times.items()))
    overhead = times["k(a, b)"] - times["launch only (LoadedKernel.launch)"]
    print(f"  {'k(a, b) - launch only':36s} {overhead:7.2f} us")
    assert overhead < 50, times   # the target is 10 us; a loose bound so a busy host does not fail it


if __name__ == "__main__":
    test_host_overhead_of_a_call_over_the_launch()
