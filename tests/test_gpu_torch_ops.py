"""The custom op of a compiled kernel on the GPU: torch.compile(fullgraph=True) over a block of two
kernels and over attention with LSE, torch.export, CUDA graph capture and replay, and the eager
call's fast path (what it skips for a seen layout).

Outputs are poisoned: with deterministic algorithms on, torch fills every `torch.empty` with NaN
(`torch.utils.deterministic.fill_uninitialized_memory`), so an output the kernel never wrote
stays NaN; captured outputs are filled with NaN before each replay.
"""

from __future__ import annotations

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


# -- the eager call's fast path -------------------------------------------------------------------
# The host time of a call is measured by benchmarks/host_overhead.py (next to a Triton launch in
# the same run); here, what makes it short: a seen layout is neither planned nor checked again,
# its tensor maps are not encoded again, and a call from a thread already on the device switches
# no context.

def test_a_seen_layout_is_launched_without_planning_encoding_or_switching_context(monkeypatch):
    """The Python path (the native one is tested below): what it skips for a seen layout."""
    from wsched.codegen import launch, tma

    k = ws.compile(matmul, ws.schedule_for(matmul))   # one kernel (not a per-shape choice)
    monkeypatch.setattr(k, "_native", False)
    a, b = inputs_for(matmul, 999, 1000, 1000, device="cuda")
    out = {"out": torch.empty(999, 1000, device="cuda", dtype=torch.bfloat16)}
    k(a, b, out=out)                    # plans the layout, encodes the maps, loads the module
    counts = {"plans": 0, "encodes": 0, "contexts": 0}

    def counting(name, fn):
        def counted(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)
        return counted

    monkeypatch.setattr(k, "_plan", counting("plans", k._plan))
    monkeypatch.setattr(tma, "tensor_map_for", counting("encodes", tma.tensor_map_for))
    monkeypatch.setattr(launch, "torch_context", counting("contexts", launch.torch_context))
    reference = matmul.reference(a, b).float()
    for seed in range(3):
        out["out"].fill_(float("nan"))
        got = k(a, b, out=out).float()
        torch.cuda.synchronize()
        assert not torch.isnan(got).any() and float((got - reference).norm() / reference.norm()) < 1e-2, seed
    assert counts == {"plans": 0, "encodes": 0, "contexts": 0}
    a2 = a.clone()                      # the same layout at a new address: its map only
    got = k(a2, b, out=out).float()
    assert counts == {"plans": 0, "encodes": 1, "contexts": 0}
    assert float((got - reference).norm() / reference.norm()) < 1e-2
    k(a[:500], b)                       # a new layout: planned once
    assert counts["plans"] == 1 and counts["contexts"] == 0


# -- the native launch path (codegen/native.py) ---------------------------------------------------
# A layout's second call is launched from C. Outputs are poisoned by the fixture (torch.empty
# fills NaN, also when the native path calls it), out= tensors by the test.

def native_stats(launchers, key=None):
    return launchers[key].stats() if key in launchers else {"hits": 0, "misses": 0, "plans": 0}


def relative_error(got, reference) -> float:
    assert not torch.isnan(got).any(), f"{int(torch.isnan(got).sum())} outputs never written"
    return float((got.float() - reference.float()).norm() / reference.float().norm())


def test_native_calls_on_new_inputs_and_outputs_match_torch(poisoned):
    k = ws.compile(matmul, ws.schedule_for(matmul))
    assert k._native, "the native launch extension is not built on the GPU machine"
    a, b = inputs_for(matmul, 999, 1000, 1000, device="cuda")
    k(a, b)                                          # the Python path plans the layout
    results = []
    for seed in range(12):   # more output addresses alive than a map slot caches: encodes and evictions
        a, b = inputs_for(matmul, 999, 1000, 1000, device="cuda", seed=seed)
        results.append((k(a, b), matmul.reference(a, b)))
    torch.cuda.synchronize()
    for got, reference in results:
        assert relative_error(got, reference) < 1e-2
    # the second call (Python path) hands the plan over: eleven of the twelve were launched from C
    assert native_stats(k._natives) == {"hits": 11, "misses": 0, "plans": 1}


def test_native_out_calls_write_the_given_tensor(poisoned):
    k = ws.compile(matmul, ws.schedule_for(matmul))
    a, b = inputs_for(matmul, 513, 768, 320, device="cuda", seed=3)
    out = {"out": torch.empty(513, 768, device="cuda", dtype=torch.bfloat16)}
    reference = matmul.reference(a, b)
    for _ in range(3):
        out["out"].fill_(float("nan"))
        assert k(a, b, out=out) is out["out"]
        assert relative_error(out["out"], reference) < 1e-2
    assert native_stats(k._natives, ("out",))["hits"] == 1


def test_native_calls_of_attention_return_o_and_lse(poisoned):
    k = ws.compile(attention_lse, build=False)   # its own launchers (the shared kernel's count other tests' calls)
    for seed in range(3):
        q, key, v = attention_inputs(2, 4, 333, 300, 128, device="cuda", seed=seed)
        o, lse = k(q, key, v)
        want_o, want_lse = attention_lse.reference(q, key, v)
        assert relative_error(o, want_o) < 1e-2 and relative_error(lse, want_lse) < 1e-2
    assert native_stats(k._natives)["hits"] == 1


def test_a_per_shape_choice_launches_each_chosen_kernel_natively(poisoned):
    chooser = ws.compile(matmul)
    shapes = [(16, 4096, 4096), (2048, 2048, 512)]   # a split-K variant and the default
    for round_ in range(3):
        for M, N, K in shapes:
            a, b = inputs_for(matmul, M, N, K, device="cuda", seed=round_)
            assert relative_error(chooser(a, b), matmul.reference(a, b)) < 1e-2, (round_, M)
    # each shape's second call hands its plan over (the second shape's misses the first's first)
    assert native_stats(chooser._natives) == {"hits": 2, "misses": 1, "plans": 2}
    assert len({chooser.kernel_for(*inputs_for(matmul, M, N, K, device="cuda")).schedule.short()
                for M, N, K in shapes}) == 2


def test_a_misaligned_base_of_a_seen_layout_takes_the_python_path_and_is_staged():
    k = ws.compile(matmul, ws.schedule_for(matmul))
    base = torch.randn(256, 136, device="cuda").bfloat16()
    b = torch.randn(128, 256, device="cuda").bfloat16()
    k(base[:, :128], b)
    k(base[:, :128], b)
    with pytest.warns(UserWarning, match=r"'a' \(256, 128\): base 2 bytes past a 16-byte boundary"):
        out = k(base[:, 1:129], b)                    # the same shape and strides, 2 bytes in: copied
    ref = matmul.reference(base[:, 1:129], b).float()
    assert float((out.float() - ref).norm() / ref.norm()) < 1e-2


def test_native_calls_on_a_side_stream_and_under_graph_capture(poisoned):
    k = ws.compile(matmul, ws.schedule_for(matmul))
    a, b = inputs_for(matmul, 640, 512, 256, device="cuda", seed=1)
    reference = matmul.reference(a, b)
    k(a, b)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        # the side stream is busy, then fills the output with NaN (the fixture): a kernel
        # launched on another stream would run first and have its output overwritten
        torch.cuda._sleep(10_000_000)
        got = k(a, b)
    side.synchronize()
    assert relative_error(got, reference) < 1e-2
    graph, (out,) = capture(k, a, b)
    new = inputs_for(matmul, 640, 512, 256, device="cuda", seed=2)
    (got,) = replay(graph, [a, b], [out], new)
    assert relative_error(got, matmul.reference(*new)) < 1e-2
    assert native_stats(k._natives)["hits"] >= 3


def test_with_the_native_path_off_calls_give_the_same_bits(monkeypatch):
    a, b = inputs_for(matmul, 999, 1000, 1000, device="cuda", seed=7)
    on = ws.compile(matmul, ws.schedule_for(matmul))
    monkeypatch.setenv("WSCHED_NATIVE_LAUNCH", "0")
    off = ws.compile(matmul, ws.schedule_for(matmul))
    assert on._native and not off._native
    for _ in range(3):
        torch.testing.assert_close(on(a, b), off(a, b), rtol=0, atol=0)
    assert off._natives == {} and native_stats(on._natives)["hits"] == 1
