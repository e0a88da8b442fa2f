"""Preparing a kernel for the simulator (mixed into `simulate_machine.Machine`): arguments
checked against the parameters and bound, and every statement compiled once into a `Node`
(its handler `_h_<Stmt>`, compiled expressions, nested blocks), with the static checks that
need no run (leader-only and collective statements, loop kinds, tile ops, smem references)."""

from __future__ import annotations

import torch

from . import ir
from .simulate import ProtocolError, SimulationError
from .simulate_expr import Undefined, compile_expr, expr_text, stmt_text
from .simulate_state import Node
from .simulate_tiles import BINARY_OPS, UNARY_OPS

# Kernel-level statements with side effects run once per CTA, by its first warpgroup.
_LEADER_ONLY = (ir.MbarrierInit, ir.MbarrierInval, ir.MbarrierArrive, ir.MbarrierArriveExpectTx,
                ir.FenceMbarrierInit, ir.FenceProxyAsync, ir.TmaLoad, ir.TmaStore, ir.TmaCommit,
                ir.TmaWait, ir.TileStoreGlobal, ir.TileStoreSmem)
# Warpgroup-collective statements: one elected thread cannot run them.
_COLLECTIVE = (ir.WgmmaFence, ir.Wgmma, ir.WgmmaCommit, ir.WgmmaWait, ir.NamedBarrierSync,
               ir.NamedBarrierArrive, ir.SyncThreads, ir.Setmaxnreg, ir.RegDecl, ir.TileFill,
               ir.TileUnary, ir.TileBinary, ir.TileReduce, ir.TileMask, ir.TileLoadGlobal,
               ir.TileStoreGlobal, ir.TileStoreSmem, ir.Role)


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
            if p.name not in args:
                raise SimulationError(f"missing argument {p.name!r} for kernel {self.kernel.name}")
            value = args[p.name]
            if isinstance(p, ir.ScalarParam):
                if isinstance(value, torch.Tensor) or isinstance(value, bool):
                    raise SimulationError(f"argument {p.name!r} ({p.dtype}) must be a Python number")
                if p.dtype == "i32":
                    if int(value) != value:
                        raise SimulationError(f"argument {p.name!r} is i32 but got {value!r}")
                    self.scalars[p.name] = int(value)
                else:
                    self.scalars[p.name] = float(value)
        for p in self.kernel.params:
            if isinstance(p, ir.ScalarParam):
                continue
            value = args[p.name]
            if not isinstance(value, torch.Tensor) or value.device.type != "cpu":
                raise SimulationError(f"argument {p.name!r} must be a CPU torch tensor, got {type(value).__name__}")
            try:
                shape = tuple(compile_expr(d)(self.scalars) for d in p.shape)
            except Undefined as u:
                raise SimulationError(f"shape of parameter {p.name}: undefined name {u.name!r}") from None
            if tuple(value.shape) != shape:
                raise SimulationError(
                    f"argument {p.name!r} has shape {list(value.shape)} but the kernel declares "
                    f"{p.name}: {p.dtype}[{', '.join(expr_text(d) for d in p.shape)}] = {list(shape)}")
            if isinstance(p, ir.TensorMapParam):
                if len(p.box) != len(p.shape):
                    raise ProtocolError(f"tensormap {p.name}: box {list(p.box)} has rank {len(p.box)}, "
                                        f"the tensor rank {len(p.shape)}")
                if p.swizzle not in (0, 32, 64, 128):
                    raise ProtocolError(f"tensormap {p.name}: swizzle({p.swizzle}) is not one of 0, 32, 64, 128")
                inner = p.box[-1] * ir.DTYPE_BYTES[p.dtype]
                if any(not 1 <= b <= 256 for b in p.box) or inner % 16:
                    raise ProtocolError(f"tensormap {p.name}: box {list(p.box)} needs every extent in "
                                        f"[1, 256] and inner bytes a multiple of 16 (got {inner})")
                if p.swizzle and inner > p.swizzle:
                    raise ProtocolError(f"tensormap {p.name}: inner box extent {p.box[-1]} {p.dtype} = {inner} "
                                        f"bytes exceeds the swizzle({p.swizzle}) span")
            self.tensors[p.name] = (p, value)

    # -- compilation -------------------------------------------------------------------------
    def _compile_block(self, stmts, in_role: bool, in_elect: bool) -> tuple[Node, ...]:
        return tuple(self._compile_stmt(s, in_role, in_elect) for s in stmts)

    def _compile_stmt(self, s: ir.Stmt, in_role: bool, in_elect: bool) -> Node:
        node = Node(s)
        handler = getattr(self, "_h_" + type(s).__name__, None)
        if handler is None:
            raise ProtocolError(f"the simulator has no semantics for {type(s).__name__}: {stmt_text(s)}")
        node.fn = handler
        node.leader_only = not in_role and isinstance(s, _LEADER_ONLY)
        if in_elect and isinstance(s, _COLLECTIVE):
            raise ProtocolError(f"{stmt_text(s)}: warpgroup-collective statement inside elect_one "
                                f"(one thread cannot run it)")
        if in_role and isinstance(s, (ir.SyncThreads, ir.Role)):
            raise ProtocolError(f"{stmt_text(s)} inside a role: use a named barrier "
                                f"(bar.sync id, threads) for the warpgroups that take part")
        c = compile_expr
        if isinstance(s, (ir.Let, ir.Assign)):
            node.ex = c(s.value)
        elif isinstance(s, ir.For):
            if s.iteration not in ("serial", "persistent", "unroll"):
                raise ProtocolError(f"{stmt_text(s)}: loop kind must be serial, persistent or unroll")
            node.ex = (c(s.start), c(s.stop), c(s.step))
            node.block = self._compile_block(s.body, in_role, in_elect)
        elif isinstance(s, ir.If):
            node.ex = c(s.cond)
            node.block = self._compile_block(s.then, in_role, in_elect)
            node.orelse = self._compile_block(s.orelse, in_role, in_elect)
        elif isinstance(s, ir.Role):
            node.info = self.role_start[id(s)]
            node.block = self._compile_block(s.body, True, False)
        elif isinstance(s, ir.ElectOne):
            node.block = self._compile_block(s.body, in_role, True)
        elif isinstance(s, (ir.MbarrierArrive, ir.MbarrierArriveExpectTx, ir.MbarrierWait)):
            extra = s.bytes if isinstance(s, ir.MbarrierArriveExpectTx) else getattr(s, "phase", None)
            node.ex = (c(s.bar.index), c(extra) if extra is not None else None)
        elif isinstance(s, (ir.NamedBarrierSync, ir.NamedBarrierArrive)):
            node.ex = c(s.id)
        elif isinstance(s, ir.TmaLoad):
            node.ex = (tuple(c(e) for e in s.dst.index), tuple(c(e) for e in s.coords), c(s.bar.index))
            self._note_ref(s.dst)
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
            if s.op not in BINARY_OPS:
                raise ProtocolError(f"{stmt_text(s)}: unknown binary tile op (known: {', '.join(BINARY_OPS)})")
        elif isinstance(s, ir.TileUnary):
            if s.op not in UNARY_OPS:
                raise ProtocolError(f"{stmt_text(s)}: unknown unary tile op (known: {', '.join(UNARY_OPS)})")
        elif isinstance(s, ir.TileReduce):
            if s.op not in ir.REDUCE_OPS:
                raise ProtocolError(f"{stmt_text(s)}: unknown reduction (known: {', '.join(ir.REDUCE_OPS)})")
        elif isinstance(s, ir.TileMask):
            node.ex = (c(s.row0), c(s.col0), c(s.limit), None if s.causal is None else c(s.causal))
        elif isinstance(s, (ir.TileLoadGlobal, ir.TileStoreGlobal)):
            node.ex = tuple(c(e) for e in s.coords)
        elif isinstance(s, ir.TileStoreSmem):
            node.ex = tuple(c(e) for e in s.dst.index)
            self._note_ref(s.dst)
        return node

    def _note_ref(self, ref: ir.SmemRef) -> None:
        """Race tracking works on cells: the finest leading-index split any reference uses."""
        if ref.buffer not in self.buffers:
            raise ProtocolError(f"smem buffer {ref.buffer!r} is not declared "
                                f"(declared: {', '.join(self.buffers) or 'none'})")
        decl = self.buffers[ref.buffer]
        if len(ref.index) > len(decl.shape) - 1:
            raise ProtocolError(f"{ref.buffer}[...] has {len(ref.index)} indices; buffer "
                                f"{ref.buffer}: {decl.dtype}{list(decl.shape)} leaves no tile")
        self.cell_depth[ref.buffer] = max(self.cell_depth[ref.buffer], len(ref.index))
