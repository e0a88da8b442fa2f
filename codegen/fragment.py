"""The register-tile fragment layout (the wgmma accumulator layout) and the C++ names of a
tile's elements; `include/fragment.cuh` is its device side.

A register tile is spread over the 128 threads of a warpgroup: thread t (warp w = t / 32, lane l,
g = l / 4, q = l % 4) holds element d[4j + 2i + c] of a [64, N] tile at row 16w + g + 8i,
column 8j + 2q + c. f32 tiles are `float[N/2]`; 16-bit tiles are packed pairs (the c = 0, 1
elements) `__nv_bfloat162[N/4]` / `__half2[N/4]`. A row tile [1, N] holds columns 8j + 2q + c
(pairs when 16-bit), a column tile [64, 1] rows g + 8i, a scalar tile one value. The emitter
loops over a thread's fragment positions (fj, fi) = (j, i); `Tile.index` names the element there.

A linear tile [R, C] (`reg o: f32[4, 128] linear`, R dividing 128) lies row after row over the
warpgroup: thread t holds the n = R C / 128 consecutive elements of row t / (128 / R) from column
(t % (128 / R)) n, as `float[n]` (16-bit ones unpacked), looped over by `li`; a linear [R, 1]
tile holds its row's value in every thread of the row (LINEAR_ROWS).
"""

from __future__ import annotations

from dataclasses import dataclass

from wsched.target import DTYPE_BYTES, ELEMENT_TYPES, WARPGROUP_THREADS, WGMMA_M

__all__ = ["COL", "FULL", "LINEAR", "LINEAR_ROWS", "ROW", "SCALAR", "Tile"]

# Fragment layouts of a register tile: [64, N], [1, N], [64, 1] and [1, 1] tiles.
FULL, ROW, COL, SCALAR = "full", "row", "col", "scalar"
# Linear tiles: [R, C] elements, and [R, 1] values of each row.
LINEAR, LINEAR_ROWS = "linear", "linear rows"


@dataclass(frozen=True)
class Tile:
    name: str
    dtype: str
    rows: int
    cols: int
    # A `tile.view` is a slice of another tile's array: `name` is that array and `offset` (C++, a
    # compile-time constant once unrolled) the index of the view's first element in it.
    offset: str = ""
    linear: bool = False       # a linear tile (`reg ... linear`), not a fragment

    @property
    def layout(self) -> str:
        """How the tile is spread over the warpgroup: FULL, ROW, COL, SCALAR, LINEAR or LINEAR_ROWS."""
        if self.linear:
            return LINEAR_ROWS if self.cols == 1 else LINEAR
        if self.rows == WGMMA_M and self.cols > 1:
            return FULL
        if self.rows == 1 and self.cols > 1:
            return ROW
        if self.rows == WGMMA_M and self.cols == 1:
            return COL
        return SCALAR

    @property
    def packed(self) -> bool:
        """16-bit full and row tiles store the c = 0, 1 elements as one packed pair."""
        return DTYPE_BYTES[self.dtype] == 2 and self.layout in (FULL, ROW)

    @property
    def first_row(self) -> str | None:
        """C++ int: the tile row of this thread's first element (None: every thread holds row 0)."""
        if self.linear:
            return f"wsp::linear_row({self.threads_per_row})" if self.rows > 1 else None
        return "wsp::frag_row()" if self.layout in (FULL, COL) else None

    @property
    def first_col(self) -> str | None:
        """C++ int: the tile column of this thread's first element (None: column 0)."""
        if self.linear:
            return f"wsp::linear_col({self.threads_per_row}, {self.length})" if self.cols > 1 else None
        return "wsp::frag_col()" if self.layout in (FULL, ROW) else None

    @property
    def threads_per_row(self) -> int:
        """Threads that share a row of a linear tile."""
        return WARPGROUP_THREADS // self.rows

    @property
    def length(self) -> int:
        if self.linear:
            return 1 if self.cols == 1 else self.rows * self.cols // WARPGROUP_THREADS
        per_thread = {FULL: self.cols // 2, ROW: self.cols // 4, COL: 2, SCALAR: 1}[self.layout]
        return per_thread // 2 if self.packed else per_thread

    def declaration(self) -> str:
        element = ELEMENT_TYPES[self.dtype]
        return f"{element.cuda_pair if self.packed else element.cuda} {self.name}[{self.length}];"

    def index(self, c: int | None = None) -> str:
        """The C++ element (c given) or packed pair (c None) at fragment position (fj, fi)."""
        at = f"{self.offset} + " if self.offset else ""
        if self.layout == LINEAR:
            return f"{self.name}[{at}li]"
        if self.layout == FULL:
            if self.packed:
                base = f"{self.name}[{at}2 * fj + fi]"
            else:
                return f"{self.name}[{at}4 * fj + 2 * fi + {c}]"
        elif self.layout == ROW:
            if self.packed:
                base = f"{self.name}[{at}fj]"
            else:
                return f"{self.name}[{at}2 * fj + {c}]"
        elif self.layout == COL:
            return f"{self.name}[{at}fi]"
        else:
            return f"{self.name}[{at}0]"
        return base if c is None else f"{base}.{'xy'[c]}"

    def columns(self, col0: str, cols: int) -> "Tile":
        """The view of columns col0 .. col0 + cols - 1 (col0 a C++ multiple of 8): the same array,
        from the element that holds column col0 of this thread's rows."""
        per_group = self.length // (self.cols // 8)      # elements per 8-column group: 1, 2 or 4
        start = f"({col0}) / {8 // per_group}"
        offset = f"{self.offset} + {start}" if self.offset else start
        return Tile(self.name, self.dtype, self.rows, cols, offset)

    def read(self, c: int) -> str:
        """Element c of fragment position (fj, fi) as a float expression."""
        return ELEMENT_TYPES[self.dtype].to_float.format(self.index(c))

    @property
    def integer(self) -> bool:
        """An i32 tile: its elements are read as ints by the ops that compute in integers."""
        return self.dtype == "i32"
