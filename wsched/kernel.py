"""A fusion compiled with one schedule: fusion -> schedule -> partition -> loop IR -> CUDA ->
cubin -> launch (`build_kernel`), and the `CompiledKernel` that runs it on the GPU or in the CPU
simulator. `wsched/api.py` puts the public `ws.compile` (with the autotuner) on top of it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import cached_property

import torch

from .codegen.nvcc import nvcc_available
from .errors import ArgumentError, FusionError, check_argument, short_repr
from .fusion import check_fusion
from .lowering.pipeline import lower_partition
from .partition import Partition, param_name
from .schedule import Schedule, ScheduleError, check_schedule
from . import torch_ops
from .target import TORCH_DTYPES
from .workloads import partition, workload_for


def schedule_for(fusion, schedule: Schedule | None = None, **overrides) -> Schedule:
    """The schedule to use: the one given, else the default of the workload that takes the
    fusion, with `overrides` applied."""
    workload = workload_for(check_fusion(fusion, "ws.schedule_for"))
    if schedule is not None:
        check_schedule(schedule)
        if overrides:
            raise ScheduleError("pass either a Schedule or keyword overrides, not both")
        return schedule
    return workload.default_schedule(fusion, **overrides)


def lower(fusion, schedule: Schedule | None = None, **overrides):
    """Lower a fusion to the final loop IR (`Kernel`); `kernel.ir_after[pass]` keeps each step."""
    check_fusion(fusion, "ws.lower")
    return lower_partition(partition(fusion, schedule_for(fusion, schedule, **overrides)))


@dataclass
class CompiledKernel:
    """A fusion compiled for sm_90a: call it on CUDA tensors, or `simulate` it on CPU tensors."""

    fusion: object
    schedule: Schedule
    partition: Partition
    kernel: object                               # final loop IR (lowering.ir.Kernel)
    cuda_source: str
    timings: dict = field(default_factory=dict)  # seconds spent in lower / emit / build
    build: object = None                         # codegen.build.BuildResult once built
    _maps: dict = field(default_factory=dict, repr=False)   # encoded TMA maps by tensor layout
    _plans: dict = field(default_factory=dict, repr=False)  # launch plans by argument layouts

    def __post_init__(self):
        # The torch custom op that runs this kernel (wsched/torch_ops.py). Registered now, not
        # on first use: torch.compile can trace a call of the op but not its registration.
        self.op = torch_ops.register(self)

    @property
    def ir(self) -> str:
        return str(self.kernel)

    @cached_property
    def ir_after(self) -> dict[str, str]:
        return {name: str(k) for name, k in self.kernel.ir_after.items()}

    @property
    def resources(self):
        """ptxas registers / smem / spills of the kernel (None before it is built)."""
        if self.build is None:
            return None
        return self.build.resources[self.kernel.name]

    # -- binding ---------------------------------------------------------------------------
    def _bind(self, tensors) -> tuple[dict, dict, dict]:
        """(inputs by name, scalar params, sizes) for one call; FusionError on bad inputs."""
        sizes = self.fusion.bind_tensors(self.fusion.name, tensors)
        by_id = {node.id: t for node, t in zip(self.fusion.inputs, tensors)}
        scalars = {dim: int(by_id[name].shape[axis]) for dim, (name, axis) in self.partition.dims.items()}
        inputs = {param_name(i): t for i, t in by_id.items()}
        empty = [dim for dim in self.partition.nonempty if scalars.get(dim, 1) < 1]
        if empty:
            raise FusionError(self.fusion.name, f"{empty[0]} is 0; the kernel needs at least one element there")
        return inputs, scalars, sizes

    def _outputs(self, sizes, device) -> dict[str, torch.Tensor]:
        """Fresh output tensors, shaped from the output nodes with the bound sizes."""
        return {name: torch.empty([sizes[d] if isinstance(d, str) else d for d in node.shape],
                                  dtype=TORCH_DTYPES[node.dtype.name], device=device)
                for node, name in zip(self.partition.outputs, self.partition.output_names)}

    def _kernel_views(self, tensors_by_name: dict, scalars: dict) -> dict:
        """Tensors as the kernel's `global` params declare them (LSE [.., S] is read as [.., S, 1])."""
        from .lowering import ir
        from .lowering.evaluate import evaluate

        views = dict(tensors_by_name)
        for p in self.kernel.params:
            if isinstance(p, ir.GlobalParam) and views[p.name].dim() != len(p.shape):
                views[p.name] = views[p.name].view([evaluate(e, scalars) for e in p.shape])
        return views

    def _result(self, outs: dict[str, torch.Tensor]):
        values = list(outs.values())
        return values[0] if len(values) == 1 else tuple(values)

    # -- GPU -----------------------------------------------------------------------------
    @cached_property
    def _loaded(self):
        from .codegen.launch import LoadedKernel

        if self.build is None:
            self.compile_cuda()
        return LoadedKernel(self.build.cubin_path, self.kernel.name, self.kernel.smem_bytes, self.kernel.threads)

    def compile_cuda(self):
        """Build the cubin with nvcc (through the on-disk cache)."""
        from .codegen.build import compile_cuda

        t0 = time.perf_counter()
        artifacts = {f"ir_after_{name}.ir": text for name, text in self.ir_after.items()}
        self.build = compile_cuda(self.cuda_source, name=self.kernel.name, artifacts=artifacts,
                                  extra_key=repr(self.schedule))
        self.timings["build"] = time.perf_counter() - t0
        return self.build

    def with_ir(self, text: str, *, build: bool | None = None) -> "CompiledKernel":
        """A new kernel from edited IR text (`print(k.ir)`, a `WSCHED_PRINT_IR` dump or a per-pass
        file of the build cache, edited): parsed (IRParseError with line and column), verified
        with the load/compute contract (VerifyError located by IR line), emitted and built; this
        kernel is left as it is. The edit must keep the kernel's parameters (the call binds them
        from the fusion)."""
        from .codegen.emit import emit_kernel
        from .lowering.parser import parse_kernel
        from .lowering.verify import verify

        check_argument("text", text, str, "the IR text of a kernel")
        kernel = parse_kernel(text)
        before = [(type(p).__name__, p.name) for p in self.kernel.params]
        after = [(type(p).__name__, p.name) for p in kernel.params]
        if before != after:
            raise ScheduleError(f"the edited kernel's parameters {[n for _, n in after]} differ from "
                                f"{[n for _, n in before]}: a call binds {self.fusion.name}'s tensors and "
                                f"sizes to these; keep the parameter list (shapes, boxes and swizzles may change)")
        verify(kernel, contract=True)
        ck = CompiledKernel(self.fusion, self.schedule, self.partition, kernel, emit_kernel(kernel).source,
                            timings={})
        if build or (build is None and nvcc_available()):
            ck.compile_cuda()
        return ck

    def _plan(self, tensors, out) -> "_LaunchPlan":
        """Everything about a call that depends only on the tensors' shapes, strides, dtypes
        and devices: binding, the argument checks, output shapes, kernel views and the grid."""
        from .codegen.launch import check_tensor, sm_count
        from .lowering import ir
        from .lowering.evaluate import evaluate

        inputs, scalars, sizes = self._bind(tensors)
        device = next((t.device for t in inputs.values() if t.is_cuda), None)
        if device is None:
            if not torch.cuda.is_available():
                raise NoGPUError(f"{self.fusion.name}: no CUDA device is available here; the kernel runs on "
                                 f"a Hopper GPU (sm_90a) — run it on the CPU with .simulate(...) instead")
            device = torch.device("cuda", torch.cuda.current_device())
        outs = out if out is not None else self._outputs(sizes, device)
        views = self._kernel_views({**inputs, **outs}, scalars)
        params = []
        for p in self.kernel.params:
            if isinstance(p, ir.TensorMapParam):   # TMA: 16-byte aligned base and rows
                check_tensor(p.name, views[p.name], device=device)
                params.append(("tensor_map", p))
            elif isinstance(p, ir.GlobalParam):    # plain loads/stores: row-major, any alignment
                t = views[p.name]
                check_tensor(p.name, t, device=device, alignment=False)
                if not t.is_contiguous():
                    raise ValueError(f"argument '{p.name}' (shape {tuple(t.shape)}, strides {t.stride()}) "
                                     f"is not contiguous; the kernel reads it row-major — pass "
                                     f"{p.name}.contiguous()")
                params.append(("ptr", p))
            else:
                params.append((p.dtype, scalars[p.name]))
        view_shapes = {name: tuple(t.shape) for name, t in views.items()
                       if name in inputs or name in outs}
        out_specs = [(name, tuple(t.shape), t.dtype) for name, t in outs.items()]
        grid = max(1, evaluate(self.kernel.grid, {**scalars, "num_sms": sm_count(device)}))
        return _LaunchPlan(list(inputs), params, out_specs, view_shapes, grid, device)

    def launch_args(self, tensors, out: dict[str, torch.Tensor] | None = None):
        """(grid, launch arguments, outputs) for one call, every argument checked. The checks
        that depend only on layouts run once per layout (a cached plan); the base address of
        each TMA tensor is checked on every call. Launch them with
        `self._loaded.launch(grid, args, device=<the tensors' device>)`."""
        plan, args, outs = self._prepare(tensors, out)
        return plan.grid, args, outs

    def _prepare(self, tensors, out: dict[str, torch.Tensor] | None):
        """(plan, launch arguments, outputs) for one call; see launch_args."""
        from .codegen.tma import tensor_map_for

        if out is not None and (not isinstance(out, dict) or not all(
                isinstance(n, str) and isinstance(t, torch.Tensor) for n, t in out.items())):
            raise ArgumentError(f"{self.fusion.name}: out= takes a dict of output name -> torch.Tensor "
                                f"(names: {', '.join(self.partition.output_names)}), got {short_repr(out)}")

        key = tuple((tuple(t.shape), t.stride(), t.dtype, t.device) if isinstance(t, torch.Tensor) else None
                    for t in tensors)
        if out is not None:
            key += tuple((n, tuple(t.shape), t.stride(), t.dtype, t.device) for n, t in out.items())
        plan = self._plans.get(key) if None not in key else None
        if plan is None:
            plan = self._plan(tensors, out)
            if None not in key:
                self._plans[key] = plan
        outs = out if out is not None else {
            name: torch.empty(shape, dtype=dtype, device=plan.device) for name, shape, dtype in plan.outputs}
        by_name = dict(zip(plan.inputs, tensors))
        by_name.update(outs)
        args = []
        for binding, p in plan.params:
            if binding == "tensor_map":
                t = by_name[p.name]
                if t.data_ptr() % 16:
                    raise ValueError(f"argument '{p.name}' has data_ptr {t.data_ptr():#x}, "
                                     f"{t.data_ptr() % 16} bytes past a 16-byte boundary; TMA needs a "
                                     f"16-byte aligned base address — pass a .contiguous() copy")
                # A map encodes only address, shape, strides, box and swizzle: encode it once
                # per tensor layout (the key holds the device: a map is encoded on its device).
                # Read into a local: another thread may clear the cache meanwhile.
                map_key = (p.name, t.data_ptr(), key)
                tensor_map = self._maps.get(map_key)
                if tensor_map is None:
                    if len(self._maps) >= 256:
                        self._maps.clear()
                    view = t.view(plan.views[p.name]) if tuple(t.shape) != plan.views[p.name] else t
                    tensor_map = self._maps[map_key] = tensor_map_for(view, p.box, p.swizzle, p.name)
                args.append(("tensor_map", tensor_map))
            elif binding == "ptr":
                args.append(("ptr", by_name[p.name].data_ptr()))
            else:
                args.append((binding, p))
        return plan, args, outs

    def __call__(self, *tensors, out: dict[str, torch.Tensor] | None = None):
        if torch_ops.is_traced(tensors):   # torch.compile / export: the registered op (self.op)
            if out is not None:
                raise ArgumentError(f"{self.fusion.name}: out= is not supported while torch traces the "
                                    f"call (torch.compile, torch.export); use the returned outputs")
            return self.op(*tensors)
        return self._run(tensors, out)

    def _run(self, tensors, out: dict[str, torch.Tensor] | None = None):
        """The eager launch (`__call__` and the custom op's CUDA implementation)."""
        plan, args, outs = self._prepare(tensors, out)
        # on the tensors' device (its context, module, stream), whatever the current device is
        self._loaded.launch(plan.grid, args, device=plan.device)
        return self._result(outs)

    # -- CPU simulator -------------------------------------------------------------------
    def simulate(self, *tensors, seed: int = 0, num_sms: int = 4):
        """Run the final loop IR in the CPU simulator; outputs are poisoned with NaN first."""
        from .lowering.simulate import simulate

        check_argument("seed", seed, int, "an int (it picks the interleaving)")
        check_argument("num_sms", num_sms, int, "a positive int (CTAs resident at a time)")
        inputs, scalars, sizes = self._bind(tensors)
        outs = self._outputs(sizes, "cpu")
        if any(t.numel() == 0 for t in outs.values()):
            return self._result(outs)    # an empty output: nothing to compute (a grid of no CTAs)
        for t in outs.values():
            t.fill_(float("nan"))
        views = self._kernel_views({**inputs, **outs}, scalars)
        self._check_tma_layouts(views)
        simulate(self.kernel, {**views, **scalars}, num_sms=num_sms, seed=seed)
        return self._result(outs)

    def _check_tma_layouts(self, views: dict) -> None:
        """The GPU's TMA rules (inner stride 1, 16-byte base and row strides) on CPU tensors, so
        that what simulates also runs on the GPU as it is."""
        from .codegen.launch import check_tensor
        from .lowering import ir

        for p in self.kernel.params:
            if isinstance(p, ir.TensorMapParam):
                check_tensor(p.name, views[p.name], require_cuda=False)


class NoGPUError(RuntimeError):
    """A kernel was called on a machine without a CUDA device."""


@dataclass(frozen=True)
class _LaunchPlan:
    """A call's layout-dependent facts, computed once per argument layout (see _plan)."""

    inputs: list            # kernel parameter names of the inputs, in call order
    params: list            # per kernel param: ("tensor_map", p) | ("ptr", p) | (dtype, value)
    outputs: list           # (name, shape, torch dtype) of outputs to allocate
    views: dict             # name -> the shape the kernel reads the tensor as
    grid: int               # sized with the SM count of `device`
    device: object          # the torch.device every argument is on: the kernel runs there


def build_kernel(fusion, schedule: Schedule | None = None, *, build: bool | None = None,
                 **overrides) -> CompiledKernel:
    """Lower and emit a fusion with one schedule (given, or the workload's default with
    `overrides`); build the cubin with nvcc now if nvcc is on PATH (or `build`)."""
    from .codegen.emit import emit_kernel

    check_fusion(fusion, "ws.compile")
    check_argument("build", build, (bool, type(None)), "True (build now), False (do not) or None (build if "
                   "nvcc is on PATH)")
    sched = schedule_for(fusion, schedule, **overrides)
    t0 = time.perf_counter()
    part = partition(fusion, sched)
    kernel = lower_partition(part)
    t1 = time.perf_counter()
    emitted = emit_kernel(kernel)
    t2 = time.perf_counter()
    ck = CompiledKernel(fusion, sched, part, kernel, emitted.source,
                        timings={"lower": t1 - t0, "emit": t2 - t1})
    if build or (build is None and nvcc_available()):
        ck.compile_cuda()
    return ck
