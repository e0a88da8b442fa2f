"""The keyword of every loop-IR statement, in one table.

The printer writes these words, the parser takes the op or action off a variant keyword
(`tile.exp` -> op `exp`), and the verifier names statements by them in its messages.
grammar.lark spells the same words literally (a lark grammar cannot read a Python table);
tests/test_ir_text.py checks that its statement keywords are exactly the ones here.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import ir


@dataclass(frozen=True)
class Spelling:
    """How a statement type starts its line.

    `keyword` alone is the whole word (`mbarrier.wait`). With `field`, the keyword is a prefix
    completed by that field's value, one of `values` (`setmaxnreg.` + `inc`). With
    `alternate = (flag, word)`, a statement whose boolean field `flag` is set starts with `word`
    instead (`var` for a mutable `let`)."""

    keyword: str
    field: str | None = None
    values: tuple[str, ...] = ()
    alternate: tuple[str, str] | None = None

    def keywords(self) -> tuple[str, ...]:
        """Every keyword a statement of this type can start with."""
        if self.field is not None:
            return tuple(self.keyword + v for v in self.values)
        return (self.keyword,) + ((self.alternate[1],) if self.alternate else ())


SPELLINGS: dict[type, Spelling] = {
    ir.Let: Spelling("let", alternate=("mutable", "var")),
    ir.Assign: Spelling("set"),
    ir.For: Spelling("for"),
    ir.If: Spelling("if"),
    ir.Role: Spelling("role"),
    ir.ElectOne: Spelling("elect_one"),
    ir.Return: Spelling("return"),
    ir.Setmaxnreg: Spelling("setmaxnreg.", "action", ir.SETMAXNREG_ACTIONS),
    # synchronisation
    ir.MbarrierInit: Spelling("mbarrier.init"),
    ir.MbarrierArrive: Spelling("mbarrier.arrive"),
    ir.MbarrierArriveExpectTx: Spelling("mbarrier.arrive_expect_tx"),
    ir.MbarrierWait: Spelling("mbarrier.wait"),
    ir.MbarrierInval: Spelling("mbarrier.inval"),
    ir.FenceMbarrierInit: Spelling("fence.mbarrier_init"),
    ir.FenceProxyAsync: Spelling("fence.proxy.async"),
    ir.SyncThreads: Spelling("syncthreads"),
    ir.ClusterSync: Spelling("cluster.sync"),
    ir.NamedBarrierSync: Spelling("bar.sync"),
    ir.NamedBarrierArrive: Spelling("bar.arrive"),
    # asynchronous copies
    ir.TmaLoad: Spelling("tma.load"),
    ir.TmaStore: Spelling("tma.store"),
    ir.TmaCommit: Spelling("tma.commit"),
    ir.TmaWait: Spelling("tma.wait", alternate=("read", "tma.wait.read")),
    # wgmma
    ir.WgmmaFence: Spelling("wgmma.fence"),
    ir.Wgmma: Spelling("wgmma.mma"),
    ir.WgmmaCommit: Spelling("wgmma.commit"),
    ir.WgmmaWait: Spelling("wgmma.wait"),
    # register tiles
    ir.RegDecl: Spelling("reg"),
    ir.TileFill: Spelling("tile.fill"),
    ir.TileUnary: Spelling("tile.", "op", ir.TILE_UNARY_OPS),
    ir.TileBinary: Spelling("tile.", "op", ir.TILE_BINARY_OPS),
    ir.TileReduce: Spelling("tile.reduce.", "op", ir.REDUCE_OPS),
    ir.TileMask: Spelling("tile.mask"),
    ir.TileLoadGlobal: Spelling("tile.load"),
    ir.TileStoreGlobal: Spelling("tile.store"),
    ir.TileStoreSmem: Spelling("tile.store_smem"),
    # sliced epilogues and split-K
    ir.TileView: Spelling("tile.view"),
    ir.FenceGpu: Spelling("fence.acq_rel.gpu"),
    ir.AtomicInc: Spelling("atomic.inc"),
    ir.LoadShared: Spelling("ld.shared"),
    # attention score functions
    ir.TileIota: Spelling("tile.iota"),
    ir.TileSelect: Spelling("tile.select"),
    # paged KV caches
    ir.LoadGlobal: Spelling("ld.global"),
}

# The prefixes of the variant keywords, for the parser (one name per grammar terminal).
SETMAXNREG_PREFIX = SPELLINGS[ir.Setmaxnreg].keyword
TILE_OP_PREFIX = SPELLINGS[ir.TileUnary].keyword
TILE_REDUCE_PREFIX = SPELLINGS[ir.TileReduce].keyword


def keyword(s: ir.Stmt) -> str:
    """The word statement `s` starts with in the text form (`var`, `tile.exp`, `tma.wait.read`)."""
    spelling = SPELLINGS[type(s)]
    if spelling.field is not None:
        return spelling.keyword + getattr(s, spelling.field)
    if spelling.alternate is not None and getattr(s, spelling.alternate[0]):
        return spelling.alternate[1]
    return spelling.keyword


def all_keywords() -> frozenset[str]:
    """Every keyword any statement can start with."""
    return frozenset(k for spelling in SPELLINGS.values() for k in spelling.keywords())


def fixed_keywords() -> frozenset[str]:
    """The keywords that are whole words, not a prefix and a field value (the grammar spells
    these literally, the variant ones by pattern)."""
    return frozenset(k for spelling in SPELLINGS.values() if spelling.field is None
                     for k in spelling.keywords())
