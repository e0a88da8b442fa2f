"""The score function as tile ops on the score accumulator (the DAG nodes, one op each).

`ScoreOps.lower` turns the nodes that compute one value of the score function (the inner score,
or a mask's condition) into tile statements, in topological order:

    n3 = mul(n1, 0.125)       tile.mul s_acc, s_acc, scalar(0.125)
    n7 = div(n3, 30.0)        tile.mul s_acc, s_acc, scalar(0.03333333333333333)
    n8 = tanh(n7)             tile.tanh s_acc, s_acc
    n4 = position(dim=-2)     tile.iota score0_t, axis(0), start(m0 + wg * 64)
    n5 = position(dim=-1)     tile.iota score1_t, axis(1), start(k * 128)
    n11 = sub(n5, n4)         tile.sub score0_t, score1_t, score0_t
    n12 = mul(slope, n11)     tile.mul score0_t, slope_t, score0_t
    n13 = add(n8, n12)        tile.add s_acc, s_acc, score0_t

Q K^T is the accumulator itself, an input the score function reads is the tile loaded for it
(`slope_t`), a constant a `scalar(...)` operand, a position a `tile.iota`; a division by a
constant is a multiplication by its reciprocal (within an ulp of the division, one instruction
instead of a sequence per element). Each value lives in a
tile of the node's shape on the block ([64, BN] once it involves a position or the scores) and
dtype: a float node's own; an integer computed from an i32 input (document ids, positions per
key) an i32 tile, exact at any value, with a position it meets cast to i32 first; an integer of
positions and constants alone, and a comparison's result, f32 (positions are below 2**24, where
fp32 is exact, and a float op on positions needs no conversion per element). A tile whose value
is dead is reused. The [64, BN] ops come last and in a row, so the emitter runs them as one loop
over the fragment (`emit_elementwise_run`) and the temporary tiles never occupy registers as
whole tiles.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from wsched.lowering import ir
from wsched.target import BINARY_OPS, COMPARE_OPS, UNARY_OPS

F = ir.FloatConst


def node_dtype(node) -> str:
    """The tile dtype holding a node's values when no i32 input reaches it: its own when a
    float, else f32 (exact for positions, below 2**24)."""
    return node.dtype.name if node.dtype.is_float else "f32"


def input_dtype(node) -> str:
    """The dtype of the tile an input of the score function is loaded into: i32 ids stay
    integers (exact at any value), floats are read into f32."""
    return "i32" if node.dtype.name == "i32" else "f32"


@dataclass
class ScoreOps:
    """Temporary tiles (declared once per consumer warpgroup, `decls`) and the lowering."""

    fusion: object
    full: tuple[int, int]                       # [64, BN]: a block of scores of one warpgroup
    decls: dict = field(default_factory=dict)   # name -> ir.RegDecl, in order
    inputs: dict = field(default_factory=dict)  # an input's tile name -> its dtype (input_dtype)

    def lower(self, root: str, dst: str | None, leaves: dict, positions: dict,
              causal_shift=None) -> tuple[list[ir.Stmt], str | ir.Expr]:
        """(statements, operand) computing node `root` into tile `dst` (None: a temporary tile).
        `leaves` maps node ids to operands already held (Q K^T -> "s_acc", an input -> its tile
        and shape); `positions` the first row and column of the block (dims -2 and -1)."""
        nodes, uses = self._needed(root, leaves)
        shapes: dict[str, tuple[int, ...]] = {}
        values: dict[str, str | ir.Expr] = {}
        dtypes: dict[str, str] = {}   # a tile value's dtype
        for node_id, (operand, shape) in leaves.items():
            values[node_id], shapes[node_id] = operand, shape
            dtypes[node_id] = self.inputs.get(operand, "f32")
        free: list[str] = []
        owned: set[str] = {dst} if dst is not None else set()   # dst's own value is overwritten anyway
        out: list[ir.Stmt] = []

        def temp(dtype: str, shape: tuple[int, ...], reuse: list[str]) -> str:
            for pool in (reuse, free):
                for name in pool:
                    decl = self.decls.get(name, ir.RegDecl(name, "f32", self.full))   # dst: the scores
                    if (decl.dtype, decl.shape) == (dtype, shape):
                        pool.remove(name)
                        return name
            name = f"score{len(self.decls)}_t"
            self.decls[name] = ir.RegDecl(name, dtype, shape)
            owned.add(name)
            return name

        # The block-wide ops last and together: small tiles (per row, per key, per head) never
        # depend on a block-wide one.
        for node in nodes:
            shapes[node.id] = self._shape(node, shapes)
        for node in sorted(nodes, key=lambda n: shapes[n.id] == self.full):   # stable: topological
            shape = shapes[node.id]
            if node.op == "const":
                values[node.id] = F(float(node.attr("value")))
                continue
            if node.op == "position":
                t = temp("f32", shape, [])
                axis = 0 if node.attr("dim") == -2 else 1
                out.append(ir.TileIota(t, axis, positions[node.attr("dim")]))
                values[node.id], dtypes[node.id] = t, "f32"
                continue
            args = [values[i] for i in node.inputs]
            # integers from an i32 input are computed (and compared) in i32 tiles: the other
            # integer operands cast to i32 (positions) or written as integer constants
            exact = [k for k, i in enumerate(node.inputs) if self._integer(i)]
            if node.op == "where":
                exact = [k for k in exact if k > 0]   # the condition is read as non-zero, any dtype
            integer = bool(exact) and any(dtypes.get(node.inputs[k]) == "i32" for k in exact) and (
                not node.dtype.is_float and (node.op != "where" or len(exact) == 2)
                and (node.dtype.name != "bool" or len(exact) == len(node.inputs)))
            if integer:
                for k in exact:
                    i = node.inputs[k]
                    if isinstance(args[k], ir.FloatConst):
                        args[k] = ir.IntConst(int(args[k].value))
                    elif dtypes.get(i) != "i32":
                        cast = temp("i32", shapes[i], [])
                        out.append(ir.TileUnary("cast", cast, args[k]))
                        free.append(cast)   # read once, by this op (a temp is never the op's own dst)
                        args[k] = cast
            dead = []
            for i in node.inputs:
                uses[i] -= 1
                if uses[i] == 0 and isinstance(values[i], str) and values[i] in owned and values[i] not in dead:
                    dead.append(values[i])
            dtype = "i32" if integer and node.dtype.name != "bool" else node_dtype(node)
            if node.id == root and dst is not None and dtype == "f32":   # dst: the f32 scores
                target = dst
            else:
                target = temp(dtype, shape, dead)
            free.extend(d for d in dead if d != target)
            out += self._op(node, target, args, positions, causal_shift)
            values[node.id], dtypes[node.id] = target, dtype
        result = values[root]
        if dst is not None and result != dst:   # a 16-bit score rounded, then widened
            out.append(ir.TileUnary("cast", dst, result))
            result = dst
        return _fold_scalar_products(out), result

    def _integer(self, node_id: str) -> bool:
        """Whether a node's values are integers (an i32 input, positions, integer arithmetic on
        them, a whole Python number): those an i32 op may read."""
        node = self.fusion.node(node_id)
        return node.dtype.name == "i32" or (node.op == "const" and float(node.attr("value")).is_integer())

    def _needed(self, root: str, leaves: dict):
        """The nodes to compute for `root` (topological order) and the uses of each value."""
        needed, stack = set(), [root]
        while stack:
            node_id = stack.pop()
            if node_id in needed or node_id in leaves:
                continue
            needed.add(node_id)
            stack.extend(self.fusion.node(node_id).inputs)
        nodes = [n for n in self.fusion.nodes() if n.id in needed]
        uses = {node_id: 0 for node_id in needed | set(leaves)}
        for n in nodes:
            for i in n.inputs:
                uses[i] += 1
        uses[root] += 1
        return nodes, uses

    def _shape(self, node, shapes) -> tuple[int, ...]:
        if node.op == "const":
            return ()
        if node.op == "position":   # a query's index varies by row only, a key's by column only
            return (self.full[0], 1) if node.attr("dim") == -2 else (1, self.full[1])
        rows = max((shapes[i][0] for i in node.inputs if shapes[i]), default=1)
        cols = max((shapes[i][1] for i in node.inputs if shapes[i]), default=1)
        return (rows, cols)

    @staticmethod
    def _op(node, target: str, args: list, positions: dict, causal_shift) -> list[ir.Stmt]:
        op = node.op
        if op in UNARY_OPS:             # cast included: a copy, rounded to the target's dtype
            return [ir.TileUnary(op, target, args[0])]
        if op == "div" and isinstance(args[1], ir.FloatConst) and args[1].value not in (0.0, float("inf"), float("-inf")):
            # by a constant: one multiply (fp32 division is a sequence of instructions per element)
            return [ir.TileBinary("mul", target, args[0], F(1.0 / args[1].value))]
        if op in BINARY_OPS or op in COMPARE_OPS:
            return [ir.TileBinary(op, target, args[0], args[1])]
        if op == "logical_not":
            return [ir.TileBinary("eq", target, args[0], F(0.0))]
        if op == "where":
            return [ir.TileSelect(target, *args)]
        assert op == "causal_mask", op   # score.SCORE_OPS
        copy = [] if args[0] == target else [ir.TileUnary("cast", target, args[0])]
        return copy + [ir.TileMask(target, positions[-2], positions[-1], ir.Var("T"),
                                   causal_shift(node.attr("align")))]



def _fold_scalar_products(stmts: list[ir.Stmt]) -> list[ir.Stmt]:
    """`x = y * a` then `x = x * b` by constants is `x = y * (a b)`: one multiply per element
    fewer (softcapping's `tanh(s * scale / c)`). fp32 rounds a b once instead of the product
    twice: within an ulp of the reference's node-by-node result."""
    out: list[ir.Stmt] = []
    for s in stmts:
        prev = out[-1] if out else None
        if (isinstance(s, ir.TileBinary) and s.op == "mul" and isinstance(s.rhs, ir.FloatConst)
                and isinstance(prev, ir.TileBinary) and prev.op == "mul" and isinstance(prev.rhs, ir.FloatConst)
                and s.lhs == s.dst == prev.dst):
            out[-1] = ir.TileBinary("mul", prev.dst, prev.lhs, F(prev.rhs.value * s.rhs.value))
            continue
        out.append(s)
    return out
