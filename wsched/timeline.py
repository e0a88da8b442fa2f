"""Timelines of a kernel's warpgroups: does the producer run ahead of the consumers?

    trace = trace_simulated(fusion, {"M": 512, "N": 512, "K": 512}, "mlp_sim.json")   # CPU
    trace = trace_gpu(fusion, {"M": 4096, "N": 4096, "K": 1024}, "mlp_gpu.json")     # Hopper GPU

Both write a Chrome / Perfetto trace (open it in https://ui.perfetto.dev or chrome://tracing)
and, next to it, a PNG of the producer and consumer lanes (matplotlib: `pip install
wsched[trace]`). Both return the `Trace` (`lowering/simulate/trace.py`: the events, per CTA,
role and warpgroup). docs/timeline.md says how to read the pictures.

* `trace_simulated` runs the kernel in the CPU simulator with `trace=True`: its clock is the
  scheduler's step count (logical time: every runnable warpgroup and TMA copy advances at the
  same average rate), so it shows the protocol — who waits on whom, how far the producer runs
  ahead, when slots are released — not the GPU's speeds.
* `trace_gpu` builds the instrumented kernel (`emit_kernel(kernel, trace=True)`: stamps of
  %globaltimer and %clock around the same statements, into a buffer that is an extra kernel
  parameter), runs it once to warm up and once traced, reads the buffer back and decodes it
  through the simulator's `TraceBuilder`, so both sources give events of one vocabulary. The
  untraced kernel (`ws.compile`) is not changed by any of this.

Lower-level pieces: `simulate_trace(compiled, tensors)`, `TracedKernel(compiled)(*tensors)`,
`decode_gpu_records(...)`, `chrome_trace(trace)`, `write_json`, `read_json`, `write_png`.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Sequence

import torch

from .lowering.simulate.trace import (ARRIVE, ASYNC_CATEGORIES, BAR_SYNC, STORE, TILE, TMA_LOAD, TMA_STORE, TMA_WAIT,
                                      WAIT, WGMMA, WGMMA_WAIT, Trace, TraceBuilder, TraceEvent, roles_of)
from .inputs import random_inputs
from .target import WARPGROUP_THREADS

__all__ = ["trace_simulated", "trace_gpu", "simulate_trace", "TracedKernel", "decode_gpu_records",
           "chrome_trace", "write_json", "read_json", "write_png", "export", "Trace", "TraceEvent"]

PNG_CTAS = 4   # CTAs a PNG shows unless told (a GPU grid has one per SM)


# ---------------------------------------------------------------------------------------------
# Entry points (the CLI's `wsched trace` calls these)
# ---------------------------------------------------------------------------------------------


def trace_simulated(fusion, sizes: dict[str, int], path: str | Path | None = None, *, inputs=None,
                    schedule=None, num_sms: int = 4, seed: int = 0, png: bool | str | Path = True,
                    ctas: int | Sequence[int] | None = None, **overrides) -> Trace:
    """Simulate `fusion` at `sizes` on the CPU with a timeline; write it to `path` (JSON) and a
    PNG beside it (`png`: True, False or the PNG's path). `inputs`: the tensors (default random
    normal, `seed`); `schedule` / `overrides`: as `ws.compile`; `ctas`: the CTAs to export (an
    int: the first n; default every CTA in the JSON, the first 4 in the PNG)."""
    from .kernel import build_kernel as compile_fusion

    compiled = compile_fusion(fusion, schedule, build=False, **overrides)
    tensors = list(inputs) if inputs is not None else random_inputs(fusion, sizes, "cpu", seed)
    _, trace = simulate_trace(compiled, tensors, num_sms=num_sms, seed=seed)
    trace.meta.update(fusion=fusion.name, sizes=dict(sizes), schedule=repr(compiled.schedule))
    if path is not None:
        export(trace, path, png=png, ctas=ctas)
    return trace


def trace_gpu(fusion, sizes: dict[str, int], path: str | Path | None = None, *, inputs=None,
              schedule=None, seed: int = 0, capacity: int = 4096, warmup: int = 1,
              png: bool | str | Path = True, ctas: int | Sequence[int] | None = None, **overrides) -> Trace:
    """Build the instrumented kernel of `fusion`, run it at `sizes` on the GPU (after `warmup`
    untimed runs), and write its timeline like `trace_simulated`. `capacity`: stamps per
    warpgroup thread; a run that fills it is repeated with 4x the room (up to twice)."""
    from .kernel import build_kernel as compile_fusion

    _require_gpu()
    compiled = compile_fusion(fusion, schedule, build=False, **overrides)
    tensors = list(inputs) if inputs is not None else random_inputs(fusion, sizes, "cuda", seed)
    traced = TracedKernel(compiled)
    for _ in range(warmup):
        traced(*tensors, capacity=1)
    for _ in range(3):
        _, trace = traced(*tensors, capacity=capacity)
        if not trace.meta["truncated_streams"]:
            break
        capacity *= 4
    trace.meta.update(fusion=fusion.name, sizes=dict(sizes), schedule=repr(compiled.schedule),
                      device=torch.cuda.get_device_name(tensors[0].device))
    if path is not None:
        export(trace, path, png=png, ctas=ctas)
    return trace


def export(trace: Trace, path: str | Path, *, png: bool | str | Path = True,
           ctas: int | Sequence[int] | None = None) -> None:
    """`path` (Chrome trace JSON) and, unless `png` is False, the PNG (`png` or beside `path`)."""
    path = Path(path)
    write_json(trace, path, ctas=ctas)
    if png:
        write_png(trace, path.with_suffix(".png") if png is True else Path(png), ctas=ctas)


# ---------------------------------------------------------------------------------------------
# The two sources
# ---------------------------------------------------------------------------------------------


def simulate_trace(compiled, tensors, *, num_sms: int = 4, seed: int = 0):
    """(outputs, Trace) of `compiled` (a `CompiledKernel`) run in the simulator on CPU tensors;
    the call is prepared as `CompiledKernel.simulate` prepares it."""
    from .lowering.simulate import simulate

    inputs, scalars, sizes = compiled._bind_inputs(tensors)
    outs = compiled._outputs(sizes, "cpu")
    for t in outs.values():
        t.fill_(float("nan"))
    report = simulate(compiled.kernel, {**compiled._kernel_views({**inputs, **outs}, scalars), **scalars},
                      num_sms=num_sms, seed=seed, trace=True)
    return _result(outs), report.trace


class TracedKernel:
    """The instrumented build of a `CompiledKernel`: the same IR, emitted with `trace=True`,
    built beside it (its own cubin) and launched with the same arguments plus the buffer.

        outputs, trace = TracedKernel(ws.compile(fusion))(a, b, bias)
    """

    def __init__(self, compiled):
        from .codegen.emit import emit_kernel

        self.compiled = compiled
        self.emitted = emit_kernel(compiled.kernel, trace=True)
        self.build = None
        self.spills: dict[str, tuple[int, int]] = {}   # kernel -> (bytes stored, loaded) of the traced build
        self._loaded = None

    def compile_cuda(self):
        """Build the instrumented kernel. Its stamps keep a few registers live, so a kernel that
        builds without spills just within its registers (a split-KV decode step) may spill here:
        that is accepted with a warning (the trace's meta keeps the counts), since the stamps
        themselves already change its timing; the plain build stays spill-free."""
        import warnings

        from .codegen.build import compile_cuda

        kernel = self.compiled.kernel
        self.build = compile_cuda(self.emitted.source, name=f"{kernel.name} (traced)",
                                  extra_key=repr(self.compiled.schedule), allow_spills=True)
        spills = {name: (r.spill_stores, r.spill_loads) for name, r in self.build.resources.items()
                  if r.spill_stores or r.spill_loads}
        if spills:
            counts = ", ".join(f"{name}: {st} bytes stored, {ld} loaded" for name, (st, ld) in spills.items())
            warnings.warn(f"the traced build of {kernel.name} spills registers ({counts}); its timeline "
                          f"shows the spills' cost too", stacklevel=2)
        self.spills = spills
        return self.build

    def launch(self, tensors, capacity: int = 4096, records: torch.Tensor | None = None):
        """Launch once without waiting: (outputs, the int32 record buffer it fills). `records`:
        a buffer of an earlier launch to fill again (not zeroed: for timing the kernel alone)."""
        from .codegen.launch import LoadedKernel

        if capacity < 1:
            raise ValueError(f"capacity must be at least 1 stamp per stream, got {capacity}")
        kernel = self.compiled.kernel
        if self._loaded is None:
            if self.build is None:
                self.compile_cuda()
            self._loaded = LoadedKernel(self.build.cubin_path, kernel.name, kernel.smem_bytes, kernel.threads)
        grid, args, outs = self.compiled.launch_args(tensors)
        device = next(iter(outs.values())).device
        if records is None:
            records = torch.zeros((grid, kernel.threads // WARPGROUP_THREADS, 2, capacity, 4), dtype=torch.int32,
                                  device=device)
        self._loaded.launch(grid, [*args, ("ptr", records.data_ptr()), ("i32", capacity)], device=device)
        return outs, records

    def __call__(self, *tensors, capacity: int = 4096):
        """(outputs, Trace) of one traced run on the tensors' GPU (synchronizes)."""
        outs, records = self.launch(tensors, capacity)
        torch.cuda.synchronize(records.device)
        kernel = self.compiled.kernel
        trace = decode_gpu_records(records.cpu(), self.emitted.trace_sites, roles_of(kernel), kernel.name)
        if self.spills:
            trace.meta["traced_build_spills"] = {name: {"stores": st, "loads": ld}
                                                 for name, (st, ld) in self.spills.items()}
        return _result(outs), trace


def decode_gpu_records(records: torch.Tensor, sites, roles, kernel_name: str) -> Trace:
    """A `Trace` (ns since the first stamp) from the buffer of a traced run: int32
    [grid, warpgroups, 2, capacity, 4] holding uint32 words (`codegen/include/trace.cuh`), the
    emitter's site table and the kernel's roles (`trace.roles_of`).

    Each record has %globaltimer_lo (ns, one clock for the whole GPU, coarse on some parts) and
    %clock (cycles, one counter per SM): a time is the SM's cycles scaled by the median
    ns-per-cycle of the SMs that ran long enough to measure it (a least-squares fit of timer
    against cycles), placed by the SM's median offset to the timer; where no SM ran 2 µs, the
    timer alone."""
    words = records.to(torch.int64) & 0xFFFFFFFF
    capacity = words.shape[3]
    site = words[..., 2] & 0xFFFF
    truncated = int(((site != 0).sum(-1) == capacity).sum())
    cta, gid, stream, position = (site != 0).nonzero(as_tuple=True)
    rec = words[cta, gid, stream, position]
    if not len(rec):
        return Trace(kernel_name, "gpu", "ns", tuple(roles), [],
                     meta={"grid": words.shape[0], "truncated_streams": truncated})
    wrap = lambda d: (d + 2**31) % 2**32 - 2**31  # noqa: E731  (32-bit counters: signed differences)
    timer = wrap(rec[:, 0] - rec[0, 0]).double()
    sm = rec[:, 2] >> 16
    cycles = torch.zeros(len(rec), dtype=torch.float64)
    slopes = []
    for s in sm.unique():
        on = sm == s
        cycles[on] = c = wrap(rec[on, 1] - rec[on, 1][0]).double()
        g = timer[on]
        if g.max() - g.min() >= 2000:
            c, g = c - c.mean(), g - g.mean()
            slopes.append(float((c * g).sum() / (c * c).sum()))
    ns_per_cycle = statistics.median(slopes) if slopes else None
    if ns_per_cycle is None:
        t = timer
    else:
        t = cycles * ns_per_cycle
        for s in sm.unique():
            on = sm == s
            t[on] += (timer[on] - t[on]).median()
    t = (t - t.min()).tolist()

    lanes = {first + wg: (name, wg) for name, first, count in roles for wg in range(count)}
    builder = TraceBuilder()
    cta, gid, stream, sm = cta.tolist(), gid.tolist(), stream.tolist(), sm.tolist()
    site_index, value = (rec[:, 2] & 0xFFFF).tolist(), rec[:, 3].tolist()
    for i in sorted(range(len(t)), key=lambda i: (cta[i], gid[i], t[i], stream[i])):
        name, wg = lanes[gid[i]]
        builder.stamp(cta[i], name, wg, sites[site_index[i] - 1], value[i], t[i], {"value": value[i]})
    ticks = timer.unique().diff()
    return Trace(kernel_name, "gpu", "ns", tuple(roles), builder.finish(), sms=dict(zip(cta, sm)),
                 meta={"grid": words.shape[0], "truncated_streams": truncated, "capacity": capacity, "stamps": len(t),
                       "ns_per_cycle": ns_per_cycle,
                       "globaltimer_resolution_ns": float(ticks.min()) if len(ticks) else None})


def _require_gpu() -> None:
    if not torch.cuda.is_available():
        raise RuntimeError("trace_gpu needs a CUDA device (a Hopper GPU, sm_90a); trace_simulated draws the "
                           "same timeline from the CPU simulator")


def _result(outs: dict):
    values = list(outs.values())
    return values[0] if len(values) == 1 else tuple(values)


# ---------------------------------------------------------------------------------------------
# Chrome / Perfetto JSON
# ---------------------------------------------------------------------------------------------


def _select(trace: Trace, ctas, default: int | None) -> list[int]:
    every = trace.ctas
    if ctas is None:
        return every if default is None else every[:default]
    if isinstance(ctas, int):
        return every[:ctas]
    return [c for c in ctas if c in set(every)]


def chrome_trace(trace: Trace, ctas: int | Sequence[int] | None = None) -> dict:
    """The trace in the Chrome trace event format: one process per CTA, one thread (track) per
    role x warpgroup with its waits and stores ("X") and instants ("i"), and the asynchronous
    work it started (TMA loads, wgmma groups) as async slices ("b" / "e") of that process.
    `ts` is in µs on the GPU; for the simulator 1 ts unit is one scheduler step."""
    scale = 1e-3 if trace.clock == "ns" else 1.0
    first = {name: start for name, start, _ in trace.roles}
    chosen = set(_select(trace, ctas, None))
    events: list[dict] = []
    for cta in sorted(chosen):
        sm = trace.sms.get(cta)
        where = f" (SM {sm})" if trace.source == "gpu" and sm is not None else ""
        events.append({"ph": "M", "name": "process_name", "pid": cta, "args": {"name": f"CTA {cta}{where}"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": cta, "args": {"sort_index": cta}})
        for name, start, count in trace.roles:
            for wg in range(count):
                events.append({"ph": "M", "name": "thread_name", "pid": cta, "tid": start + wg,
                               "args": {"name": f"{name} wg{wg}"}})
                events.append({"ph": "M", "name": "thread_sort_index", "pid": cta, "tid": start + wg,
                               "args": {"sort_index": start + wg}})
    next_id = 0
    for e in trace.events:
        if e.cta not in chosen:
            continue
        common = {"name": e.label, "cat": e.category, "pid": e.cta, "tid": first[e.role] + e.warpgroup,
                  "ts": e.begin * scale}
        args = {k: v for k, v in e.args.items() if v is not None}
        if e.category in ASYNC_CATEGORIES and e.end > e.begin:
            next_id += 1
            name = f"{e.role} wg{e.warpgroup}: {e.label}"
            events.append({**common, "name": name, "ph": "b", "id": next_id, "args": args})
            events.append({**common, "name": name, "ph": "e", "id": next_id, "ts": e.end * scale})
        elif e.end > e.begin or e.category not in (ARRIVE, TMA_LOAD, TMA_STORE, TILE):
            events.append({**common, "ph": "X", "dur": (e.end - e.begin) * scale, "args": args})
        else:
            events.append({**common, "ph": "i", "s": "t", "args": args})
    other = {"kernel": trace.kernel, "source": trace.source, "clock": trace.clock,
             "ts_unit": "µs" if trace.clock == "ns" else "scheduler step",
             "roles": [list(r) for r in trace.roles], "sms": {str(c): s for c, s in trace.sms.items() if c in chosen},
             "meta": {k: v if isinstance(v, (int, float, str, bool, type(None), list, dict)) else repr(v)
                      for k, v in trace.meta.items()}}
    return {"traceEvents": events, "displayTimeUnit": "ns", "otherData": other}


def write_json(trace: Trace, path: str | Path, ctas: int | Sequence[int] | None = None) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(chrome_trace(trace, ctas), separators=(",", ":"), ensure_ascii=False))
    return path


def read_json(path: str | Path) -> Trace:
    """The `Trace` a `write_json` file holds (e.g. to draw a GPU trace's PNG on another machine)."""
    data = json.loads(Path(path).read_text())
    other = data["otherData"]
    scale = 1e3 if other["clock"] == "ns" else 1.0
    roles = tuple(tuple(r) for r in other["roles"])
    lanes = {first + wg: (name, wg) for name, first, count in roles for wg in range(count)}
    events, opened = [], {}
    for ev in data["traceEvents"]:
        if ev["ph"] == "M":
            continue
        if ev["ph"] == "b":
            opened[ev["id"]] = ev
            continue
        role, wg = lanes[ev["tid"]]
        end = (ev["ts"] + ev.get("dur", 0)) * scale
        if ev["ph"] == "e":   # an async slice: its "b" has the start and the args
            ev = opened.pop(ev["id"])
            ev = {**ev, "name": ev["name"].removeprefix(f"{role} wg{wg}: ")}
        events.append(TraceEvent(ev["pid"], role, wg, ev["cat"], ev["name"], ev["ts"] * scale, end,
                                 ev.get("args", {})))
    return Trace(other["kernel"], other["source"], other["clock"], roles,
                 sorted(events, key=lambda e: (e.cta, e.role, e.warpgroup, e.begin, e.end)),
                 sms={int(c): s for c, s in other["sms"].items()}, meta=other["meta"])


# ---------------------------------------------------------------------------------------------
# PNG
# ---------------------------------------------------------------------------------------------

# span categories on a lane's upper half (what the warpgroup itself is doing) and async categories on its
# lower half (what it started that is still running); instants as ticks. Waits take their
# role's colour: a role that issues TMA waits for free slots, the others for data.
_WAIT_COLORS = ("#d62728", "#ff7f0e", "#17becf", "#7f7f7f")
_SPAN_STYLE = {BAR_SYNC: ("#8c564b", "bar.sync"),
               WGMMA_WAIT: ("#9467bd", "wgmma.wait"), TMA_WAIT: ("#e377c2", "tma.wait (stores)"),
               STORE: ("#bcbd22", "epilogue store")}
_ASYNC_STYLE = {TMA_LOAD: ("#2ca02c", "TMA load in flight"), WGMMA: ("#1f77b4", "wgmma group in flight")}
_TICK_STYLE = {TMA_LOAD: ("#2ca02c", "TMA load issued"), ARRIVE: ("#7f7f7f", "mbarrier.arrive (release)"),
               TMA_STORE: ("#bcbd22", "TMA store issued"), TILE: ("#000000", "next tile")}


def _figure_class():
    try:
        from matplotlib.figure import Figure
    except ModuleNotFoundError as error:
        raise ModuleNotFoundError("the timeline PNG needs matplotlib: pip install 'wsched[trace]' (or pip "
                                  "install matplotlib); the JSON trace needs nothing more",
                                  name="matplotlib") from error
    return Figure


def write_png(trace: Trace, path: str | Path, ctas: int | Sequence[int] | None = None,
              title: str | None = None) -> Path:
    """A PNG of one lane per CTA x role x warpgroup (the first 4 CTAs unless `ctas` says)."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    Figure = _figure_class()
    shown = _select(trace, ctas, PNG_CTAS)
    lanes = [(cta, name, wg) for cta in shown for name, _, count in trace.roles for wg in range(count)]
    index = {lane: i for i, lane in enumerate(lanes)}
    scale = 1e-3 if trace.clock == "ns" else 1.0
    fig = Figure(figsize=(15, 1.6 + 0.42 * max(len(lanes), 1)), dpi=110)
    ax = fig.add_subplot()
    spans: dict[str, list] = {}
    ticks: dict[str, tuple[list, list]] = {}
    used = set()
    for e in trace.events:
        lane = index.get((e.cta, e.role, e.warpgroup))
        if lane is None:
            continue
        y = len(lanes) - 1 - lane
        begin, width = e.begin * scale, (e.end - e.begin) * scale
        if e.category in _ASYNC_STYLE and width > 0:
            spans.setdefault(("async", e.category), []).append((begin, width, y + 0.08))
        elif e.category == WAIT or e.category in _SPAN_STYLE:
            if width > 0:
                category = (WAIT, e.role) if e.category == WAIT else e.category
                spans.setdefault(("sync", category), []).append((begin, width, y + 0.5))
        elif e.category in _TICK_STYLE:
            xs, ys = ticks.setdefault(e.category, ([], []))
            xs.append(begin)
            ys.append(y + (0.45 if e.category != TILE else 0.5))
    styles = {**_wait_styles(trace), **_SPAN_STYLE}
    for (row, category), items in spans.items():
        color, _ = (_ASYNC_STYLE if row == "async" else styles)[category]
        by_y: dict[float, list] = {}
        for begin, width, y in items:
            by_y.setdefault(y, []).append((begin, width))
        for y, bars in by_y.items():
            ax.broken_barh(bars, (y, 0.38 if row == "async" else 0.42), facecolors=color,
                           alpha=0.45 if row == "async" else 0.9, linewidth=0)
        used.add((row, category))
    for category, (xs, ys) in ticks.items():
        color, _ = _TICK_STYLE[category]
        tile = category == TILE
        ax.scatter(xs, ys, marker="|", s=260 if tile else 70, c=color, linewidths=1.6 if tile else 0.8,
                   alpha=0.9 if tile else 0.55, zorder=3)
        used.add(("tick", category))
    ax.set_yticks([len(lanes) - 1 - i + 0.5 for i in range(len(lanes))])
    ax.set_yticklabels([f"CTA {c}  {name} wg{wg}" for c, name, wg in lanes], fontsize=8)
    ax.set_ylim(0, max(len(lanes), 1))
    for i, (cta, name, wg) in enumerate(lanes):
        if i and lanes[i - 1][0] != cta:
            ax.axhline(len(lanes) - i, color="#444444", linewidth=0.8)
    ax.set_xlim(left=0)
    ax.set_xlabel("µs since the first stamp (GPU: %globaltimer / %clock)" if trace.clock == "ns"
                  else "scheduler steps (the simulator's logical clock)")
    ax.grid(axis="x", alpha=0.3)
    handles = [Patch(color=styles[k][0], label=styles[k][1]) for k in styles if ("sync", k) in used]
    handles += [Patch(color=_ASYNC_STYLE[k][0], alpha=0.45, label=_ASYNC_STYLE[k][1])
                for k in _ASYNC_STYLE if ("async", k) in used]
    handles += [Line2D([], [], color=_TICK_STYLE[k][0], marker="|", linestyle="", markersize=10,
                       label=_TICK_STYLE[k][1]) for k in _TICK_STYLE if ("tick", k) in used]
    height = fig.get_figheight()
    fig.legend(handles=handles, loc="lower center", ncol=min(len(handles), 6), fontsize=8, frameon=False)
    ax.set_title(title or _title(trace, shown), fontsize=10)
    fig.tight_layout(rect=(0, 0.5 / height, 1, 1))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return path


def _wait_styles(trace: Trace) -> dict:
    loaders = {e.role for e in trace.events if e.category == TMA_LOAD}
    styles = {}
    for (name, _, _), color in zip(trace.roles, _WAIT_COLORS):
        why = "a free slot" if name in loaders else "data / a slot release"
        styles[(WAIT, name)] = (color, f"{name} waits for {why} (mbarrier.wait)")
    return styles


def _title(trace: Trace, shown: list[int]) -> str:
    meta = trace.meta
    sizes = " ".join(f"{k}={v}" for k, v in meta.get("sizes", {}).items())
    where = (f"GPU ({meta['device']})" if "device" in meta else "GPU") if trace.source == "gpu" \
        else f"CPU simulator, {meta.get('num_sms', '?')} SMs"
    total = meta.get("grid") or len(trace.ctas)
    ctas = f"CTAs {shown[0]}-{shown[-1]} of {total}" if shown and len(shown) < total else f"{total} CTAs"
    return f"{meta.get('fusion', trace.kernel)} {sizes} — {where}, {ctas}"
