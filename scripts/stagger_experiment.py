"""An experiment on the fixed cost of an attention tile, by IR edits (`CompiledKernel.with_ir`).

The two consumer warpgroups of a cooperative attention kernel take the halves of one 128-row tile
in lock step, so both pay a tile's fixed cost at once: the first Q K^T and softmax with no P V
under them, the last P V, the epilogue (on an H100 1.5 to 3 kv blocks' time a tile, by a trace
and by fits; it puts sliding windows and document masks at 0.75-0.8 of causal and is most of a
short sequence's loss, docs/benchmarks.md). Staggered, one warpgroup's fixed cost would fall in the other's
mainloop, where that one then has the tensor cores alone. The edits:

  stagger(ir, d)  the second warpgroup starts its first tile once the first has finished d kv
                  blocks (a named barrier, once per CTA). The K/V ring then holds both; d may
                  be at most the stages (the simulator finds the deadlock at d = stages + 1).
  double_q(ir)    two stages of Q: the next tile's Q loads while the current one runs, so the
                  warpgroup ahead does not wait for the other to release Q (the one stage of Q
                  is released by both at their last Q K^T, which pulls them back into step).

    python scripts/stagger_experiment.py --simulate   # CPU: every edit, simulator vs reference
    python scripts/stagger_experiment.py              # GPU: same-run timings against the base
    python scripts/stagger_experiment.py --trace DIR  # GPU: timelines of the window kernel, base and edits

The GPU mode times each edited kernel next to the unedited one in rounds (median of --iters, best
of three rounds) and checks that its output is bit-identical to the base's (the edits move no
arithmetic). Not yet run on a GPU: the session that wrote it had no device time left.
"""

import argparse
import dataclasses
import os
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
import wsched as ws  # noqa: E402
from attention_fusions import make_attention, make_variant, variant_inputs  # noqa: E402
from wsched.names import TOKEN_BARRIER  # noqa: E402

STAGGER_BARRIER = TOKEN_BARRIER + 2   # past each warpgroup's own (1 + wg) and ping-pong's tokens (3 + wg)


def _indent(line: str) -> str:
    return line[: len(line) - len(line.lstrip())]


def stagger(ir: str, d: int) -> str:
    """The second consumer warpgroup starts its first tile after the first has done d kv blocks."""
    out, consumer = [], False
    arrive = f"bar.arrive {STAGGER_BARRIER}, 256"
    for line in ir.split("\n"):
        stripped, ind = line.strip(), _indent(line)
        consumer = consumer or stripped.startswith("role consumer")
        if consumer and stripped == "if kv_tiles > 0 {":        # after the k loop: a tile with no block
            out += [f"{ind}if wg == 0 && tile == cta_id && kv_tiles == 0 {{", f"{ind}  {arrive}", f"{ind}}}"]
        out.append(line)
        if not consumer:
            continue
        if stripped.startswith("mbarrier.wait q_full["):
            out += [f"{ind}if wg == 1 && tile == cta_id {{", f"{ind}  bar.sync {STAGGER_BARRIER}, 256", f"{ind}}}"]
        if stripped == "tile.cast p, s_acc":                     # the end of a kv block's softmax
            out += [f"{ind}if wg == 0 && tile == cta_id && k + 1 == min({d}, kv_tiles) {{", f"{ind}  {arrive}",
                    f"{ind}}}"]
    text = "\n".join(out)
    if text.count(arrive) != 2 or text.count(f"bar.sync {STAGGER_BARRIER},") != 1:
        raise ValueError("stagger: not a cooperative attention kernel of the expected shape")
    return text


def double_q(ir: str) -> str:
    """Two stages of Q, indexed by the tile iteration."""
    ir = re.sub(r"smem Q: (\w+)\[1,", r"smem Q: \1[2,", ir)
    edits = [("barrier q_full[1]", "barrier q_full[2]"), ("barrier q_empty[1]", "barrier q_empty[2]"),
             ("mbarrier.wait q_empty[0] phase(tile_iter & 1 ^ 1)",
              "mbarrier.wait q_empty[tile_iter % 2] phase(tile_iter / 2 & 1 ^ 1)"),
             ("mbarrier.wait q_full[0] phase(tile_iter & 1)",
              "mbarrier.wait q_full[tile_iter % 2] phase(tile_iter / 2 & 1)"),
             ("arrive_expect_tx q_full[0]", "arrive_expect_tx q_full[tile_iter % 2]"),
             ("bar(q_full[0])", "bar(q_full[tile_iter % 2])"), ("tma.load Q[0,", "tma.load Q[tile_iter % 2,"),
             ("Q[0, wg]", "Q[tile_iter % 2, wg]"),
             ("mbarrier.arrive q_empty[0]", "mbarrier.arrive q_empty[tile_iter % 2]")]
    for old, new in edits:
        if old not in ir:
            raise ValueError(f"double_q: {old!r} is not in the kernel")
        ir = ir.replace(old, new)
    return ir


def variants(base, ds=(1, 2)):
    """(name, kernel, edit) of the experiment for a base kernel: the stagger at each d, and two Q
    stages with and without a stagger of 1 (at head dim 128 on 2 K/V stages, where 3 leave no room
    for a second Q: the plain 2-stage kernel too)."""
    found = [(f"stagger{d}", base, lambda text, d=d: stagger(text, d)) for d in ds if d <= base.schedule.stages]
    two = base
    if base.schedule.tile[2] >= 128:
        two = ws.compile(base.fusion, dataclasses.replace(base.schedule, stages=2), build=False)
        found.append(("stages2", two, lambda text: text))
    found += [("two_q", two, double_q), ("two_q_stagger1", two, lambda text: stagger(double_q(text), 1))]
    return found


CASES = [  # label, fusion, B, H, S, D
    ("causal d128", lambda: make_attention(128, causal=True), 4, 16, 4096, 128),
    ("window 1024 d128", lambda: make_variant(128, "window", lse=False, window=1024), 4, 16, 4096, 128),
    ("document d128", lambda: make_variant(128, "document", lse=False), 4, 16, 4096, 128),
    ("causal d64", lambda: make_attention(64, causal=True), 4, 16, 4096, 64),
    ("window 1024 d64", lambda: make_variant(64, "window", lse=False, window=1024), 4, 16, 4096, 64),
    ("causal d128 S1024", lambda: make_attention(128, causal=True), 16, 16, 1024, 128),
    ("no mask d128 S1024", lambda: make_attention(128), 16, 16, 1024, 128),
    ("causal d64 S1024", lambda: make_attention(64, causal=True), 16, 16, 1024, 64),
]


def simulate_all() -> None:
    """Every edit of every case's default kernel, simulated at a small shape against the reference."""
    for label, make, *_, D in CASES:
        fusion = make()
        base = ws.compile(fusion).primary
        for name, kernel, edit in variants(base):
            args = variant_inputs(fusion, 1, 2, 600, 700, D, seed=3)
            ref = fusion.reference(*args)
            ref = ref[0] if isinstance(ref, tuple) else ref
            for seed in range(2):
                out = kernel.with_ir(edit(kernel.ir), build=False).simulate(*args, seed=seed, num_sms=3)
                out = out[0] if isinstance(out, tuple) else out
                err = float((out.float() - ref.float()).norm() / ref.float().norm())
                print(f"{label:>20} {name:>15} seed {seed}: rel. error {err:.1e}", flush=True)


def time_all(iters: int) -> None:
    from wsched.timing import median_ms

    jobs = []
    for label, make, B, H, S, D in CASES:
        fusion = make()
        inputs = variant_inputs(fusion, B, H, S, S, D, device="cuda", seed=1)
        jobs.append((label, inputs, ws.compile(fusion).kernel_for(*inputs)))

    def build(job):
        label, _, base = job
        built = [("base", base)]
        for name, kernel, edit in variants(base):
            try:
                built.append((name, kernel.with_ir(edit(kernel.ir), build=True)))
            except Exception as error:   # report it, time the others
                print(f"{label}: {name} FAILED {type(error).__name__}: {str(error)[:300]}", flush=True)
        return built
    t0 = time.time()
    with ThreadPoolExecutor(os.cpu_count() or 4) as pool:
        kernels = list(pool.map(build, jobs))
    print(f"# {torch.cuda.get_device_name()}; built in {time.time() - t0:.0f} s; µs, best of 3 rounds of "
          f"median of {iters}; x: base / edit (> 1 faster)", flush=True)
    for (label, inputs, base), built in zip(jobs, kernels):
        ref = base(*inputs)
        ref = ref[0] if isinstance(ref, tuple) else ref
        same, times = {}, {name: [] for name, _ in built}
        for name, kernel in built:
            out = kernel(*inputs)
            same[name] = torch.equal(out[0] if isinstance(out, tuple) else out, ref)
        for _ in range(3):
            for name, kernel in built:
                times[name].append(median_ms(kernel.bind(*inputs), iters=iters))
        t_base = min(times["base"])
        print(f"{label:>20}: " + "  ".join(
            f"{name} {min(t) * 1e3:.1f} x{t_base / min(t):.3f}{'' if same[name] else ' DIFFERS'}"
            for name, t in times.items()), flush=True)


def trace_window(directory: str, ctas: int = 4) -> None:
    """GPU timelines (wsched.timeline, docs/timeline.md) of the window 1024 d128 case: the base
    kernel, the stagger of 1 and two Q stages with it, so the pictures show whether the two
    warpgroups stay out of step from tile to tile. JSON and PNG of the first `ctas` CTAs each."""
    from wsched import timeline

    label, make, B, H, S, D = CASES[1]
    fusion = make()
    inputs = variant_inputs(fusion, B, H, S, S, D, device="cuda", seed=1)
    base = ws.compile(fusion).kernel_for(*inputs)
    kernels = [("base", base)] + [(name, kernel.with_ir(edit(kernel.ir), build=False))
                                  for name, kernel, edit in variants(base, ds=(1,))
                                  if name in ("stagger1", "two_q_stagger1")]
    for name, kernel in kernels:
        traced = timeline.TracedKernel(kernel)
        traced(*inputs, capacity=1)   # warm-up
        _, trace = traced(*inputs, capacity=8192)
        path = os.path.join(directory, f"window_{name}.json")
        timeline.export(trace, path, ctas=ctas)
        print(f"{label} {name}: {path} (truncated streams: {trace.meta['truncated_streams']})", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--simulate", action="store_true", help="CPU: simulate every edit against the reference")
    ap.add_argument("--trace", metavar="DIR", help="GPU: timelines of the window kernel and two edits into DIR")
    ap.add_argument("--iters", type=int, default=30)
    args = ap.parse_args(argv)
    if args.simulate:
        simulate_all()
    elif args.trace:
        trace_window(args.trace)
    else:
        time_all(args.iters)


if __name__ == "__main__":
    main()
