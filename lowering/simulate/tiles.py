"""The simulator's register-tile handlers (mixed into `machine.Machine`): declarations,
fill / unary / binary / mask / reduce, plain global loads and stores, and `tile.store_smem`;
values live in fp32 and are rounded to the tile's declared dtype at every write. An i32 tile
holds int32 values: ops into it compute in 32-bit integers (wrapping), a comparison of integer
operands compares them exactly, and a float op reads an i32 tile converted to fp32, as the
emitted CUDA does (docs/ir.md, "Integer tiles")."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from wsched.target import FRAGMENT_COLUMN_GROUP, TORCH_DTYPES

from .. import ir
from .errors import ProtocolError, RaceError, check_verified
from .state import Co, Ctx, Node, Reg, RegView, Write, read_box, write_box


def round_to_dtype(t: torch.Tensor, dtype: str) -> torch.Tensor:
    """fp32 values rounded to `dtype` (the register tile's declared type), kept as fp32."""
    target = TORCH_DTYPES[dtype]
    return t if target == torch.float32 else t.to(target).float()


def to_register(t: torch.Tensor, dtype: str) -> torch.Tensor:
    """A result as a register tile of `dtype` holds it: integers wrapped to int32 (floats
    truncated toward zero first, C's conversion) in an i32 tile; else fp32 rounded to `dtype`."""
    if dtype == "i32":
        if t.is_floating_point():
            t = t.trunc().to(torch.int64)
        return (torch.remainder(t.to(torch.int64) + 2**31, 2**32) - 2**31).to(torch.int32)
    return round_to_dtype(t.float(), dtype)


def _scalar(value, integer: bool) -> torch.Tensor:
    """A scalar operand as a 0-d tensor: int64 where the op computes in integers, else fp32."""
    return torch.tensor(int(value), dtype=torch.int64) if integer else torch.tensor(float(value))


def _as_float(t: torch.Tensor) -> torch.Tensor:
    """An operand as a float op reads it: an i32 tile's values converted to fp32."""
    return t if t.is_floating_point() else t.float()


# What each tile op of `ir.TILE_UNARY_OPS` / `ir.BINARY_OPS` computes (on fp32 values; the result is
# rounded to the destination's dtype). tests/test_simulator.py checks both tables cover the ops.
UNARY_SEMANTICS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "neg": torch.neg, "exp": torch.exp, "exp2": torch.exp2, "log": torch.log, "relu": torch.relu,
    "gelu": F.gelu, "silu": F.silu, "sigmoid": torch.sigmoid, "tanh": torch.tanh,
    "cast": lambda t: t,
    # 2^x with results below the least normal fp32 (2^-126) flushed to 0, as ex2.approx.ftz
    "exp2_ftz": lambda t: torch.where(torch.exp2(t) < 2.0 ** -126, 0.0, torch.exp2(t)),
}
BINARY_SEMANTICS: dict[str, Callable] = {
    "add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div,
    "maximum": torch.maximum, "minimum": torch.minimum,
}
# `ir.COMPARE_OPS`: 1.0 where the comparison holds, else 0.0; the logical ops read an operand as
# true where it is not 0 (tests/test_score_ir.py checks the table covers the ops).
COMPARE_SEMANTICS: dict[str, Callable] = {
    "lt": torch.lt, "le": torch.le, "gt": torch.gt, "ge": torch.ge, "eq": torch.eq, "ne": torch.ne,
    "logical_and": lambda a, b: (a != 0) & (b != 0), "logical_or": lambda a, b: (a != 0) | (b != 0),
}


def _held_names(name: str, reg) -> tuple[str, ...]:
    """The tile names whose registers an access to `name` touches: itself and, for a view, the
    tiles it is a view of."""
    return (name,) + (reg.names() if isinstance(reg, RegView) else ())


class TileHandlers:
    """Register tiles; uses `Machine`'s `_int`, `tensors`, `AsyncHandlers`' `_smem`, `_coords` and
    `_check_write`."""

    def _reg(self, co: Co, node: Node, name: str) -> Reg:
        reg = co.regs.get(name)
        check_verified(reg is not None, "a register tile is declared before its use")
        return reg

    def _read_reg(self, co: Co, node: Node, name: str) -> Reg:
        reg = self._reg(co, node, name)
        for held in _held_names(name, reg):
            if held in co.acc_pending:
                raise RaceError(f"acc read while wgmma pending (missing wgmma.wait): {held} in {co.where(node)}")
            co.touched.add(held)
        self._check_written(co, node, name, reg)
        return reg

    @staticmethod
    def _check_written(co: Co, node: Node, name: str, reg: Reg) -> None:
        if not reg.written:
            raise ProtocolError(
                f"read of register tile {name} before any write to it since its `reg` declaration: on the GPU "
                f"its registers hold whatever was there (they are not zeroed); initialise it first (e.g. "
                f"`tile.fill {name}, 0.0` before the loop that accumulates into it): {co.where(node)}")

    def _write_reg(self, co: Co, node: Node, name: str, value: torch.Tensor) -> None:
        reg = self._reg(co, node, name)
        for held in _held_names(name, reg):
            if held in co.acc_pending:
                raise RaceError(f"acc read while wgmma pending (missing wgmma.wait): {held} written in "
                                f"{co.where(node)}")
            if held in co.a_pending:
                raise RaceError(f"register A operand {held} written while a wgmma reading it is pending "
                                f"(missing wgmma.wait): {co.where(node)}")
            co.touched.add(held)
        check_verified(tuple(value.shape) == reg.shape, "a tile op's result has its destination's shape")
        reg.value = to_register(value, reg.dtype)
        reg.written = True

    def _h_RegDecl(self, co, node):
        s = node.stmt
        check_verified(s.dtype in TORCH_DTYPES and all(d >= 1 for d in s.shape) and s.shape != (),
                       "a register tile has an IR dtype and a shape of extents >= 1")
        if s.name in co.acc_pending or s.name in co.a_pending:
            raise RaceError(f"acc read while wgmma pending (missing wgmma.wait): {s.name} re-declared in "
                            f"{co.where(node)}")
        co.regs[s.name] = Reg(s.dtype, tuple(s.shape))

    def _h_TileFill(self, co, node):
        reg = self._reg(co, node, node.stmt.dst)
        value = node.ex(co.env)
        fill = int(value) if reg.dtype == "i32" else float(value)
        self._write_reg(co, node, node.stmt.dst, torch.full(reg.shape, fill,
                                                           dtype=torch.int64 if reg.dtype == "i32" else None))

    def _h_TileUnary(self, co, node):
        s = node.stmt
        src = self._read_reg(co, node, s.src).value
        if self._reg(co, node, s.dst).dtype == "i32":   # neg or cast (the verifier); a float cast truncates
            self._write_reg(co, node, s.dst, -src.to(torch.int64) if s.op == "neg" else src)
            return
        self._write_reg(co, node, s.dst, UNARY_SEMANTICS[s.op](_as_float(src)))

    def _operands(self, co, node, names, fns) -> list:
        """The operand values of an elementwise op: tiles as they are held, scalars as 0-d tensors
        (int64 where the scalar is an int, so that integer ops and comparisons stay exact)."""
        values = []
        for o, fn in zip(names, fns):
            if fn is None:
                values.append(self._read_reg(co, node, o).value)
            else:   # a 0-d tensor broadcasts like a tile (torch.maximum takes tensors only)
                value = fn(co.env)
                values.append(_scalar(value, isinstance(value, int)))
        return values

    def _h_TileBinary(self, co, node):
        s = node.stmt
        operands = self._operands(co, node, (s.lhs, s.rhs), node.ex)
        integer = all(not v.is_floating_point() for v in operands) and any(
            isinstance(o, str) and not v.is_floating_point() for o, v in zip((s.lhs, s.rhs), operands))
        if self._reg(co, node, s.dst).dtype == "i32":   # the verifier: i32 tiles and int scalars
            result = BINARY_SEMANTICS[s.op](*(v.to(torch.int64) for v in operands))
        elif s.op in COMPARE_SEMANTICS:   # integers compared exactly, else as fp32
            result = COMPARE_SEMANTICS[s.op](*(operands if integer else map(_as_float, operands))).float()
        else:
            result = BINARY_SEMANTICS[s.op](*map(_as_float, operands))   # the verifier checked the broadcast
        self._write_reg(co, node, s.dst, result.expand(self._reg(co, node, s.dst).shape).contiguous())

    def _h_TileMask(self, co, node):
        s = node.stmt
        value = self._read_reg(co, node, s.dst).value
        check_verified(value.dim() == 2, "tile.mask applies to a 2-D tile")
        row0, col0, limit = (int(f(co.env)) for f in node.ex[:3])
        rows = torch.arange(value.shape[0]).unsqueeze(1) + row0
        if node.ex[4] is not None:
            period = int(node.ex[4](co.env))
            if period < 1:
                raise ProtocolError(f"tile.mask {s.dst}: period({period}) must be at least 1")
            rows = rows % period
        cols = torch.arange(value.shape[1]).unsqueeze(0) + col0
        masked = (cols >= limit).expand(value.shape)
        if node.ex[3] is not None:
            masked = masked | (cols > rows + int(node.ex[3](co.env)))
        if node.ex[5] is not None:
            masked = masked | (cols < rows + int(node.ex[5](co.env)))
        self._write_reg(co, node, s.dst, value.masked_fill(masked, float("-inf")))

    def _h_TileReduce(self, co, node):
        s = node.stmt
        src = self._read_reg(co, node, s.src).value
        check_verified(0 <= s.axis < src.dim(), "a reduction's axis is a dim of its tile")
        result = src.sum(s.axis, keepdim=True) if s.op == "sum" else src.amax(s.axis, keepdim=True)
        self._write_reg(co, node, s.dst, result)

    def _global(self, co, node, name: str, tile_shape: tuple[int, ...], coord_fns=None):
        """(param, tensor, coords, extents) of a plain global access by a tile (coordinates
        `coord_fns`, by default the node's compiled expressions)."""
        entry = self.tensors.get(name)
        check_verified(entry is not None and isinstance(entry[0], ir.GlobalParam),
                       "tile.load and tile.store reach `global` params")
        param, tensor = entry
        rank = tensor.dim()
        coords = self._coords(co, node, node.ex if coord_fns is None else coord_fns, rank)
        t = len(tile_shape)
        if t >= rank:
            check_verified(all(d == 1 for d in tile_shape[:t - rank]),
                           "a tile's dims beyond its tensor's rank are 1")
            extents = tile_shape[t - rank:]
        else:
            extents = (1,) * (rank - t) + tuple(tile_shape)
        return param, tensor, coords, extents

    def _h_TileLoadGlobal(self, co, node):
        s = node.stmt
        reg = self._reg(co, node, s.dst)
        param, tensor, coords, extents = self._global(co, node, s.tensor, reg.shape)
        self.check_global_read(co, node, s.tensor, coords, extents)
        data = read_box(tensor, coords, extents, TORCH_DTYPES[param.dtype])
        self._write_reg(co, node, s.dst, data.reshape(reg.shape))   # an i32 tensor into an f32 tile: converted

    def _h_TileStoreGlobal(self, co, node):
        s = node.stmt
        reg = self._read_reg(co, node, s.src)
        coord_fns, limit_fn = node.ex
        param, tensor, coords, extents = self._global(co, node, s.tensor, reg.shape, coord_fns)
        data = reg.value.reshape(extents)
        if limit_fn is not None:   # rows at or beyond the limit are not stored (nor noted as written)
            check_verified(len(extents) >= 2, "row_limit bounds the rows of a tensor of rank 2 or more")
            limit = self._int(co, node, limit_fn(co.env), "a store's row limit")
            rows = max(0, min(extents[-2], limit - coords[-2]))
            if rows == 0:
                return
            data = data[..., :rows, :]
            extents = tuple(extents[:-2]) + (rows, extents[-1])
        write_box(tensor, coords, data, TORCH_DTYPES[param.dtype])
        self.note_global_write(co, node, s.tensor, coords, extents)

    def _h_TileView(self, co, node):
        s = node.stmt
        base = self._reg(co, node, s.src)
        col0 = self._int(co, node, node.ex(co.env), "a view's first column")
        check_verified(len(base.shape) == 2 and s.cols % FRAGMENT_COLUMN_GROUP == 0,
                       "a view takes whole column groups of a 2-D tile")
        if col0 < 0 or col0 % FRAGMENT_COLUMN_GROUP or col0 + s.cols > base.shape[1]:
            raise ProtocolError(f"tile.view {s.name}: columns {col0}..{col0 + s.cols - 1} are not a whole-group slice "
                                f"of {s.src} {list(base.shape)} (first column a multiple of {FRAGMENT_COLUMN_GROUP}, "
                                f"last inside the tile): {co.where(node)}")
        co.regs[s.name] = RegView(s.src, base, col0, s.cols)

    def _h_TileStoreSmem(self, co, node):
        s = node.stmt
        reg = self._read_reg(co, node, s.src)
        decl, view, cells, label = self._smem(co, node, s.dst, node.ex)
        sub = tuple(view.shape)
        tile = ir.tile_shape_of_subarray(sub) if len(sub) in (2, 3) else sub
        check_verified(tuple(reg.shape) == tuple(tile), "tile.store_smem writes a tile of the sub-array's shape")
        self._check_write(co, node, cells, label, "tile.store_smem")
        value = reg.value.to(TORCH_DTYPES[decl.dtype])
        if len(sub) == 3:
            chunks, rows, width = sub
            value = value.reshape(rows, chunks, width).transpose(0, 1)
        view.copy_(value)
        write = Write("generic", co.agent(), Ctx(co, node))
        for cell in cells:
            cell.write = write
            cell.reads = []
        co.unfenced.append(write)

    # -- attention score functions ----------------------------------------------------------------

    def _h_TileIota(self, co, node):
        s = node.stmt
        reg = self._reg(co, node, s.dst)
        check_verified(len(reg.shape) == 2 and s.axis in (0, 1), "tile.iota fills a 2-D tile along axis 0 or 1")
        start = int(node.ex(co.env))
        index = torch.arange(reg.shape[s.axis], dtype=torch.int64) + start   # fp32 tiles round it (int -> float)
        self._write_reg(co, node, s.dst,
                        (index[:, None] if s.axis == 0 else index[None, :]).expand(reg.shape).contiguous())

    def _h_TileSelect(self, co, node):
        s = node.stmt
        cond, on_true, on_false = self._operands(co, node, (s.cond, s.on_true, s.on_false), node.ex)
        if self._reg(co, node, s.dst).dtype != "i32":
            on_true, on_false = _as_float(on_true), _as_float(on_false)
        result = torch.where(cond != 0, on_true, on_false)   # the verifier checked that the shapes broadcast
        self._write_reg(co, node, s.dst, result.expand(self._reg(co, node, s.dst).shape).contiguous())
