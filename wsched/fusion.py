"""The fusion DSL's DAG: `Node`, `Fusion`, the trace that records them, and `@ws.fusion`
(docs/architecture.md).

A user writes a plain Python function over `ws.Tensor` parameters. `@ws.fusion` calls it once,
at decoration time, with symbolic proxy tensors (dsl.py); every op on a proxy appends one `Node`
to a DAG. The result is a `Fusion`: a networkx DiGraph of frozen Nodes that the later stages
(schedule, partition, lowering) read, with `bind` (the size of every symbol, from concrete
inputs) and `reference()`, the torch evaluation (reference.py) that every test and the
simulator compare against.

    @ws.fusion
    def mlp(a: ws.Tensor[ws.bf16, "M", "K"], b: ws.Tensor[ws.bf16, "K", "N"],
            bias: ws.Tensor[ws.bf16, "N"]):
        return ws.gelu(ws.matmul(a, b) + bias).to(ws.bf16)

    print(mlp)
    fusion mlp(a: bf16[M, K], b: bf16[K, N], bias: bf16[N]):
      n0 = matmul(a, b) : f32[M, N]   # mlp.py:5
      n1 = add(n0, bias) : f32[M, N]   # mlp.py:5
      n2 = gelu(n1) : f32[M, N]   # mlp.py:5
      n3 = cast(n2) : bf16[M, N]   # mlp.py:5
      return n3

Nodes no output depends on are dropped when tracing ends, and the remaining ones are numbered
n0, n1, ... in creation order.
"""

from __future__ import annotations

import inspect
import os
import re
from dataclasses import dataclass, replace
from typing import Callable, Iterable, Sequence

import networkx as nx
import torch

from .dsl import Dim, Shape, Tensor, TensorSpec, format_type, plus_one_base
from .dtypes import DType
from .errors import FusionError, type_name, user_location
from .reference import evaluate

# Ids of non-input nodes; a parameter may not take one (it would collide in the printout).
_GENERATED_ID = re.compile(r"n\d+")


def _format_attr(value: object) -> str:
    return value.name if isinstance(value, DType) else repr(value)


# --------------------------------------------------------------------------------------------
# The DAG's data: nodes
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Node:
    """One op of the DAG. Frozen and compared by value, so later stages can key dicts by node
    and tests can compare graphs structurally."""

    id: str                                     # parameter name for inputs, else "n0", "n1", ...
    op: str                                     # 'input', 'const', 'matmul', 'add', ...
    inputs: tuple[str, ...]                     # operand node ids, in operand order
    dtype: DType
    shape: Shape                                # symbolic dims are str
    attrs: tuple[tuple[str, object], ...] = ()  # sorted by key
    source: str = ""                            # "file.py:LINE" of the user's line

    def __post_init__(self):
        # Normalise so that nodes built from lists or unsorted attrs still compare equal.
        object.__setattr__(self, "inputs", tuple(self.inputs))
        object.__setattr__(self, "shape", tuple(self.shape))
        object.__setattr__(self, "attrs", tuple(sorted(self.attrs, key=lambda item: item[0])))

    def attr(self, name: str, default: object = None) -> object:
        for key, value in self.attrs:
            if key == name:
                return value
        return default

    @property
    def type_str(self) -> str:
        return format_type(self.dtype, self.shape)

    def __str__(self) -> str:
        arguments = [*self.inputs, *(f"{key}={_format_attr(value)}" for key, value in self.attrs)]
        text = f"{self.id} = {self.op}({', '.join(arguments)}) : {self.type_str}"
        return f"{text}   # {self.source}" if self.source else text


# --------------------------------------------------------------------------------------------
# Tracing: the DAG being recorded
# --------------------------------------------------------------------------------------------

class Trace:
    """The DAG being recorded while one @ws.fusion function runs; closed once it returns.
    Each proxy tensor holds its trace, and each op records its node through it."""

    def __init__(self, name: str):
        self.name = name
        self.nodes: list[Node] = []
        self.closed = False
        self._created = 0  # non-input nodes so far, for provisional ids

    def add(self, op: str, operands: Sequence[Tensor], dtype: DType, shape: Sequence[Dim],
            attrs: Iterable[tuple[str, object]] = ()) -> Tensor:
        # Provisional id; `finish` renumbers once dead nodes are gone.
        node_id = f"n{self._created}"
        self._created += 1
        node = Node(node_id, op, tuple(t.id for t in operands), dtype, tuple(shape),
                    tuple(attrs), user_location())
        self.nodes.append(node)
        return Tensor(self, node)

    def add_input(self, name: str, spec: TensorSpec, source: str) -> Tensor:
        node = Node(name, "input", (), spec.dtype, spec.shape, (), source)
        self.nodes.append(node)
        return Tensor(self, node)

    def symbols(self) -> set[str]:
        return {dim for node in self.nodes if node.op == "input" for dim in node.shape
                if isinstance(dim, str)}

    def finish(self, outputs: Sequence[Tensor]) -> Fusion:
        """Drop nodes no output depends on, number the rest n0, n1, ... and build the Fusion."""
        live = {t.id for t in outputs}
        for node in reversed(self.nodes):
            if node.id in live:
                live.update(node.inputs)
        kept = [node for node in self.nodes if node.op == "input" or node.id in live]
        renamed = {}
        for node in kept:
            if node.op != "input":
                renamed[node.id] = f"n{len(renamed)}"
        nodes = [replace(node, id=renamed.get(node.id, node.id),
                         inputs=tuple(renamed.get(i, i) for i in node.inputs)) for node in kept]
        return Fusion(self.name, nodes, [renamed.get(t.id, t.id) for t in outputs])


# --------------------------------------------------------------------------------------------
# The Fusion: graph, binding, reference evaluation
# --------------------------------------------------------------------------------------------

class Fusion:
    """A traced tensor DAG: `graph` maps node id -> attribute "node" (a Node), with an edge
    (u, v, {"operand": i}) for each operand (for `x * x` the one edge also carries
    "operands": (0, 1); Node.inputs is the authoritative operand list).

    Built by `@ws.fusion`, or directly from nodes listed in creation order (each node's
    operands listed before it). Treat it as immutable.
    """

    def __init__(self, name: str, nodes: Iterable[Node], outputs: Iterable[str]):
        if not isinstance(name, str):
            raise FusionError("Fusion", f"the name must be a str, got {type_name(name)}", "")
        self.name = name
        self.graph = nx.DiGraph()
        self._creation: dict[str, int] = {}
        for argument, value in (("nodes", nodes), ("outputs", outputs)):
            if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
                raise FusionError(name, f"{argument} must be a list, got {type_name(value)}", "")
        for node in nodes:
            if not isinstance(node, Node):
                raise FusionError(name, f"nodes must be ws Nodes, got {type_name(node)}", "")
            if node.id in self._creation:
                raise FusionError(name, f"duplicate node id {node.id}", node.source)
            for source in node.inputs:
                if source not in self._creation:
                    raise FusionError(name, f"node {node.id} uses {source} before it is "
                                      "defined", node.source)
            self._creation[node.id] = len(self._creation)
            self.graph.add_node(node.id, node=node)
            for operand, source in enumerate(node.inputs):
                if self.graph.has_edge(source, node.id):
                    edge = self.graph.edges[source, node.id]
                    edge["operands"] = (*edge.get("operands", (edge["operand"],)), operand)
                else:
                    self.graph.add_edge(source, node.id, operand=operand)
        self.inputs: tuple[Node, ...] = tuple(n for n in self.nodes() if n.op == "input")
        self.outputs: tuple[str, ...] = tuple(outputs)
        if not self.outputs:
            raise FusionError(name, "has no outputs; name at least one node", "")
        for output in self.outputs:
            if not isinstance(output, str) or output not in self._creation:
                raise FusionError(name, f"output {output!r} is not a node of the fusion", "")

    def nodes(self) -> list[Node]:
        """Every node in a deterministic topological order (creation order breaks ties); sorted
        once (the graph does not change after __init__), a new list per call."""
        order = self.__dict__.get("_order")
        if order is None:
            ids = nx.lexicographical_topological_sort(self.graph, key=self._creation.__getitem__)
            order = self.__dict__["_order"] = tuple(self.graph.nodes[node_id]["node"] for node_id in ids)
        return list(order)

    def node(self, node_id: str) -> Node:
        return self.graph.nodes[node_id]["node"]

    def consumers(self, node_id: str) -> list[Node]:
        """The nodes that read `node_id`, in creation order."""
        return [self.node(user) for user in
                sorted(self.graph.successors(node_id), key=self._creation.__getitem__)]

    @property
    def symbols(self) -> tuple[str, ...]:
        """The symbolic dims of the inputs, in order of first appearance ("B" for a "B+1")."""
        found = dict.fromkeys(plus_one_base(d) or d for node in self.inputs for d in node.shape if isinstance(d, str))
        return tuple(found)

    def bind(self, *tensors: torch.Tensor | Sequence[int]) -> dict[str, int]:
        """The size of every symbol, from torch tensors (shape and dtype checked) or shapes
        (torch.Size or tuples; shape checked), one per input in declaration order."""
        return self._bind(f"{self.name}.bind", tensors)

    def _bind(self, op: str, tensors: Sequence[object]) -> dict[str, int]:
        if len(tensors) != len(self.inputs):
            names = ", ".join(node.id for node in self.inputs)
            raise FusionError(op, f"expected {len(self.inputs)} inputs ({names}), "
                              f"got {len(tensors)}")
        sizes: dict[str, int] = {}
        bound_at: dict[str, str] = {}  # symbol -> "a dim 1", where its size was first seen
        for declared, value in zip(self.inputs, tensors):
            shape = _shape_of(op, declared, value)
            if len(shape) != len(declared.shape):
                raise FusionError(op, f"{declared.id} is declared {declared.type_str} but got "
                                  f"shape {shape} (rank {len(shape)}, expected "
                                  f"{len(declared.shape)})")
            for axis, (dim, size) in enumerate(zip(declared.shape, shape)):
                here = f"{declared.id} dim {axis}"
                if isinstance(dim, int):
                    if size != dim:
                        raise FusionError(op, f"{declared.id} is declared {declared.type_str} "
                                          f"but {here} has size {size}")
                elif dim not in sizes:
                    sizes[dim], bound_at[dim] = size, here
                elif sizes[dim] != size:
                    raise FusionError(op, f"symbol {dim} is bound to two sizes: {sizes[dim]} "
                                      f"({bound_at[dim]}) and {size} ({here})")
        for dim in [d for d in sizes if plus_one_base(d) is not None]:   # "B+1" declares B as one fewer
            base, size = plus_one_base(dim), sizes[dim] - 1
            if size < 1:
                raise FusionError(op, f"{bound_at[dim]} has size {sizes[dim]}, declared {dim}: {base} must be at "
                                  f"least 1")
            if sizes.setdefault(base, size) != size:
                raise FusionError(op, f"symbol {base} is bound to two sizes: {sizes[base]} ({bound_at[base]}) and "
                                  f"{size} ({bound_at[dim]} is {dim})")
        for node in self.nodes():   # a paged cache's keys: max_pages x page_size (dsl.paged)
            keys = node.shape[-2] if node.op == "paged" else None
            if isinstance(keys, str):
                pages, page_size = (int(d) if d.isdigit() else sizes[d] for d in keys.split("*"))
                sizes[keys] = pages * page_size
            if node.op == "varlen" and isinstance(node.shape[0], str):   # the sequences: B1-1 (dsl.varlen)
                offsets = self.node(node.inputs[1])
                count = sizes[offsets.shape[0]]
                if count < 2:
                    raise FusionError(op, f"{offsets.id} holds {count} offset{'s' * (count != 1)}: cu_seqlens "
                                      f"must hold at least 2 offsets (one sequence)")
                known = sizes.get(node.shape[0])
                if known is not None and known != count - 1:   # [B+1] offsets beside a [B] input
                    raise FusionError(op, f"symbol {node.shape[0]} is bound to two sizes: {known} and {count - 1} "
                                      f"({offsets.id} holds {count} offsets, one more than the sequences)")
                sizes[node.shape[0]] = count - 1
        return sizes

    def reference(self, *tensors: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """Evaluate the DAG with torch: inputs upcast to fp32, every node computed in fp32 and
        rounded to its declared dtype (so bf16 intermediates round where a kernel's would); i32
        values stay exact integers (reference.py).
        Returns the output, or a tuple of outputs, in their declared dtypes."""
        op = f"{self.name}.reference"
        return evaluate(self, tensors, self.bind_tensors(op, tensors))

    def bind_tensors(self, op: str, tensors: Sequence[object]) -> dict[str, int]:
        """`bind` for a call that needs data: every input a torch tensor (FusionError naming
        `op` otherwise)."""
        for index, value in enumerate(tensors):
            if not isinstance(value, torch.Tensor):
                raise FusionError(op, f"input {index} has type {type_name(value)}; expected a "
                                  "torch tensor")
        return self._bind(op, tensors)

    def __str__(self) -> str:
        parameters = ", ".join(f"{node.id}: {node.type_str}" for node in self.inputs)
        lines = [f"fusion {self.name}({parameters}):"]
        lines += [f"  {node}" for node in self.nodes() if node.op != "input"]
        lines.append(f"  return {', '.join(self.outputs)}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        inputs = ", ".join(node.id for node in self.inputs)
        return f"<Fusion {self.name}({inputs}) -> {', '.join(self.outputs)}: {len(self.graph)} nodes>"


def check_fusion(value: object, op: str) -> Fusion:
    """`value` if it is a Fusion, else a FusionError naming `op` (the function it was passed to)."""
    if not isinstance(value, Fusion):
        raise FusionError(op, f"expects a fusion (a function decorated with @ws.fusion), got "
                          f"{type_name(value)}")
    return value


def _shape_of(op: str, declared: Node, value: object) -> tuple[int, ...]:
    if isinstance(value, torch.Tensor):
        if value.dtype != declared.dtype.torch_dtype:
            raise FusionError(op, f"{declared.id} is declared {declared.type_str} but got a "
                              f"{value.dtype} tensor of shape {tuple(value.shape)}")
        return tuple(value.shape)
    if isinstance(value, (tuple, list)) and all(
            isinstance(size, int) and not isinstance(size, bool) for size in value):
        return tuple(value)
    raise FusionError(op, f"{declared.id}: expected a torch tensor or a shape, got "
                      f"{type_name(value)}")


# --------------------------------------------------------------------------------------------
# The decorator
# --------------------------------------------------------------------------------------------

def fusion(fn: Callable[..., Tensor | tuple[Tensor, ...]]) -> Fusion:
    """Trace `fn` once with symbolic tensors built from its `ws.Tensor[...]` annotations and
    return the Fusion it describes. Return one tensor, or a tuple for several outputs."""
    code = getattr(fn, "__code__", None)
    if code is None or not callable(fn):
        raise FusionError("ws.fusion", "decorates a Python function whose parameters are annotated with "
                          f"ws.Tensor[dtype, dims...], got {type_name(fn)}")
    name = fn.__name__
    definition = f"{os.path.basename(code.co_filename)}:{code.co_firstlineno}"
    try:
        signature = inspect.signature(fn, eval_str=True)
    except NameError as error:
        raise FusionError(name, f"cannot evaluate the parameter annotations ({error})",
                          definition) from error
    trace = Trace(name)
    parameters = []
    keyword_only = code.co_varnames[code.co_argcount:code.co_argcount + code.co_kwonlyargcount]
    for parameter in signature.parameters.values():
        spec = parameter.annotation
        if str(parameter).startswith("*"):  # *args, **kwargs (a Parameter prints its stars)
            raise FusionError(name, f"variadic parameter {parameter.name} is not supported; "
                              "declare each input", definition)
        if parameter.name in keyword_only:
            raise FusionError(name, f"keyword-only parameter {parameter.name} is not supported; "
                              "declare it before the `*` (inputs are passed in order)", definition)
        if not isinstance(spec, TensorSpec):
            got = "none" if spec is parameter.empty else repr(spec)
            raise FusionError(name, f"parameter {parameter.name} needs a ws.Tensor[dtype, "
                              f"dims...] annotation, got {got}", definition)
        if _GENERATED_ID.fullmatch(parameter.name):
            raise FusionError(name, f"parameter name {parameter.name} is reserved for "
                              "intermediate nodes (n0, n1, ...)", definition)
        parameters.append(trace.add_input(parameter.name, spec, definition))
    try:
        result = fn(*parameters)
    finally:
        trace.closed = True
    results = result if isinstance(result, tuple) else (result,)
    if not results:
        raise FusionError(name, "returns an empty tuple; return at least one ws tensor",
                          definition)
    for index, value in enumerate(results):
        if not isinstance(value, Tensor) or value._trace is not trace:
            what = "is a ws tensor of another fusion" if isinstance(value, Tensor) else (
                f"has type {type_name(value)}")
            raise FusionError(name, "must return a ws tensor or a tuple of them, but return "
                              f"value {index} {what}", definition)
    return trace.finish(results)
