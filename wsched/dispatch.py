"""Per-shape choice among a workload's default schedules.

A schedule is fixed when a kernel is compiled, but the sizes (M of a matmul) are not: the best
schedule for M = 16 is not the best for M = 8192. A workload whose default depends on the shape
names, beside its default schedule, `variants(fusion, schedule)`: other schedules, each with the
rule that picks it from a call's sizes and the GPU's SM count. `ws.compile(fusion)` without a schedule or
overrides returns a `ShapeDispatchKernel` when there are variants:

    k = ws.compile(linear)      # default schedule + the variants its workload names
    y = k(x, w)                 # the kernel this shape and GPU pick (decided once per layout)
    k.kernel_for(x, w)          # which one that is
    k.ir, k.cuda_source         # the default schedule's (see k.kernels for every built one)

A variant is lowered, emitted and built when a call first needs it. The object is one torch
custom op (`k.op`) whose CUDA implementation makes the choice when it runs, so torch.compile and
torch.export keep it. Everything else a `CompiledKernel` has (`ir`, `cuda_source`, `schedule`,
`with_ir`, ...) is the default schedule's kernel's; a schedule or overrides passed to `ws.compile` give one `CompiledKernel` as
before (no dispatch).
"""

from __future__ import annotations

import threading
import warnings
from dataclasses import dataclass
from typing import Callable, Mapping

import torch

from . import torch_ops
from .codegen import native
from .errors import ArgumentError
from .schedule import Schedule


# The value a variant's rule reads beside the sizes and `num_sms`: the row alignment in bytes (a
# power of two up to 128, `codegen.tma.row_alignment`) of the operands the kernel loads by TMA, the
# least of them (rows off a 64-byte boundary load slower: target.TMA_FAST_ROW_ALIGNMENT).
ROW_ALIGN = "tma_row_align"


def row_align(partition, layouts: Mapping[str, tuple]) -> int:
    """ROW_ALIGN of a call: `layouts` maps input param names to (shape, strides, element bytes);
    the operands the partition's channels load count (the dispatch and the autotuner's
    `default_choice` both read it here)."""
    from .codegen.tma import row_alignment

    loaded = {load.tensor for channel in partition.channels for load in channel.loads}
    return min((row_alignment(*layouts[name]) for name in loaded if name in layouts), default=128)


@dataclass(frozen=True)
class Variant:
    """A schedule a call switches to, and when: `applies(values)` with values = the call's
    scalar params (the sizes, e.g. M, N, K), `num_sms` and ROW_ALIGN."""

    schedule: Schedule
    applies: Callable[[Mapping[str, int]], bool]
    rule: str                      # the rule in words (docs, `describe`)


# The largest TMA-stored output of unaligned rows that the per-shape choice stores with plain
# stores instead of staging it (ShapeDispatchKernel._unstaged). Plain stores of such rows go an
# element at a time, and a staged call pays the Python path and a copy of the output: on an H100
# (nk, K 768 / 4096) plain stores won at 1.6 and 8 MB (16x50257: 35 against 7 TFLOP/s; 4096x1001:
# 375 against 228) and lost at 206-823 MB (2048 and 8192 x 50257: 169-175 against 274-307).
DIRECT_STORE_MAX_BYTES = 64 << 20


class ShapeDispatchKernel:
    """The default kernel of a fusion plus variants chosen per call by shape and SM count."""

    def __init__(self, primary, variants: tuple[Variant, ...], *, build: bool | None = None):
        self.primary = primary
        self.variants = tuple(variants)
        self._build = build
        self._built: dict[int, object] = {}          # variant index -> CompiledKernel
        self._choice: dict[tuple, object] = {}       # layout key -> CompiledKernel
        self._lock = threading.Lock()
        self._failed: dict[int, Exception] = {}        # variant index -> its build error (built once)
        self._natives: dict = {}   # out= names -> native Launcher: plans of every kernel chosen
        self._direct: dict = {}    # schedule -> its kernel with plain stores (_unstaged)
        self._failed_direct: dict = {}   # schedule -> why that kernel did not build
        self.op = torch_ops.register(self)             # registered now: torch.compile cannot trace it

    # -- choice -------------------------------------------------------------------------------
    def _variant_kernel(self, index: int):
        kernel = self._built.get(index)
        if kernel is None:
            from .kernel import build_without_spills

            with self._lock:   # one build per variant, also for threads that waited here
                kernel = self._built.get(index)
                if kernel is None:
                    if index in self._failed:
                        raise self._failed[index]
                    schedule = self.variants[index].schedule
                    # two rules of one schedule share its kernel (built once)
                    kernel = next((k for i, k in self._built.items() if self.variants[i].schedule == schedule), None)
                    try:
                        kernel = self._built[index] = kernel or build_without_spills(
                            self.primary.fusion, schedule, build=self._build)
                    except Exception as error:   # every rule of this schedule is dropped with it
                        for i, variant in enumerate(self.variants):
                            if variant.schedule == schedule:
                                self._failed[i] = error
                        raise
        return kernel

    def _unstaged(self, kernel, tensors):
        """`kernel`, or, where one of its TMA-stored outputs would be staged at these sizes (rows
        of no multiple of 16 bytes: a vocabulary of 50257 columns) and is at most
        DIRECT_STORE_MAX_BYTES, its schedule with plain stores (epilogue="direct", which takes
        any row length): no copy of the output, and calls stay eligible for the native path.
        `kernel` where that schedule does not build."""
        from dataclasses import replace

        from .codegen.launch import tma_layout_problem
        from .kernel import build_without_spills
        from .lowering import ir

        if getattr(kernel.schedule, "epilogue", "direct") == "direct":
            return kernel
        _, _, sizes = kernel._bind_inputs(tensors)
        stored = {p.name for p in kernel.kernel.params if isinstance(p, ir.TensorMapParam)}
        outputs = [t for name, t in kernel._outputs(sizes, "meta").items() if name in stored]
        if (not any(tma_layout_problem(t) is not None for t in outputs)
                or sum(t.numel() * t.element_size() for t in outputs) > DIRECT_STORE_MAX_BYTES):
            return kernel
        schedule = replace(kernel.schedule, epilogue="direct")
        with self._lock:
            direct = self._direct.get(schedule)
            if direct is None and schedule not in self._failed_direct:
                try:
                    direct = self._direct[schedule] = build_without_spills(self.primary.fusion, schedule,
                                                                           build=self._build)
                except Exception as error:   # the staged call serves it (a copy of the output)
                    self._failed_direct[schedule] = error
        return direct or kernel

    @property
    def dropped(self) -> dict[int, str]:
        """Variant index -> why it did not build (it is not used)."""
        return {index: f"{type(error).__name__}: {error}" for index, error in self._failed.items()}

    def choose(self, tensors, num_sms: int):
        """The kernel a call with `tensors` runs on a GPU of `num_sms` SMs: the first variant whose
        rule holds for the call's sizes, else the default. A variant is built without spills
        (`kernel.build_without_spills`: a lighter schedule where its own spills); one that still
        fails to build is dropped with a warning and the next one is tried."""
        inputs, scalars, _ = self.primary._bind_inputs(tensors)
        layouts = {name: (t.shape, t.stride(), t.element_size()) for name, t in inputs.items()}
        values = {**scalars, "num_sms": num_sms, ROW_ALIGN: row_align(self.primary.partition, layouts)}
        for index, variant in enumerate(self.variants):
            if index in self._failed or not variant.applies(values):
                continue
            try:
                return self._variant_kernel(index)
            except Exception as error:  # a build failure (kept in _failed): the other kernels serve the call
                warnings.warn(f"{self.primary.fusion.name}: the {variant.schedule.short()} kernel for "
                              f"{variant.rule} did not build and is not used ({type(error).__name__}: {error})",
                              stacklevel=3)
        return self.primary

    @staticmethod
    def _key(tensors) -> tuple:
        """What the choice depends on: the shapes, the strides (ROW_ALIGN) and the device
        (AttributeError if an argument is not a tensor)."""
        return tuple([(t.shape, t.stride()) for t in tensors]), tensors[0].get_device()

    def kernel_for(self, *tensors):
        """The kernel that runs a call with these tensors on their GPU (decided once per shape
        and device)."""
        from .codegen.launch import sm_count

        try:
            key = self._key(tensors)
        except (AttributeError, IndexError):
            return self.primary              # the primary names the bad argument
        kernel = self._choice.get(key)
        if kernel is None:
            device = next((t.device for t in tensors if t.is_cuda), None)
            if device is None:
                return self.primary          # the primary raises the no-GPU / bad-argument error
            kernel = self._unstaged(self.choose(tensors, sm_count(device)), tensors)
            if len(self._choice) >= 256:
                self._choice.clear()
            self._choice[key] = kernel
        return kernel

    # -- calls --------------------------------------------------------------------------------
    def __call__(self, *tensors, out=None):
        if not torch.compiler.is_compiling():   # a layout planned before: launched from C
            result = native.call(self, tensors, out)
            if result is not None:
                return result
        if torch_ops.is_traced(tensors):
            # torch.compile / export: this object's op, whose CUDA implementation makes the choice
            # when the graph runs (tracing never builds a kernel, and a dynamic M stays dynamic).
            if out is not None:
                raise ArgumentError(f"{self.primary.fusion.name}: out= is not supported while torch traces "
                                    f"the call (torch.compile, torch.export); use the returned outputs")
            return self.op(*tensors)
        try:   # the eager hot path: one dict lookup
            kernel = self._choice[self._key(tensors)]
        except (KeyError, AttributeError, IndexError):
            kernel = self.kernel_for(*tensors)
        return kernel._run(tensors, out, self._natives)

    def _run(self, tensors, out=None):
        """The eager call (also the custom op's CUDA implementation)."""
        return self.kernel_for(*tensors)._run(tensors, out, self._natives)

    def bind(self, *tensors, out=None):
        return self.kernel_for(*tensors).bind(*tensors, out=out)

    def simulate(self, *tensors, seed: int = 0, num_sms: int = 4):
        """The kernel a GPU of `num_sms` SMs would pick, run on the simulator."""
        if not isinstance(num_sms, int) or isinstance(num_sms, bool) or num_sms < 1:
            return self.primary.simulate(*tensors, seed=seed, num_sms=num_sms)   # it names the mistake
        return self._unstaged(self.choose(tensors, num_sms), tensors).simulate(*tensors, seed=seed, num_sms=num_sms)

    def synchronize(self, device: object = None) -> None:
        """Wait for the launches of every kernel that ran; CudaError if one faulted."""
        for kernel in self.kernels:
            if "_loaded" in kernel.__dict__:      # launched (or loaded) at least once
                kernel.synchronize(device)

    @property
    def kernels(self) -> list:
        """The default kernel and every variant built so far."""
        return [self.primary] + list({id(k): k for k in (self._built[i] for i in sorted(self._built))}.values())

    def describe(self) -> str:
        lines = [f"{self.primary.fusion.name}: {self.primary.schedule.short()} (default)"]
        # a variant built is shown as built (a lighter schedule where its own spilled)
        lines += [f"  {self._built[i].schedule.short() if i in self._built else v.schedule.short()} when {v.rule}"
                  for i, v in enumerate(self.variants)]
        return "\n".join(lines)

    def __getattr__(self, name):
        # ir, cuda_source, schedule, resources, with_ir, op, ...: the default kernel's
        if name.startswith("__") or name in ("primary", "variants", "op", "dropped"):
            raise AttributeError(name)
        return getattr(self.primary, name)

    def __repr__(self) -> str:
        return f"<ShapeDispatchKernel {self.describe()}>"
