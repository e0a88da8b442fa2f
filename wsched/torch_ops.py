"""Compiled kernels as torch custom ops (`torch.library.custom_op`), so that `torch.compile`
(`fullgraph=True`), `torch.export` and CUDA graphs see each kernel as one opaque op.

    k = ws.compile(mlp)
    k.op                              # torch.ops.wsched.mlp_<hash>.default
    k.op(a, b, bias)                  # the same launch as k(a, b, bias), through the dispatcher
    torch.compile(lambda a, b, bias: k(a, b, bias), fullgraph=True)   # k(...) traces as k.op

One op per compiled kernel, in the `wsched` namespace, named after the fusion plus a hash of
the kernel's CUDA source, schedule and signature: two schedules of one fusion get two ops, and
compiling the same kernel again reuses the op already registered. Its schema lists the fusion's
inputs (`Tensor a, Tensor b, ...`) and returns one tensor per output, in the fusion's order
(attention with LSE: `(Tensor, Tensor)`, O then LSE).

The fake (meta) implementation binds the fusion's symbolic dims to the input shapes (plain
ints or SymInts) and gives each output's shape and dtype, as the eager call allocates them. The
CUDA implementation is the eager launch: outputs from torch's allocator, the kernel on torch's
current stream, no synchronisation and no driver allocation (TMA maps are encoded on the host),
so a CUDA graph captures it. On CPU tensors the op runs the kernel's loop IR in the CPU
simulator (slow; it lets the op be traced, exported and checked on machines without a GPU).
"""

from __future__ import annotations

import hashlib
import re
import threading

import torch

from .codegen import native

NAMESPACE = "wsched"

_ops: dict[str, torch._ops.OpOverload] = {}   # op name -> its default overload
_lock = threading.Lock()
_EAGER_TYPES = (torch.Tensor, torch.nn.Parameter)


def is_traced(tensors) -> bool:
    """Whether a call is being traced rather than run: torch.compile / torch.export, or an
    argument that is a tensor subclass holding no data (FakeTensor, FunctionalTensor, ...)."""
    if torch.compiler.is_compiling():
        return True
    for t in tensors:   # a loop, not any(...): this runs on every eager call
        if type(t) not in _EAGER_TYPES and isinstance(t, torch.Tensor):
            return True
    return False


def op_name(kernel) -> str:
    """`<fusion name>_<12 hex digits>`: the digest covers what makes two kernels differ (CUDA
    source, schedule, signature, the variants of a per-shape choice), so two schedules of one
    fusion never share an op, nor a kernel and a `ShapeDispatchKernel` around it."""
    variants = "\0".join(repr(v.schedule) for v in getattr(kernel, "variants", ()))   # a per-shape choice
    text = "\0".join((kernel.cuda_source, repr(kernel.schedule), schema(kernel), variants))
    digest = hashlib.sha256(text.encode()).hexdigest()[:12]
    base = re.sub(r"\W", "_", kernel.fusion.name, flags=re.ASCII)
    return f"{base}_{digest}"


def schema(kernel) -> str:
    """The op's schema: one `Tensor` argument per fusion input, one `Tensor` per output."""
    names = [node.id if node.id.isidentifier() and node.id not in ("self", "out") else f"arg_{i}"
             for i, node in enumerate(kernel.fusion.inputs)]
    outputs = len(kernel.partition.outputs)
    returns = "Tensor" if outputs == 1 else "(" + ", ".join(["Tensor"] * outputs) + ")"
    return f"({', '.join(f'Tensor {name}' for name in names)}) -> {returns}"


def register(kernel) -> torch._ops.OpOverload:
    """The custom op that runs `kernel` (`torch.ops.wsched.<op_name>.default`), registered on
    first use; a kernel with the same name (same source and schedule) reuses it. `kernel` is a
    `CompiledKernel` or a `ShapeDispatchKernel` (whose op picks its kernel when it runs, so a
    traced graph keeps the per-shape choice)."""
    name = op_name(kernel)
    with _lock:
        op = _ops.get(name)
        if op is None:
            op = _ops[name] = _define(name, kernel)
    return op


def _define(name: str, kernel) -> torch._ops.OpOverload:
    fusion = kernel.fusion

    def launch(*tensors):
        result = native.call(kernel, tensors, None)   # a layout planned before: launched from C
        return kernel._run(tensors) if result is None else result

    custom = torch.library.custom_op(f"{NAMESPACE}::{name}", launch, mutates_args=(),
                                     device_types="cuda", schema=schema(kernel))

    @custom.register_fake
    def _(*tensors):
        # The shapes the eager call allocates, from the fusion's dims bound to these shapes.
        sizes = fusion.bind_tensors(f"{fusion.name} (torch op {NAMESPACE}::{name})", tensors)
        return kernel._result(kernel._outputs(sizes, tensors[0].device))

    @custom.register_kernel("cpu")
    def _(*tensors):
        return kernel.simulate(*tensors)

    return getattr(getattr(torch.ops, NAMESPACE), name).default
