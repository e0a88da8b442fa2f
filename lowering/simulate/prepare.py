"""Preparing a kernel for the simulator (mixed into `machine.Machine`): arguments checked
against the parameters and bound, and every statement compiled once into a `Node` (its handler
`_h_<Stmt>`, compiled expressions, nested blocks). The kernel's structure is verified before
(`simulate` runs `verify(kernel, contract=False)`); the rules that relies on are asserted here,
not reported again."""

from __future__ import annotations

import math

import torch

from wsched.target import FLOAT_DTYPES, TORCH_DTYPES

from .. import ir
from ..block_spans import block_spans
from ..evaluate import INT_MAX, INT_MIN, ExprError, Undefined, compile_expr, f32
from ..printer import expr_text
from ..verify.lines import statement_lines
from .errors import SimulationError, SimulatorInternalError, check_verified
from .state import Node
from .tiles import BINARY_SEMANTICS, COMPARE_SEMANTICS, UNARY_SEMANTICS

# Kernel-level statements with side effects run once per CTA, by its first warpgroup.
_LEADER_ONLY = (ir.MbarrierInit, ir.MbarrierInval, ir.MbarrierArrive, ir.MbarrierArriveExpectTx,
                ir.FenceMbarrierInit, ir.FenceProxyAsync, ir.TmaLoad, ir.TmaStore, ir.TmaCommit,
                ir.TmaWait, ir.TileStoreGlobal, ir.TileStoreSmem)


class KernelPreparation:
    """Binds `args` and compiles `kernel.body`; needs `kernel`, `buffers`, `cell_depth` and
    `role_start` set by `Machine.__init__`."""

    # -- arguments ---------------------------------------------------------------------------
    def _bind_args(self, args: dict) -> None:
        self.scalars: dict[str, int | float] = {}
        self.tensors: dict[str, tuple[ir.Param, torch.Tensor]] = {}
        names = {p.name for p in self.kernel.params}
        unknown = sorted(set(args) - names)
        if unknown:
            raise SimulationError(f"arguments {unknown} are not parameters of kernel {self.kernel.name} "
                                  f"(parameters: {sorted(names)})")
        for p in self.kernel.params:
            if isinstance(p, ir.HostParam) and p.name not in args:
                args = {**args, p.name: self._host_value(p)}
            if p.name not in args:
                if isinstance(p, (ir.WorkspaceParam, ir.SpanParam)):
                    continue      # allocated or computed below, once its shape's scalars are bound
                raise SimulationError(f"missing argument {p.name!r} for kernel {self.kernel.name}")
            value = args[p.name]
            if isinstance(p, ir.ScalarParam):
                if isinstance(value, torch.Tensor) or isinstance(value, bool):
                    raise SimulationError(f"argument {p.name!r} ({p.dtype}) must be a Python number")
                if p.dtype not in FLOAT_DTYPES:
                    if int(value) != value or not INT_MIN <= value <= INT_MAX:
                        raise SimulationError(f"argument {p.name!r} is i32 but got {value!r} (an integer in "
                                              f"[{INT_MIN}, {INT_MAX}])")
                    self.scalars[p.name] = int(value)
                else:   # the kernel receives a `float`
                    self.scalars[p.name] = f32(float(value))
        for p in self.kernel.params:
            if isinstance(p, ir.ScalarParam):
                continue
            if isinstance(p, ir.WorkspaceParam) and p.name not in args:
                args = {**args, p.name: self._workspace(p)}
            if isinstance(p, ir.SpanParam) and p.name not in args:   # as the host computes it per call
                args = {**args, p.name: self._spans(p)}
            value = args[p.name]
            if not isinstance(value, torch.Tensor) or value.device.type != "cpu":
                raise SimulationError(f"argument {p.name!r} must be a CPU torch tensor, got {type(value).__name__}")
            try:
                shape = tuple(compile_expr(d)(self.scalars) for d in p.shape)
            except Undefined:
                raise SimulatorInternalError(f"the verifier should have rejected this kernel: the shape "
                                             f"of parameter {p.name} reads scalar params only") from None
            except ExprError as error:
                declared = ", ".join(expr_text(d) for d in p.shape)
                raise SimulationError(f"the shape of parameter {p.name}: {p.dtype}[{declared}] has no value with "
                                      f"these arguments: {error}") from None
            if tuple(value.shape) != shape:
                raise SimulationError(
                    f"argument {p.name!r} has shape {list(value.shape)} but the kernel declares "
                    f"{p.name}: {p.dtype}[{', '.join(expr_text(d) for d in p.shape)}] = {list(shape)}")
            self.tensors[p.name] = (p, value)

    def _host_value(self, p: ir.HostParam) -> int | float:
        """A host param the caller did not give: its value, as the host computes it per call."""
        try:
            return compile_expr(p.value)(dict(self.scalars, num_sms=self.num_sms))
        except Undefined:
            raise SimulatorInternalError(f"the verifier should have rejected this kernel: host param {p.name} "
                                         f"reads scalar params before it and num_sms only") from None
        except ExprError as error:
            raise SimulationError(f"host param {p.name} = {expr_text(p.value)} has no value with these "
                                  f"arguments: {error}") from None

    def _spans(self, p: ir.SpanParam) -> torch.Tensor:
        """A spans table the caller did not give: computed from its id inputs, bound before it."""
        try:
            shape = tuple(compile_expr(d)(self.scalars) for d in p.shape)
        except (Undefined, ExprError) as error:
            raise SimulationError(f"the shape of spans {p.name} has no value with these arguments: {error}") from None
        check_verified(p.query in self.tensors and p.key in self.tensors, "a spans param follows its id inputs")
        return block_spans(self.tensors[p.query][1], self.tensors[p.key][1], p.rows, p.cols, shape)

    def _workspace(self, p: ir.WorkspaceParam) -> torch.Tensor:
        """A workspace the caller did not give, as the host allocates it: zeros where the kernel
        needs them, NaN elsewhere (a read of what nothing wrote shows in the numbers)."""
        try:
            shape = tuple(compile_expr(d)(self.scalars) for d in p.shape)
        except (Undefined, ExprError) as error:
            raise SimulationError(f"the shape of workspace {p.name} has no value with these arguments: "
                                  f"{error}") from None
        dtype = TORCH_DTYPES[p.dtype]
        if p.zeroed or not dtype.is_floating_point:
            return torch.zeros(shape, dtype=dtype)
        return torch.full(shape, float("nan"), dtype=dtype)

    # -- compilation -------------------------------------------------------------------------
    def _compile_body(self) -> tuple[Node, ...]:
        self.lines = statement_lines(self.kernel)
        self.row_granules: dict[str, int] = {}
        body = self._compile_block(self.kernel.body, False, False, ())
        # A buffer that `tma.load ... row(r)` fills in parts is tracked in row groups below the
        # deepest index any reference uses (unless that index already selects single rows).
        self.cell_splits = {name: self.buffers[name].shape[-2] // granule
                            for name, granule in self.row_granules.items()
                            if self.cell_depth[name] == len(self.buffers[name].shape) - 2}
        return body

    def _compile_block(self, stmts, in_role: bool, in_elect: bool, prefix: tuple[int, ...],
                       offset: int = 0) -> tuple[Node, ...]:
        """`stmts` as nodes; `prefix` + `offset` place them in the traversal paths that
        `statement_lines` numbers (an `if`'s else statements follow its then statements)."""
        return tuple(self._compile_stmt(s, in_role, in_elect, prefix + (offset + i,))
                     for i, s in enumerate(stmts))

    def _compile_stmt(self, s: ir.Stmt, in_role: bool, in_elect: bool, path: tuple[int, ...]) -> Node:
        node = Node(s, self.lines.get(path))
        handler = getattr(self, "_h_" + type(s).__name__, None)
        check_verified(handler is not None, "every statement is an ir.Stmt")
        check_verified(not (in_elect and isinstance(s, ir.WARPGROUP_COLLECTIVE)),
                       "a warpgroup-collective statement is outside elect_one")
        check_verified(not (in_role and isinstance(s, (ir.SyncThreads, ir.ClusterSync, ir.Role))),
                       "syncthreads and roles are outside roles (and so is cluster.sync)")
        node.fn = handler
        node.leader_only = not in_role and isinstance(s, _LEADER_ONLY)
        c = compile_expr
        if isinstance(s, (ir.Let, ir.Assign)):
            node.ex = c(s.value)
        elif isinstance(s, ir.For):
            check_verified(s.iteration in ir.LOOP_KINDS, "a loop's iteration is one of ir.LOOP_KINDS")
            node.ex = (c(s.start), c(s.stop), c(s.step))
            node.block = self._compile_block(s.body, in_role, in_elect, path)
        elif isinstance(s, ir.If):
            node.ex = c(s.cond)
            node.block = self._compile_block(s.then, in_role, in_elect, path)
            node.orelse = self._compile_block(s.orelse, in_role, in_elect, path, len(s.then))
        elif isinstance(s, ir.Role):
            node.info = self.role_start[id(s)]
            node.block = self._compile_block(s.body, True, False, path)
        elif isinstance(s, ir.ElectOne):
            node.block = self._compile_block(s.body, in_role, True, path)
        elif isinstance(s, (ir.MbarrierArrive, ir.MbarrierArriveExpectTx, ir.MbarrierWait)):
            extra = s.bytes if isinstance(s, ir.MbarrierArriveExpectTx) else getattr(s, "phase", None)
            node.ex = (c(s.bar.index), c(extra) if extra is not None else None)
            if isinstance(s, ir.MbarrierArrive) and s.cta is not None:   # on a CTA of the cluster
                node.ex += (c(s.cta),)
                node.fn = self._h_remote_arrive
        elif isinstance(s, (ir.NamedBarrierSync, ir.NamedBarrierArrive)):
            node.ex = c(s.id)
        elif isinstance(s, ir.TmaLoad):
            node.ex = (tuple(c(e) for e in s.dst.index), tuple(c(e) for e in s.coords), c(s.bar.index),
                       None if s.row is None else c(s.row), None if s.multicast is None else c(s.multicast))
            self._note_ref(s.dst)
            if s.row is not None:
                self._note_row_load(s)
        elif isinstance(s, ir.TmaStore):
            node.ex = (tuple(c(e) for e in s.src.index), tuple(c(e) for e in s.coords))
            self._note_ref(s.src)
        elif isinstance(s, ir.Wgmma):
            a_idx = None if isinstance(s.a, str) else tuple(c(e) for e in s.a.index)
            node.ex = (a_idx, tuple(c(e) for e in s.b.index), c(s.accumulate))
            if not isinstance(s.a, str):
                self._note_ref(s.a)
            self._note_ref(s.b)
        elif isinstance(s, ir.TileFill):
            node.ex = c(s.value)
        elif isinstance(s, ir.TileBinary):
            node.ex = tuple(None if isinstance(o, str) else c(o) for o in (s.lhs, s.rhs))
            check_verified(s.op in BINARY_SEMANTICS or s.op in COMPARE_SEMANTICS,
                           "a binary tile op is one of ir.TILE_BINARY_OPS")
        elif isinstance(s, ir.TileUnary):
            check_verified(s.op in UNARY_SEMANTICS, "a unary tile op is one of ir.TILE_UNARY_OPS")
        elif isinstance(s, ir.TileReduce):
            check_verified(s.op in ir.REDUCE_OPS, "a reduction is one of ir.REDUCE_OPS")
        elif isinstance(s, ir.TileMask):
            node.ex = (c(s.row0), c(s.col0), c(s.limit), None if s.causal is None else c(s.causal),
                       None if s.period is None else c(s.period), None if s.lower is None else c(s.lower))
        elif isinstance(s, (ir.TileLoadGlobal, ir.LoadGlobal)):
            node.ex = tuple(c(e) for e in s.coords)
        elif isinstance(s, ir.TileStoreGlobal):   # (coordinates, row limit or None)
            node.ex = (tuple(c(e) for e in s.coords), None if s.row_limit is None else c(s.row_limit))
        elif isinstance(s, (ir.TileStoreSmem, ir.LoadShared)):   # one smem reference
            ref = s.dst if isinstance(s, ir.TileStoreSmem) else s.src
            node.ex = tuple(c(e) for e in ref.index)
            self._note_ref(ref)
        elif isinstance(s, ir.TileView):
            node.ex = c(s.col0)
        elif isinstance(s, ir.AtomicInc):
            node.ex = (tuple(c(e) for e in s.dst.index), tuple(c(e) for e in s.coords), c(s.wrap))
            self._note_ref(s.dst)
        # attention score functions
        elif isinstance(s, ir.TileIota):
            node.ex = c(s.start)
        elif isinstance(s, ir.TileSelect):
            node.ex = tuple(None if isinstance(o, str) else c(o) for o in (s.cond, s.on_true, s.on_false))
        return node

    def _note_row_load(self, s: ir.TmaLoad) -> None:
        """Race tracking of a buffer that row loads fill: rows in groups that every such load
        covers whole (it starts on a multiple of the alignment step and spans its box's rows)."""
        decl, param = self.buffers[s.dst.buffer], self.kernel.param(s.tensor)
        check_verified(isinstance(param, ir.TensorMapParam) and len(s.dst.index) == len(decl.shape) - 2
                       and param.box[-1] == decl.shape[-1],
                       "a tma.load with a row offset fills rows of a 2-D sub-array as wide as its box")
        rows = math.prod(param.box) // decl.shape[-1]
        _, step = ir.tma_row_step(decl)
        self.row_granules[decl.name] = math.gcd(self.row_granules.get(decl.name, 0), step, rows, decl.shape[-2])

    def _note_ref(self, ref: ir.SmemRef) -> None:
        """Race tracking works on cells: the finest leading-index split any reference uses."""
        decl = self.buffers.get(ref.buffer)
        check_verified(decl is not None and len(ref.index) < len(decl.shape),
                       "a smem reference names a declared buffer and leaves a sub-array")
        self.cell_depth[ref.buffer] = max(self.cell_depth[ref.buffer], len(ref.index))
