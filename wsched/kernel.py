"""A fusion compiled with one schedule: fusion -> schedule -> partition -> loop IR -> CUDA ->
cubin -> launch (`build_kernel`), and the `CompiledKernel` that runs it on the GPU or in the CPU
simulator. `wsched/api.py` puts the public `ws.compile` (with the autotuner) on top of it."""

from __future__ import annotations

import threading
import time
import warnings
from dataclasses import dataclass, field
from functools import cached_property

import torch
from cuda.bindings import driver

from .codegen import native
from .codegen.launch import PackedArguments, TmaLayoutError, check_base_alignment
from .codegen.nvcc import BuildError, nvcc_available
from .errors import ArgumentError, FusionError, check_argument, short_repr
from .fusion import check_fusion
from .lowering import ir
from .codegen.block_spans import SpansLaunch
from .lowering.pipeline import lower_partition
from .partition import Partition, param_name
from .schedule import Schedule, ScheduleError, check_schedule
from . import knobs, torch_ops
from .target import TMA_GLOBAL_ADDRESS_ALIGNMENT, TORCH_DTYPES
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
    _plans: dict = field(default_factory=dict, repr=False)  # launch plans (or TmaLayoutErrors) by argument layouts
    _workspaces: dict = field(default_factory=dict, repr=False)  # (name, device) -> scratch tensors
    _natives: dict = field(default_factory=dict, repr=False)  # out= names (None: none) -> native Launcher
    _held_tables: list = field(default_factory=list, repr=False)  # launch_args' spans tables, the last 8 calls'
    _staging_warned: set = field(default_factory=set, repr=False)  # layouts _run_staged has warned about

    def __post_init__(self):
        self._check_values = knobs.check_values()
        # the native launch path (codegen/native.py), off where every call checks input values
        self._native = native.available() and not self._check_values
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
    def _bind_inputs(self, tensors) -> tuple[dict, dict, dict]:
        """(inputs by name, scalar params, sizes) for one call; FusionError on bad inputs."""
        sizes = self.fusion.bind_tensors(self.fusion.name, tensors)
        by_id = {node.id: t for node, t in zip(self.fusion.inputs, tensors)}
        scalars = {dim: int(by_id[name].shape[axis]) for dim, (name, axis) in self.partition.dims.items()}
        inputs = {param_name(i): t for i, t in by_id.items()}
        empty = [dim for dim in self.partition.nonempty if scalars.get(dim, 1) < 1]
        if empty:
            name, axis = self.partition.dims[empty[0]]
            where = "" if name == empty[0] else f" ({name} dim {axis})"
            raise FusionError(self.fusion.name, f"{empty[0]} is 0{where}; the kernel needs at least one element there")
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
            if not isinstance(p, (ir.GlobalParam, ir.TensorMapParam)) or p.name not in views:
                continue
            t = views[p.name]
            shape = [evaluate(e, scalars) for e in p.shape]
            if list(t.shape) == shape:
                continue
            try:
                views[p.name] = t.view(shape)
            except RuntimeError:
                # GQA packing reads [..., G, S, D] as [..., G * S, D]: G and S must be one run of rows
                raise ArgumentError(f"{self.fusion.name}: argument '{p.name}' (shape {list(t.shape)}, strides "
                                    f"{list(t.stride())}) cannot be read as {shape} without a copy; the kernel "
                                    f"reads it so ({p.name}: {'x'.join(map(str, shape))}) — pass "
                                    f"{p.name}.contiguous()") from None
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

    def _grid_sms(self, device) -> int:
        """The `num_sms` a persistent grid is sized by: the device's SMs, or for a cluster kernel
        the SMs its clusters can hold at once (`LoadedKernel.cluster_sms`)."""
        from .codegen.launch import device_index, sm_count

        size = self.kernel.cluster[0]
        if size == 1:
            return sm_count(device)
        return self._loaded.cluster_sms(device_index(device), size)

    def compile_cuda(self):
        """Build the cubin with nvcc (through the on-disk cache)."""
        from .codegen.build import compile_cuda

        t0 = time.perf_counter()
        artifacts = {f"ir_after_{name}.ir": text for name, text in self.ir_after.items()}
        try:
            self.build = compile_cuda(self.cuda_source, name=self.kernel.name, artifacts=artifacts,
                                      extra_key=repr(self.schedule))
        except BuildError as error:
            if not error.spills:
                raise
            raise BuildError(self._spill_message(error), cu_path=error.cu_path, command=error.command,
                             log=error.log, kernel=error.kernel, spills=True) from None
        self.timings["build"] = time.perf_counter() - t0
        return self.build

    def _spill_message(self, error: BuildError) -> str:
        """ptxas's spill report with what the caller of ws.compile can do about it (ptxas's own
        report offers allow_spills, which ws.compile does not take); the byte counts stay on the
        second line, where the autotuner's short reasons keep them."""
        head = (f"register spills in {self.kernel.name!r} with the schedule {self.schedule.short()} (spills are "
                f"build errors; fewer keys or columns per tile, or mma_inflight=0, need fewer registers, and "
                f"ws.compile without a schedule tries such schedules itself):")
        return "\n".join([head] + str(error).splitlines()[1:])

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
        and devices: binding, the argument checks, output shapes, kernel views, the grid and the
        kernel's argument list (scalar values set here; data pointers and tensor maps per call)."""
        from .codegen.launch import _grid3, check_tensor
        from .lowering import ir
        from .lowering.evaluate import evaluate

        inputs, scalars, sizes = self._bind_inputs(tensors)
        device = next((t.device for t in inputs.values() if t.is_cuda), None)
        if device is None:
            if not torch.cuda.is_available():
                raise NoGPUError(f"{self.fusion.name}: no CUDA device is available here; the kernel runs on "
                                 f"a Hopper GPU (sm_90a) — run it on the CPU with .simulate(...) instead")
            device = torch.device("cuda", torch.cuda.current_device())
        outs = out if out is not None else self._outputs(sizes, device)
        views = self._kernel_views({**inputs, **outs}, scalars)
        num_sms = self._grid_sms(device)
        scalars = self._host_params(scalars, num_sms)   # split-K: host params from the sizes
        params, span_shapes = [], {}
        for p in self.kernel.params:
            if isinstance(p, ir.WorkspaceParam):   # split-K scratch: kept by this kernel, a fixed pointer
                params.append(("ptr", self._workspace(p, scalars, device).data_ptr()))
            elif isinstance(p, ir.SpanParam):        # computed per call from its id inputs
                params.append(("ptr", p))
                span_shapes[p.name] = tuple(evaluate(d, scalars) for d in p.shape)
            elif isinstance(p, ir.TensorMapParam):   # TMA: 16-byte aligned base and rows
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
            else:                                  # a scalar: a size bound from the shapes
                params.append((p.dtype, scalars[p.name]))
        # params: ("tensor_map" | "ptr", p) for the call's tensor named p.name, set per call;
        # (type, value) for a value the layout fixes (a size, anything computed from the sizes)
        view_shapes = {name: tuple(t.shape) for name, t in views.items()
                       if name in inputs or name in outs}
        view_shapes.update(span_shapes)
        out_specs = [(name, tuple(t.shape), t.dtype) for name, t in outs.items()]
        grid = max(1, evaluate(self.kernel.grid, {**scalars, "num_sms": num_sms}))
        _grid3(grid)   # within the CUDA limit: the eager launch does not check it again
        return _LaunchPlan(list(inputs), params, out_specs, view_shapes, grid, device)

    def _prepare(self, tensors, out: dict[str, torch.Tensor] | None, private: bool = False):
        """(plan, packed arguments, output tensors) for one call, every argument checked: the checks that
        depend only on layouts once per layout (the cached plan), the base address of each TMA
        tensor on every call. The packed arguments are this thread's buffer of the plan (valid
        until the thread's next call of that layout), or a buffer of the caller's own if `private`."""
        key = []   # every argument's layout; None if one is not a tensor (the plan says which)
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                key = None
                break
            key += (t.shape, t.stride(), t.dtype, t.device)
        if out is not None:
            for name, t in out.items() if isinstance(out, dict) else [(None, out)]:
                if not (isinstance(name, str) and isinstance(t, torch.Tensor)):
                    raise ArgumentError(f"{self.fusion.name}: out= takes a dict of output name -> torch.Tensor "
                                        f"(names: {', '.join(self.partition.output_names)}), got {short_repr(out)}")
                if key is not None:
                    key += (name, t.shape, t.stride(), t.dtype, t.device)
        if key is None:
            plan = self._plan(tensors, out)
        else:
            key = tuple(key)
            plan = self._plans.get(key)
            if plan is None:
                try:
                    plan = self._plans[key] = self._plan(tensors, out)
                except TmaLayoutError as error:   # kept: the next call of the layout is staged at once
                    if not error.address:          # (a misaligned base is this call's alone)
                        self._plans[key] = error
                    raise
            elif isinstance(plan, TmaLayoutError):
                raise plan.with_traceback(None)
            plan.calls += 1
        if self._check_values:   # WSCHED_CHECK_INPUTS=1
            self.partition.workload.check_values(self.partition, dict(zip(plan.inputs, tensors)))
        outputs = plan.allocate_outputs() if out is None else tuple(out.values())
        return plan, plan.pack((*tensors, *outputs), private), outputs

    def bind(self, *tensors, out: dict[str, torch.Tensor] | None = None) -> "BoundCall":
        """The call `k(*tensors, out=out)` with its arguments checked and packed and its outputs
        allocated once: `bound()` launches it again on the same tensors (no checks, no packing,
        no allocation; a kernel with a spans table, a document mask's, computes the table again
        first: one launch of its helper) and returns the outputs. For timing the kernel alone and
        for loops that refill the same buffers; the tensors must stay where they are while it is
        in use."""
        plan, packed, outputs = self._prepare(tensors, out, private=True)
        return BoundCall(self, plan, packed, tensors, out if out is not None else plan.by_name(outputs))

    # -- host params and workspaces (split-K) ----------------------------------------------
    def _host_params(self, scalars: dict, num_sms: int) -> dict:
        """`scalars` with every host param's value for this call (in parameter order: one may
        read those before it), computed like the grid from the sizes and the SM count."""
        from .lowering import ir
        from .lowering.evaluate import evaluate

        out = dict(scalars)
        for p in self.kernel.params:
            if isinstance(p, ir.HostParam):
                out[p.name] = evaluate(p.value, {**out, "num_sms": num_sms})
        return out

    def _workspace(self, p, scalars: dict, device) -> torch.Tensor:
        """The scratch tensor of workspace param `p` on `device`, at least as large as this call
        needs: allocated once and kept, replaced by a larger one when a call needs more (the old
        one stays alive: plans made before hold its address). `zeroed` ones start at zero and
        the kernel leaves them so. Two launches of this kernel that run at the same time (on
        two streams) would share it: a kernel with workspaces runs one launch at a time per
        device."""
        from .lowering.evaluate import evaluate

        numel = 1
        for d in p.storage_dims([evaluate(d, scalars) for d in p.shape]):
            numel *= max(1, d)
        held = self._workspaces.setdefault((p.name, device), [])
        if not held or held[-1].numel() < numel:
            dtype = TORCH_DTYPES[p.dtype]
            held.append(torch.zeros(numel, dtype=dtype, device=device) if p.zeroed
                        else torch.empty(numel, dtype=dtype, device=device))
        return held[-1]

    def launch_args(self, tensors, out: dict[str, torch.Tensor] | None = None):
        """(grid, launch arguments as (type, value) pairs, outputs) for one call, every argument
        checked: for launching the kernel's arguments with more of one's own (the timeline's
        traced build appends its record buffer) through `LoadedKernel.launch(grid, args,
        device=<the tensors' device>)`. A plain call or a repeated launch: `k(...)`, `k.bind(...)`."""
        plan, packed, outputs = self._prepare(tensors, out, private=True)
        # the call's spans tables, alive until 8 more calls (the caller launches right after)
        self._held_tables = [getattr(packed, "held", None)] + self._held_tables[:7]
        return plan.grid, packed.pairs(), out if out is not None else plan.by_name(outputs)

    def __call__(self, *tensors, out: dict[str, torch.Tensor] | None = None):
        if not torch.compiler.is_compiling():   # a layout planned before: launched from C
            result = native.call(self, tensors, out)
            if result is not None:
                return result
        if torch_ops.is_traced(tensors):   # torch.compile / export: the registered op (self.op)
            if out is not None:
                raise ArgumentError(f"{self.fusion.name}: out= is not supported while torch traces the "
                                    f"call (torch.compile, torch.export); use the returned outputs")
            return self.op(*tensors)
        return self._run(tensors, out)

    def _run(self, tensors, out: dict[str, torch.Tensor] | None = None, natives: dict | None = None):
        """The eager launch (`__call__` and the custom op's CUDA implementation). A layout seen
        twice is then handed to the native launchers `natives` (default: this kernel's), so that
        its next call is launched from C."""
        try:
            plan, packed, outputs = self._prepare(tensors, out)
        except TmaLayoutError:
            return self._run_staged(tensors, out)
        # on the tensors' device (its context, module, stream), whatever the current device is
        self._loaded.launch_packed(plan.grid, packed, plan.device_index)
        if plan.calls >= 2 and self._native:   # a layout used once (a decode step's T) is not worth a plan
            try:
                self._install(self._natives if natives is None else natives, plan, packed, (*tensors, *outputs),
                              out)
            except Exception as error:   # never fail a call that has launched: run it from Python from now on
                self._native = False
                warnings.warn(f"{self.fusion.name}: the native launch path is off for this kernel "
                              f"({type(error).__name__}: {error}); calls take the Python path", stacklevel=3)
        return outputs[0] if len(outputs) == 1 else outputs

    def _tma_staging(self, inputs: dict, outs: dict) -> dict:
        """The aligned stand-ins of the tensors TMA cannot address as they are (tma_ready): a
        copy of each such input, an empty buffer for each such output (rows padded to 16 bytes:
        a vocabulary of 50257 columns, an odd K, a transposed view), by parameter name."""
        from .codegen.launch import tma_aligned_empty, tma_ready
        from .lowering import ir

        staged: dict[str, torch.Tensor] = {}
        for p in self.kernel.params:
            if isinstance(p, ir.TensorMapParam):
                t = inputs.get(p.name, outs.get(p.name))
                if t is not None and not tma_ready(t):
                    staged[p.name] = tma_aligned_empty(t)
                    if p.name in inputs:
                        staged[p.name].copy_(t)
        return staged

    def _run_staged(self, tensors, out: dict[str, torch.Tensor] | None):
        """A call with a tensor TMA cannot address as it is: each such input copied into an
        aligned buffer, each such output computed into one and then copied into the output (a
        warning, once per layout, names them and the copies' cost). Never planned for the
        native path: every such call comes here."""
        from .codegen.launch import tma_layout_problem

        inputs, _, sizes = self._bind_inputs(tensors)
        device = next((t.device for t in inputs.values() if t.is_cuda), None)
        outs = dict(out) if out is not None else self._outputs(sizes, device)
        staged = self._tma_staging(inputs, outs)
        if not staged:   # the error came from elsewhere (not a TMA layout): let the plan raise it
            self._prepare(tensors, out)
        given = {**inputs, **outs}
        problems = {n: tma_layout_problem(given[n]) for n in staged}
        key = tuple((n, tuple(given[n].shape), problems[n]) for n in staged)
        if key not in self._staging_warned:
            self._staging_warned.add(key)
            described = "; ".join(f"'{n}' {tuple(given[n].shape)}: {problems[n]}" for n in staged)
            warnings.warn(f"{self.fusion.name}: {described} — copied to (outputs: from) a TMA-aligned buffer on "
                          f"every call (TMA reads rows of a multiple of 16 bytes from a 16-byte aligned base, "
                          f"innermost stride 1); pass tensors laid out so (the last dim padded in memory to a "
                          f"multiple of 16 bytes, .contiguous() for a transposed view or a shifted base) to run "
                          f"without the copies", stacklevel=3)
        kernel_inputs = tuple(staged.get(name, t) for name, t in inputs.items())
        kernel_outs = {name: staged.get(name, t) for name, t in outs.items()}
        plan, packed, _ = self._prepare(kernel_inputs, kernel_outs)
        self._loaded.launch_packed(plan.grid, packed, plan.device_index)
        for name, t in outs.items():
            if name in staged:
                t.copy_(staged[name])
        outputs = tuple(outs.values())
        return outputs[0] if len(outputs) == 1 else outputs

    def _install(self, natives: dict, plan: "_LaunchPlan", packed: PackedArguments, tensors: tuple, out) -> None:
        """Give the native launcher of `out`'s names the plan of this call, unless it holds it
        (a plan it dropped for newer ones is given again)."""
        from .codegen.cuda_driver import _primary_handles

        loaded = self._loaded
        function, context = loaded._functions.get(plan.device_index), _primary_handles.get(plan.device_index)
        tables = len(plan.span_slots)
        if (function is None or context is None or len(tensors) + tables > native.MAX_TENSORS
                or tables > native.MAX_PRE or any(launch.ctas == 0 for launch in plan.span_launches.values())):
            return   # not launched through the primary context yet, more tensors or spans tables than a
            # plan takes, or a spans table of no rows or keys (zeroed on the host, not computed)
        key = None if out is None else tuple(out)
        launcher = natives.get(key)
        if launcher is None:
            launcher = natives[key] = native.launcher()
        held = plan.native.get(id(launcher))
        if held is not None and launcher.holds(held):
            return
        n_alloc = 0 if out is not None else len(plan.outputs)
        held = plan.native[id(launcher)] = native.plan(plan, packed, tensors, n_alloc, int(function), context,
                                                      loaded.threads, loaded.smem_bytes)
        launcher.add(held)

    def synchronize(self, device: object = None) -> None:
        """Wait for the kernel's launches on `device` (default: every device it ran on); raise
        CudaError if it faulted (a fault leaves the context unusable: for tests and debugging)."""
        self._loaded.last_error_check(device)

    # -- CPU simulator -------------------------------------------------------------------
    def simulate(self, *tensors, seed: int = 0, num_sms: int = 4):
        """Run the final loop IR in the CPU simulator; outputs are poisoned with NaN first."""
        from .lowering.simulate import simulate

        check_argument("seed", seed, int, "an int (it picks the interleaving)")
        check_argument("num_sms", num_sms, int, "a positive int (CTAs resident at a time)")
        inputs, scalars, sizes = self._bind_inputs(tensors)
        for name, t in inputs.items():   # before the values are read (a meta tensor has none)
            if t.device.type != "cpu":
                raise ArgumentError(f"{self.fusion.name}.simulate: argument '{name}' is on {t.device}; the simulator "
                                    f"runs on CPU tensors with values (pass {name}.cpu(), or a CPU tensor for a "
                                    f"meta one)")
        self.partition.workload.check_values(self.partition, inputs)
        outs = self._outputs(sizes, "cpu")
        if any(t.numel() == 0 for t in outs.values()):
            return self._result(outs)    # an empty output: nothing to compute (a grid of no CTAs)
        for t in outs.values():
            t.fill_(float("nan"))
        staged = self._tma_staging(inputs, outs)   # as a GPU call stages them (_run_staged)
        for name, t in staged.items():
            if name in outs:
                t.fill_(float("nan"))
        views = self._kernel_views({**inputs, **outs, **staged}, scalars)
        self._check_tma_layouts(views)
        simulate(self.kernel, {**views, **scalars}, num_sms=num_sms, seed=seed)
        for name, t in outs.items():
            if name in staged:
                t.copy_(staged[name])
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


class _LaunchPlan:
    """A call's layout-dependent facts, computed once per argument layout (see
    CompiledKernel._plan), and the per-call work on top of them: allocate the outputs, then set
    each data pointer and tensor map in packed arguments whose scalars are already in place."""

    def __init__(self, inputs: list, params: list, outputs: list, views: dict, grid: int, device):
        self.inputs = inputs      # kernel parameter names of the inputs, in call order
        self.params = params      # per kernel param: ("tensor_map" | "ptr", p) | (type, fixed value)
        self.outputs = outputs    # (name, shape, torch dtype) of the outputs, in the call's order
        self.views = views        # name -> the shape the kernel reads the tensor as
        self.grid = grid          # sized with the SM count of `device`
        self.device = device      # the torch.device every argument is on: the kernel runs there
        self.device_index = device.index
        self.calls = 0            # calls of the layout (a plan cached by the kernel counts them)
        self.native = {}          # id of a native launcher -> the native Plan of this layout given it
        # A param with a value fixed for the layout is packed once, in the template; one that
        # names a tensor of the call is set per call from its place in (*inputs, *outputs).
        where = {name: i for i, name in enumerate([*inputs, *(name for name, _, _ in outputs)])}
        per_call = [(i, arg_type, p) for i, (arg_type, p) in enumerate(params)
                    if not isinstance(p, (int, float))]
        self.pointer_slots = tuple((i, where[p.name]) for i, arg_type, p in per_call
                                   if arg_type == "ptr" and not isinstance(p, ir.SpanParam))
        # a spans table (ir.SpanParam): computed per call from its id inputs, on the call's stream
        self.span_slots = tuple((i, where[p.query], where[p.key], p) for i, arg_type, p in per_call
                                if isinstance(p, ir.SpanParam))
        self.span_launches: dict = {}   # position -> its codegen.block_spans.SpansLaunch
        # with each map param, its maps encoded so far by data address
        self.map_slots = tuple((i, where[p.name], p, {}) for i, arg_type, p in per_call
                               if arg_type == "tensor_map")
        blank = {"tensor_map": driver.CUtensorMap(), "ptr": 0}
        self.template = PackedArguments([(arg_type, value if isinstance(value, (int, float)) else blank[arg_type])
                                         for arg_type, value in params])
        self._thread = threading.local()   # each thread's own packed arguments

    def allocate_outputs(self) -> tuple[torch.Tensor, ...]:
        return tuple([torch.empty(shape, dtype=dtype, device=self.device) for _, shape, dtype in self.outputs])

    def by_name(self, outputs: tuple) -> dict[str, torch.Tensor]:
        return {name: t for (name, _, _), t in zip(self.outputs, outputs)}

    def pack(self, tensors: tuple, private: bool = False) -> PackedArguments:
        """This thread's packed arguments (a new buffer if `private`) with the data pointers and
        tensor maps of `tensors` (*inputs, *outputs); ValueError if a TMA tensor's base is not
        16-byte aligned."""
        packed = None if private else getattr(self._thread, "packed", None)
        if packed is None:
            packed = self.template.copy()
            if not private:
                self._thread.packed = packed
        for position, source in self.pointer_slots:
            packed.set_pointer(position, tensors[source].data_ptr())
        if self.span_slots:
            self.pack_spans(packed, tensors)
        for position, source, p, maps in self.map_slots:
            data_ptr = tensors[source].data_ptr()
            if data_ptr % TMA_GLOBAL_ADDRESS_ALIGNMENT:
                check_base_alignment(p.name, data_ptr)
            # A map encodes only address, shape, strides, box and swizzle, and the plan fixes all
            # but the address: encode once per (parameter, address). Read into a local: another
            # thread may clear the cache meanwhile.
            tensor_map = maps.get(data_ptr)
            if tensor_map is None:
                tensor_map = self._encode(maps, tensors[source], p)
            packed.set_tensor_map(position, tensor_map)
        return packed

    def pack_spans(self, packed: PackedArguments, tensors: tuple) -> None:
        """Compute each spans table from this call's id inputs (one launch of the helper kernel,
        codegen/block_spans.py) and point `packed` at it. The
        tables live as long as `packed` does (until its next call): a launch enqueued before
        that reads them, and torch's allocator reuses their memory only after the launch on
        this stream."""
        tables = []
        for position, query, key, p in self.span_slots:
            ids = [tensors[source].view(self.views[name]) for source, name in ((query, p.query), (key, p.key))]
            launch = self.span_launches.get(position)
            if launch is None:   # the layout's launch, packed once (the plan fixes the ids' layout)
                launch = self.span_launches[position] = SpansLaunch(*ids, p.rows, p.cols, self.views[p.name])
            tables.append(launch(*ids))
            packed.set_pointer(position, tables[-1].data_ptr())
        packed.held = tables

    def _encode(self, maps: dict, tensor: torch.Tensor, p) -> driver.CUtensorMap:
        from .codegen.tma import tensor_map_for

        if len(maps) >= 64:   # a bound on maps of addresses long gone
            maps.clear()
        shape = self.views[p.name]
        view = tensor.view(shape) if tuple(tensor.shape) != shape else tensor
        tensor_map = maps[tensor.data_ptr()] = tensor_map_for(view, p.box, p.swizzle, p.name)
        return tensor_map


class BoundCall:
    """One call of a compiled kernel with its arguments bound (`CompiledKernel.bind`): calling it
    launches the kernel again on the same tensors, into the same outputs, on torch's current
    stream of their device, and returns the outputs as the kernel's call does."""

    def __init__(self, kernel: CompiledKernel, plan: _LaunchPlan, packed: PackedArguments, tensors, outputs):
        self.kernel = kernel
        self.grid = plan.grid
        self.device = plan.device
        self.outputs = outputs          # output name -> tensor, filled by each launch
        self._tensors = tensors         # kept alive: the packed arguments hold their addresses
        self._packed = packed
        self._plan = plan
        self._launch = kernel._loaded.launch_packed
        self._index = plan.device_index
        self._result = kernel._result(outputs)

    def __call__(self):
        if self._plan.span_slots:   # tables from the ids as they are now (a loop may refill them)
            self._plan.pack_spans(self._packed, self._tensors)
        self._launch(self.grid, self._packed, self._index)
        return self._result

    def synchronize(self) -> None:
        """Wait for the launches on the tensors' device; CudaError if the kernel faulted."""
        self.kernel.synchronize(self.device)


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


def build_without_spills(fusion, schedule: Schedule, *, build: bool | None = None) -> CompiledKernel:
    """A schedule the compiler picked (the default, a per-call variant) built, or where ptxas
    spills registers, the first of the workload's lighter schedules (`Workload.lighter`) that
    builds without: a spill is an error only when every one of them spills (the error names each).
    Without a build (`build=False`, no nvcc) nothing can spill: the schedule is kept."""
    try:
        return build_kernel(fusion, schedule, build=build)
    except BuildError as error:
        if not error.spills:
            raise
        first = error
    spilled = [(schedule, first)]
    for candidate in workload_for(fusion).lighter(fusion, schedule):
        try:
            return build_kernel(fusion, candidate, build=build)
        except BuildError as error:
            if not error.spills:
                raise BuildError(f"{fusion.name}: the schedule {schedule.short()} spilled registers, and building "
                                 f"the lighter {candidate.short()} instead failed: {error}", cu_path=error.cu_path,
                                 command=error.command, log=error.log, kernel=error.kernel) from error
            spilled.append((candidate, error))
    lines = [f"{fusion.name}: the schedule the compiler picked and each lighter one spill registers (spills are "
             f"build errors); pass a schedule of your own:"]
    lines += [f"  {s.short()}: {str(e).splitlines()[1].strip() if len(str(e).splitlines()) > 1 else e}"
              for s, e in spilled]
    raise BuildError("\n".join(lines), cu_path=first.cu_path, command=first.command, log=first.log,
                     kernel=first.kernel, spills=True) from first
