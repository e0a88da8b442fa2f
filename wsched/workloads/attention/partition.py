"""Partition an attention fusion (matmul -> softmax -> matmul) into load and compute sub-DAGs.

    load    : for tile in persistent(batch x m-blocks): { tma.load Q ;
                                                         for k in kv-blocks: tma.load K ; tma.load V }
    compute : for tile in persistent(same):  { for k in kv-blocks: S = score(Q K^T) ; online softmax ;
                                                                   O += P V ;
                                               O /= l ; store O (and LSE) }

Q is its own channel (one slot, loaded once per tile); K and V are circular buffers stepped by
the kv loop. The softmax is online (running max and sum, O rescaled), so S and P never leave
registers. Between Q K^T and the softmax stands any score function (score.py); its masks may
narrow each tile's kv blocks, and an attention sink starts the online softmax.
"""

from __future__ import annotations

from dataclasses import dataclass

import networkx as nx
import torch

from wsched.partition import Channel, OperandLoad, Partition, dag_of_loads, param_name
from wsched.errors import FusionError
from wsched.names import OFFSETS
from wsched.schedule import ScheduleError
from wsched.target import PAGE_ROWS_ALIGN, WGMMA_OPERAND_DTYPES

from . import score
from .schedule import (VALUE_DIMS, AttentionSchedule, chunk_columns, head_dims_text, max_keys_per_block,
                       PAGED_SPLIT_KV_SPILLS, page_size_fits, paged_producer_registers)
from .loops import LOG2E, fixed_row_max, id_spans, kv_range_has_first, takes_tiles_from_counter, two_runs
from .score import ScoreFunction, SideInput


@dataclass(frozen=True)
class PagedCache:
    """K and V as `ws.paged(cache, block_table)`: caches [P, page_size, HK, D] (one shape) and
    an i32 [B, max_pages] table; a kv block of BN keys is `rows_per_load`-row TMA boxes, each
    from one page (BN / page_size pages a block, or a slice of one page)."""

    k_cache: object
    v_cache: object
    table: object
    page_size: int
    rows_per_load: int

    @property
    def table_param(self) -> str:
        return param_name(self.table.id)


@dataclass(frozen=True)
class VarlenBatch:
    """Q (and K and V) as `ws.varlen(packed, cu_seqlens)`: packed inputs [NQ, *heads, D] and
    [NK, *kv_heads, D], sequence b holding query rows cu_q[b] .. cu_q[b+1] - 1 and key rows
    cu_k[b] .. cu_k[b+1] - 1 (i32 [B + 1] inputs; one input where they are the same). The tiles
    walk each sequence's own m-blocks (`loops.varlen_lets`), each tile's S (and T) are its
    sequence's counts, and O and LSE are stored packed (`ws.packed`). K and V may instead be a
    cache, [B, HK, 1, T, D] or paged, with key lengths or not (k, v, cu_k None)."""

    q: object
    k: object | None
    v: object | None
    cu_q: object
    cu_k: object | None

    @property
    def cu_q_param(self) -> str:
        return param_name(self.cu_q.id)

    @property
    def cu_k_param(self) -> str | None:
        return None if self.cu_k is None else param_name(self.cu_k.id)


@dataclass(frozen=True)
class AttentionPayload:
    """What only the attention workload knows about its partition."""

    q: object
    k: object
    v: object
    out: object                    # the [..., S, D] output node
    lse: object | None             # the [..., S] logsumexp output node, if any
    score: ScoreFunction           # what stands between Q K^T and the softmax (score.py)
    batch: int                     # number of leading (batch / head) dims of q
    k_broadcast: tuple[bool, ...]  # per batch dim: K and V have extent 1 there (GQA / MQA)
    sink: SideInput | float | None = None   # the softmax's sink logit: an input, a constant or none
    packed: bool = False           # GQA packing: the last batch dim (G) and S form the tile rows
    paged: PagedCache | None = None   # K and V read from pages through a block table (ws.paged)
    varlen: VarlenBatch | None = None  # packed sequences of their own lengths (ws.varlen)

    @property
    def keys(self) -> str:
        """The kernel's name for the keys K and V hold: T, or the cache's T_cache where each
        sequence has its own length (the tile loop's `T` is then min(lengths[b], T_cache)), or
        T_packed, the rows of packed K and V (the tile loop's `T` is its sequence's keys)."""
        if self.varlen is not None and self.varlen.k is not None:
            return "T_packed"
        return "T" if self.score.lengths is None else "T_cache"

    @property
    def rows_may_see_nothing(self) -> bool:
        """Whether a query may see no key at all (O = 0, LSE = -inf): by a mask, or as a packed
        sequence without keys (every block that runs still shows each row a key)."""
        return self.score.rows_may_see_nothing or self.varlen is not None

    @property
    def queries(self) -> str:
        """The kernel's name for the query rows Q holds: S, or S_packed, the rows of a packed Q
        (the tile loop's `S` is then its sequence's queries)."""
        return "S" if self.varlen is None else "S_packed"

    @property
    def kernel_batch(self) -> int:
        """The batch dims the kernel walks: the last one joins the rows when packed."""
        return self.batch - 1 if self.packed else self.batch

    @property
    def scale(self) -> float:
        """The positive factor around the top of the score function, folded into the exp2."""
        return self.score.scale

    @property
    def causal(self) -> str | None:
        """None, or the causal mask's alignment when it is the only mask: "top_left" (key j is
        visible to query i if j <= i) or "bottom_right" (if j <= i + T - S: the last query sees
        all keys)."""
        return self.score.causal


def describe(part: Partition) -> str:
    """The partition as text: both loop nests and the channels."""
    a, s = part.payload, part.schedule
    bm, bn, d = s.tile
    batch = " x ".join(f"batch{i}" for i in range(a.batch))
    sf = a.score
    bound = fixed_row_max(a)
    plain = sf.inner == sf.qk and not sf.bias and (sf.causal is not None or not sf.masks)
    shift = "+T-S" if a.causal == "bottom_right" else ""
    kv = f"min(ceil(T/{bn}), ceil((m0+{bm}{shift})/{bn}))" if a.causal else f"ceil(T/{bn})"
    if not plain:
        spans = id_spans(a, s) is not None
        kv = "kv_first, kv_first + kv_tiles" if kv_range_has_first(sf) or spans \
            else ("kv_tiles" if any(m.analysed or m.alternatives for m in sf.masks) else f"ceil(T/{bn})")
        if two_runs(a, s):
            kv = "run_first, run_first + run_count), then range(run_next, run_next + kv_tiles - run_count"
    scores = ([f"      S = Q K^T * {a.scale:g}" + ("   causal mask on diagonal blocks" if a.causal else "")
               + "   key-tail mask on the last block",
               *(["      (bottom-right: rows with no visible key keep m = -1e30, store O = 0, LSE = -inf)"]
                 if a.causal == "bottom_right" else [])]
              if plain else score_lines(part.fusion, sf))
    order = "dynamic" if takes_tiles_from_counter(a, s) else "persistent"   # tiles from a counter
    handed = ", the producer hands each next tile over" if order == "dynamic" else ""
    lines = [f"partition of {part.fusion.name} (attention {s.short()})", "",
             "load sub-DAG  (producer: 1 warp of 1 warpgroup, elected thread)",
             (f"  for tile in {order}({batch} x ceil(S/{bm}) tiles):" if a.varlen is None else
              f"  for tile in {order}(batch1.. x (S_packed/{bm} + batch0) blocks, each sequence's own):"),
             f"    tma.load {(a.varlen or a).q.id} -> Q   {bm} x {d} once per tile   (channel q)",
             *([f"    T = min({sf.lengths.node.id}[b0], T_cache)   (this sequence's keys)"] if sf.lengths else []),
             *([f"    sequence b0 of the tile's block (a binary search over {a.varlen.cu_q.id}); S, T its queries and "
                f"keys, from {a.varlen.cu_q.id} and {a.varlen.cu_k.id}"] if a.varlen else []),
             f"    for k in range({kv}):",
             *(_load_lines(a, bn, d, s.value_dim)), "",
             f"compute sub-DAG  (consumers: {s.consumer_warpgroups} warpgroups x 64 query rows)",
             f"  for tile in {order}(same tiles, same order{handed}):",
             f"    for k in range({kv}):",
             *scores,
             *([f"      attention sink {a.sink if not isinstance(a.sink, SideInput) else a.sink.node.id}: the online "
                f"softmax starts at m = sink, l = 1 (a logit with no value row)"] if a.sink is not None else []),
             ("      online softmax: m = max(m, rowmax S); P = exp(S - m); l = l * c + rowsum P; O *= c"
              if bound is None else f"      softmax against the scores' bound m = {bound / LOG2E:g} (no row max, no "
                                    f"rescale): P = exp(S - m); l += rowsum P"),
             "      O += P V   (P in registers as the wgmma A operand)",
             f"    O /= l ; store {a.out.id} -> o" + (f" ; LSE = m + log l -> lse ({a.lse.id})"
                                                         if a.lse is not None else ""), "",
             "channels"]
    for c in part.channels:
        level = "once per tile" if c.level == "tile" else "per kv block"
        lines.append(f"  {c.name}: {c.stages} stage(s) x {c.bytes_per_stage} bytes, {level}, barriers "
                     f"{c.full}[{c.stages}] / {c.empty}[{c.stages}] (arrivals {s.consumer_warpgroups})")
    return "\n".join(lines) + "\n"


def _load_lines(a, bn: int, d: int, dv: int) -> list[str]:
    pc = a.paged
    if pc is None:
        rows = f"[k_start + k * {bn}..]" if a.varlen else ""
        return [f"      tma.load {(a.varlen or a).k.id}{rows} -> K[stage]   {bn} x {d}   (channel k)",
                f"      tma.load {(a.varlen or a).v.id}{rows} -> V[stage]   {bn} x {dv}   (channel v)"]
    n = bn // pc.rows_per_load
    pages = (f"{n} pages of {pc.page_size} keys" if n > 1 else
             f"{pc.rows_per_load} keys of one {pc.page_size}-key page")
    return [f"      page = {pc.table.id}[b0, key / {pc.page_size}]   for the block's {pages} "
            f"(past T: page P, read as zeros)",
            f"      tma.load {pc.k_cache.id}[page] -> K[stage]   {bn} x {d} in {n} box(es)   (channel k)",
            f"      tma.load {pc.v_cache.id}[page] -> V[stage]   {bn} x {dv} in {n} box(es)   (channel v)"]


def check_cache_values(part: Partition, tensors: dict) -> None:
    """Per-sequence key lengths within the cache's keys, and the block table entries a
    sequence's keys use (all of a row without lengths) naming pages of the cache; FusionError
    naming the sequence, the entry and the rule. The kernel never reads outside the cache either
    way (it clamps lengths, and a page outside the cache reads as zeros): this says the inputs
    are wrong instead of computing on zeros."""
    a = part.payload
    pc, lengths = a.paged, a.score.lengths
    if a.varlen is not None:   # offsets from 0 to the packed rows, non-decreasing
        from wsched.reference import check_cu_seqlens

        vl = a.varlen
        for cu, rows in ((vl.cu_q, vl.q), (vl.cu_k, vl.k)):
            if cu is not None:
                check_cu_seqlens(cu.id, tensors[param_name(cu.id)], tensors[param_name(rows.id)].shape[0], rows.id)
    if pc is None and lengths is None:
        return
    name = part.fusion.name
    if pc is not None:
        table = tensors[pc.table_param].detach().to("cpu", torch.int64)
        pages = tensors[param_name(pc.k_cache.id)].shape[0]
        keys = table.shape[1] * pc.page_size
    else:
        keys = tensors[param_name(a.k.id)].shape[-2]
    if lengths is not None:
        lens = tensors[lengths.param].detach().to("cpu", torch.int64)
        bad = ((lens < 0) | (lens > keys)).nonzero()
        if len(bad):
            b = int(bad[0, 0])
            raise FusionError(name, f"{lengths.node.id}[{b}] = {int(lens[b])}: a sequence's length must lie in "
                                    f"0..{keys} (the keys its cache row holds)")
    if pc is None:
        return
    used = (torch.arange(table.shape[1])[None, :] < (-(-lens // pc.page_size))[:, None]
            if lengths is not None else torch.ones_like(table, dtype=torch.bool))
    bad = (used & ((table < 0) | (table >= pages))).nonzero()
    if len(bad):
        b, i = (int(x) for x in bad[0])
        what = f"keys {i * pc.page_size}.. of sequence {b}"
        raise FusionError(name, f"{pc.table.id}[{b}, {i}] = {int(table[b, i])} ({what}) is not a page of "
                                f"{pc.k_cache.id}: block table entries a sequence uses must lie in 0..{pages - 1}")


def _same_sink(fusion, a, b) -> bool:
    """Whether two softmax / logsumexp nodes have one sink: the same node, or equal numbers."""
    sinks = [fusion.node(n.inputs[1]) if len(n.inputs) > 1 else None for n in (a, b)]
    if None in sinks:
        return sinks[0] is sinks[1]
    if sinks[0].op == sinks[1].op == "const":
        return sinks[0].attr("value") == sinks[1].attr("value")
    return sinks[0].id == sinks[1].id


def score_lines(fusion, sf) -> list[str]:
    """The score function of the compute sub-DAG, for `describe`."""
    def bounds(m) -> str:
        text = [f"j - i <= {b.value}" + (" + T - S" if b.shifted else "") for b in m.upper]
        text += [f"j - i >= {b.value}" for b in m.lower]
        text += [f"j <= {v}" for v in m.key_upper] + [f"j >= {v}" for v in m.key_lower]
        return " and ".join(text)

    inner = _between(fusion, sf.qk, sf.inner)
    lines = [f"      S = Q K^T -> {sf.inner}: {len(inner)} op(s) as tile ops on every block" if inner
             else "      S = Q K^T"]
    if sf.scale != 1.0:
        lines[0] += f"; * {sf.scale:g} folded into the exp2"
    for b in sf.bias:
        factors = "".join(f" * {f}" for f in b.factors)
        lines.append(f"      bias {b.node.id}: {b.coef:g}{factors} * (j - i) as {b.coef:g}{factors} * (j - r) on "
                     f"every block, r the row block's first query; the rest, the same along a row, on the LSE")
    for m in sf.masks:
        where = f"{m.node.id} = {m.node.op}(...)"
        if m.alternatives:
            union = " or ".join(f"({bounds(x)})" for x in m.alternatives)
            lines.append(f"      mask {where}: {union}: blocks beyond their hull skipped, masked where none "
                         f"shows a whole block")
        elif m.ids is not None:
            lines.append(f"      mask {where}: {m.ids[0].param} == {m.ids[1].param}: blocks outside each row "
                         f"block's span of ids skipped, masked outside its full run")
        else:
            lines.append(f"      mask {where}: " + (f"{bounds(m)}: blocks beyond it skipped, masked where cut"
                                                    if m.analysed else "applied on every block"))
    lines.append("      key-tail mask on the last block"
                 + ("; a row that sees no key stores O = 0, LSE = -inf"
                    if sf.rows_may_see_nothing else ""))
    for x in sf.inputs:
        what = "per kv block" if x.per_key else "once per tile"
        lines.append(f"      tile.load {x.param}_t <- {x.node.id} {x.node.type_str}, {what}")
    return lines


def _between(fusion, first: str, last: str) -> set:
    """The nodes on paths from `first` (excluded) to `last` (included)."""
    if first == last:
        return set()
    return (nx.descendants(fusion.graph, first) & nx.ancestors(fusion.graph, last)) | {last}


def sf_plain(sf: ScoreFunction) -> str | None:
    """Why GQA packing cannot take the score function `sf` (None: it can): packed rows are
    (head, query) pairs, so only a scale and masks bounded by diagonals (causal masks, causal or
    sliding-window `where`s: bounds on j - i, which the tile mask takes with the row's query
    position, row mod S) are packed; inputs read per query or per head are not, nor bounds on
    the key alone (a prefix) or unions."""
    if sf.inner != sf.qk or sf.bias:
        return "it computes on the scores"
    if any(not m.analysed or m.key_upper or m.key_lower or m.alternatives or m.ids for m in sf.masks):
        return ("it has masks other than bounds on j - i (causal masks, causal or sliding-window ws.where "
                "conditions): a bound on the key alone, a union or an unanalysed condition")
    if sf.inputs:
        return "it reads inputs"
    return None


def _check_packing(fail, why_not: str | None, k_broadcast: tuple[bool, ...], sink, batch: int) -> None:
    if not batch or not k_broadcast[-1]:
        fail("pack_gqa=True needs Q [..., G, S, D] against K and V [..., 1, T, D]: the G query heads that "
             "share a KV head in the dim before S, where K and V have extent 1")
    if why_not is not None:
        fail(f"pack_gqa=True takes a score function of a scale and masks bounded by diagonals only; this one: "
             f"{why_not}")
    if isinstance(sink, SideInput):
        fail("pack_gqa=True does not take a sink input (a per-head logit); use pack_gqa=False")


def page_size_of(fusion) -> int | None:
    """The declared page size of a paged K cache (`ws.paged`), if any and a number."""
    for n in fusion.nodes():
        if n.op == "paged":
            size = fusion.node(n.inputs[0]).shape[1]
            return size if isinstance(size, int) else None
    return None


def head_dim_of(fusion):
    """The head dim of the Q in Q @ K^T (None if not found)."""
    for n in fusion.nodes():
        if n.op == "matmul" and fusion.node(n.inputs[1]).op == "transpose":
            return fusion.node(n.inputs[0]).shape[-1]
    return None


def is_attention(fusion) -> bool:
    return any(n.op == "softmax" for n in fusion.nodes()) and sum(n.op == "matmul" for n in fusion.nodes()) == 2


def partition_attention(workload, fusion, schedule: AttentionSchedule) -> Partition:
    nodes = {n.id: n for n in fusion.nodes()}

    def fail(msg: str, node=None):
        where = f" ({node.id} = {node.op}(...) at {node.source})" if node is not None else ""
        raise ScheduleError(f"attention schedule for {fusion.name}: {msg}{where}")

    softmaxes = [n for n in nodes.values() if n.op == "softmax"]
    matmuls = [n for n in nodes.values() if n.op == "matmul"]
    if len(softmaxes) != 1 or len(matmuls) != 2:
        fail(f"expected matmul -> softmax -> matmul, found {len(matmuls)} matmul(s) and "
             f"{len(softmaxes)} softmax(es)")
    sm = softmaxes[0]
    if sm.attr("dim") != -1:
        fail("the softmax must run over the last dim (keys)", sm)
    pv = next((m for m in matmuls if m.inputs[0] == sm.id), None)
    if pv is None:
        fail("the second matmul must take the softmax as its left operand")
    qk = next(m for m in matmuls if m is not pv)

    scores = nodes[sm.inputs[0]]
    q, kt = nodes[qk.inputs[0]], nodes[qk.inputs[1]]
    if kt.op != "transpose" or {kt.attr("dim0"), kt.attr("dim1")} != {-1, -2}:
        fail("the first matmul must be Q @ K.transpose(-1, -2)", qk)
    k, v = nodes[kt.inputs[0]], nodes[pv.inputs[1]]
    paged = _paged_cache(nodes, q, k, v, schedule, fail)
    varlen = _varlen_batch(nodes, q, k, v, fail)
    loaded = ((varlen.q if varlen else q, paged.k_cache, paged.v_cache) if paged else
              (varlen.q, varlen.k or k, varlen.v or v) if varlen else (q, k, v))
    for name, node in zip(("Q", "K", "V"), loaded):
        if node.op != "input":
            fail(f"{name} must be a fusion input (it is loaded by TMA)", node)
        if node.dtype.name not in WGMMA_OPERAND_DTYPES:   # (a paged K / V: its cache)
            fail(f"{name} is {node.dtype.name}; wgmma takes {' or '.join(WGMMA_OPERAND_DTYPES)}", node)
    if len({q.dtype.name, k.dtype.name, v.dtype.name}) != 1:
        fail(f"Q, K, V dtypes differ ({q.dtype.name}, {k.dtype.name}, {v.dtype.name})")
    rank = len(q.shape)
    if len(k.shape) != rank or len(v.shape) != rank or rank < 3 or rank > 5:
        fail(f"Q, K, V must have one rank in 3..5 ([batch..., seq, head_dim]); got {len(q.shape)}, "
             f"{len(k.shape)}, {len(v.shape)}")
    d = q.shape[-1]
    if not isinstance(d, int):
        fail(f"the head dim of Q is the symbol {d!r}; declare it as a number ({head_dims_text()}) so "
             f"the kernel can be specialised for it", q)
    dv = v.shape[-1]
    if k.shape[-1] != d:
        fail(f"head dims of Q and K differ: Q {d}, K {k.shape[-1]}")
    if d not in VALUE_DIMS or dv != VALUE_DIMS[d]:
        fail(f"head dims Q/K {d}, V {dv} are not supported; head dims are {head_dims_text()}", v)
    if k.shape[-2] != v.shape[-2]:
        fail(f"K and V have different key lengths ({k.shape[-2]} vs {v.shape[-2]})")
    if d != schedule.head_dim:
        fail(f"the schedule's head dim (tile[2] = {schedule.head_dim}) differs from Q's head dim {d}")
    batch = rank - 2
    k_broadcast = tuple(k.shape[i] == 1 and q.shape[i] != 1 for i in range(batch))
    # Between Q K^T and the softmax: any elementwise score function and masks (score.py).
    roles = {q.id: "the Q of Q K^T", k.id: "the K of Q K^T", v.id: "the V of P @ V"}
    sink = score.sink_of(fusion, sm, qk, batch, fail, param_name)
    function = score.analyse(fusion, scores, qk, roles, batch, fail, param_name, shift_invariant=sink is None)
    costs = function.register_costs(fusion)
    widest = max_keys_per_block(schedule, tuple(kind for kind, _ in costs))
    if schedule.bn > widest:
        kind, node = next((kind, node) for kind, node in costs
                          if max_keys_per_block(schedule, (kind,)) == widest)
        fail(f"BN={schedule.bn} keys per block: the score function {kind}, which keeps more registers live "
             f"than plain attention; with head dim {d}, mma_inflight={schedule.mma_inflight} and "
             f"{schedule.consumer_warpgroups} consumer warpgroup(s) ptxas spills beyond BN={widest}; use "
             f"BN <= {widest}", node)

    packed = schedule.pack_gqa
    if packed:
        _check_packing(fail, sf_plain(function), k_broadcast, sink, batch)
    if varlen is not None:
        _check_varlen(fail, schedule, function, varlen)
    if schedule.splits_kv and sink is not None:
        fail(f"split_kv={schedule.split_kv} does not take an attention sink (its logit would count once per "
             f"split); use split_kv=1")

    stored = [nodes[o] for o in fusion.outputs]   # what the kernel stores; with varlen Q, packed
    outputs = _unpacked(nodes, stored, varlen, fail)
    out = next((o for o in outputs if o.id == pv.id or (o.op == "cast" and o.inputs[0] == pv.id)), None)
    if out is None:
        fail("the output of the second matmul (optionally cast) must be a fusion output")
    lse = next((o for o in outputs if o.op == "logsumexp"), None)
    if lse is not None and (lse.inputs[0] != scores.id or lse.attr("dim") != -1 or lse.attr("keepdim")):
        fail("the logsumexp output must reduce the softmax's input over the last dim", lse)
    if lse is not None and not _same_sink(fusion, lse, sm):
        fail("the logsumexp output must have the softmax's sink (ws.logsumexp(s, dim=-1, sink=...) with "
             "the same sink, or neither has one)", lse)
    extra = [o for o in outputs if o is not out and o is not lse]
    if extra:
        fail(f"outputs other than O and LSE cannot be fused: {[o.id for o in extra]}", extra[0])
    if out.dtype.name not in ("bf16", "f16"):
        fail(f"O is stored as bf16 or f16; add .to(ws.bf16) (it is {out.dtype.name})", out)
    packed_of = dict(zip((o.id for o in outputs), stored))
    out, lse = packed_of[out.id], (packed_of[lse.id] if lse is not None else None)

    bm, bn, _ = schedule.tile
    dt = q.dtype.name
    qk_chunk, v_chunk = (chunk_columns(x, q.dtype.itemsize) for x in (d, dv))
    q_load = OperandLoad(param_name(loaded[0].id), "q", "Q", "k", dt, (64, qk_chunk),
                         schedule.consumer_warpgroups * (d // qk_chunk))
    rows, per_block = (paged.rows_per_load, bn // paged.rows_per_load) if paged else (bn, 1)
    k_load = OperandLoad(param_name(loaded[1].id), "k", "K", "k", dt, (rows, qk_chunk), per_block * (d // qk_chunk))
    v_load = OperandLoad(param_name(loaded[2].id), "v", "V", "n", dt, (rows, v_chunk), per_block * (dv // v_chunk))
    channels = (Channel("q", 1, (q_load,), "q_full", "q_empty", level="tile"),
                Channel("k", schedule.stages, (k_load,), "k_full", "k_empty"),
                Channel("v", schedule.stages, (v_load,), "v_full", "v_empty"))
    compute_dag = nx.DiGraph()
    compute_dag.add_edges_from([("Q", "S"), ("K[stage]", "S"), ("S", "P"), ("P", "O"), ("V[stage]", "O"),
                                ("O", "store(o)")] + ([("S", "store(lse)")] if lse is not None else []))
    dims = {f"batch{i}": (q.id, i) for i in range(batch - packed)}
    if packed:
        dims["G"] = (q.id, batch - 1)
    payload = AttentionPayload(q, k, v, out, lse, function, batch, k_broadcast, sink, packed, paged, varlen)
    dims["S"] = (q.id, batch)
    if paged:   # the keys: max_pages x page_size (a host param)
        dims.update({"P": (paged.k_cache.id, 0), "MP": (paged.table.id, 1)})
    elif not varlen or not varlen.k:
        dims[payload.keys] = (k.id, batch)
    if varlen:   # packed [N, *heads, D]: the sequences from cu_seqlens (batch0 is a host param)
        keys = {name: dims[name] for name in ("P", "MP", payload.keys) if name in dims}
        dims = {f"batch{i}": (varlen.q.id, i) for i in range(1, batch)}
        dims.update({OFFSETS: (varlen.cu_q.id, 0), payload.queries: (varlen.q.id, 0), **keys})
        if varlen.k:
            dims[payload.keys] = (varlen.k.id, 0)
        else:   # the cache's sequences: [B, ...] beside offsets [B+1] (Fusion.bind checks the two agree)
            dims["batch0"] = (paged.table.id, 0) if paged else (k.id, 0)
    outputs = (out,) + ((lse,) if lse is not None else ())
    names = ("o",) + (("lse",) if lse is not None else ())
    return Partition(workload, fusion, schedule, channels, dag_of_loads(channels), compute_dag, outputs,
                     names, dims, ((payload.queries,) if varlen else ()) + (("MP",) if paged else (payload.keys,)),
                     payload)


def _varlen_batch(nodes, q, k, v, fail) -> VarlenBatch | None:
    """Q, K and V read as `ws.varlen` of packed inputs (all three or none; K and V of one
    cu_seqlens), or None."""
    if not any(x.op == "varlen" for x in (q, k, v)):
        return None
    if q.op != "varlen":
        fail("packed keys (ws.varlen K and V) need packed queries: Q must be ws.varlen(packed, cu_seqlens) too",
             next(x for x in (k, v) if x.op == "varlen"))
    if (k.op == "varlen") != (v.op == "varlen"):
        fail("K and V must both be ws.varlen(...) of one cu_seqlens, or neither (a cache)",
             next(x for x in (k, v) if x.op == "varlen"))
    if k.op != "varlen":   # packed queries against a cache: [B, HK, 1, T, D] or paged
        if k.shape[0] != q.shape[0]:
            fail(f"packed queries ({q.shape[0]} sequences) need a cache row per sequence: K [{k.shape[0]}, ...] is "
                 f"broadcast over them; declare the offsets [B+1] and the cache [B, ...]", k)
        return VarlenBatch(nodes[q.inputs[0]], None, None, nodes[q.inputs[1]], None)
    if k.shape[0] != q.shape[0]:
        fail(f"{nodes[k.inputs[1]].id} and {nodes[q.inputs[1]].id} must hold as many offsets (one per sequence, "
             f"plus one): {k.shape[0]} and {q.shape[0]} sequences", k)
    if k.inputs[1] != v.inputs[1]:
        fail("K and V must be ws.varlen(..., cu_seqlens) of one cu_seqlens (a sequence's keys and values are "
             "the same rows)", v)
    return VarlenBatch(*(nodes[x.inputs[0]] for x in (q, k, v)), nodes[q.inputs[1]], nodes[k.inputs[1]])


def _check_varlen(fail, schedule, function, varlen: VarlenBatch) -> None:
    """What packed sequences do not take (yet): GQA packing, split-KV, key lengths beside them."""
    if schedule.pack_gqa:
        fail("pack_gqa=True does not take ws.varlen sequences (a tile's rows are one sequence's queries of one "
             "head); use pack_gqa=False")
    if schedule.splits_kv:
        fail(f"split_kv={schedule.split_kv} does not take ws.varlen sequences; use split_kv=1")
    if function.lengths is not None and varlen.k is not None:
        fail(f"ws.key_lengths beside ws.varlen: a packed sequence's keys are its rows of "
             f"{varlen.k.id} (cu_seqlens {varlen.cu_k.id}); drop ws.key_lengths", function.lengths.node)


def _unpacked(nodes, stored: list, varlen: VarlenBatch | None, fail) -> list:
    """The fusion's outputs with ws.packed taken off: with ws.varlen Q each output must be
    ws.packed(x, cu_q) (rows of the packed queries), without it none may be."""
    if varlen is None:
        for o in stored:
            if o.op == "packed":
                fail("ws.packed outputs are the rows of ws.varlen sequences; Q, K and V are not ws.varlen", o)
        return stored
    for o in stored:
        if o.op != "packed" or o.inputs[1] != varlen.cu_q.id:
            fail(f"with ws.varlen sequences the outputs are packed rows: return ws.packed(x, {varlen.cu_q.id}) "
                 f"(O [NQ, heads, D], LSE [NQ, heads])", o)
        rows = -2 if nodes[o.inputs[0]].op in ("matmul", "cast") else -1   # O's queries, or the LSE's
        if o.attr("dim") != rows:
            fail(f"ws.packed must pack the queries (dim {rows} of {'O' if rows == -2 else 'the LSE'}), not dim "
                 f"{o.attr('dim')}; pass dim={rows}", o)
    return [nodes[o.inputs[0]] for o in stored]


def _paged_cache(nodes, q, k, v, schedule, fail) -> PagedCache | None:
    """K and V read through `ws.paged` (both or neither, one block table), or None."""
    if k.op != "paged" and v.op != "paged":
        return None
    if k.op != "paged" or v.op != "paged" or k.inputs[1] != v.inputs[1]:
        fail("K and V must both be ws.paged(...) of one block table (or neither)", k if k.op == "paged" else v)
    k_cache, table = nodes[k.inputs[0]], nodes[k.inputs[1]]
    v_cache = nodes[v.inputs[0]]
    if k_cache.shape != v_cache.shape:
        fail(f"the K and V caches must have one shape [pages, page_size, kv_heads, head_dim]: "
             f"{k_cache.type_str} and {v_cache.type_str}", v)
    if len(q.shape) != 5:
        fail(f"a paged K / V is [B, HK, 1, T, D]: write Q as [B, HK, G, S, D] (G query heads per KV head; "
             f"1 for multi-head attention), not {q.type_str}", q)
    bn, producer_registers = schedule.bn, schedule.producer_registers
    page_size = k_cache.shape[1]
    if not isinstance(page_size, int):
        fail(f"the page size of {k_cache.id} is the symbol {page_size!r}; declare it as a number (16, 32, 64, "
             f"...) so that the kernel's TMA boxes fit the pages", k)
    if not page_size_fits(page_size, bn):
        fail(f"page size {page_size}: TMA fills a kv block of {bn} keys from whole pages or slices of one page, "
             f"in boxes of a multiple of {PAGE_ROWS_ALIGN} rows; the page size must be a multiple of "
             f"{PAGE_ROWS_ALIGN} that divides {bn} or is a multiple of it (16, 32, 64, 128, 256, ...)", k)
    slices = bn // min(page_size, bn)
    need = paged_producer_registers(bn, page_size, schedule.splits_kv)
    if schedule.splits_kv and slices > 1 and (schedule.consumer_warpgroups, schedule.value_dim) in PAGED_SPLIT_KV_SPILLS:
        fail(f"split_kv={schedule.split_kv} with {slices} pages of {page_size} keys a block, head dim "
             f"{schedule.value_dim} and {schedule.consumer_warpgroups} consumer warpgroups: ptxas spills; use pages "
             f"of at least {bn} keys, one consumer warpgroup or split_kv=1", k)
    if producer_registers < need:
        fail(f"pages of {page_size} keys, {bn} keys a block: the producer holds the block's {slices} page "
             f"indices from the table reads to the TMA issues; producer_registers={producer_registers} spills, use "
             f"producer_registers >= {need}", k)
    return PagedCache(k_cache, v_cache, table, page_size, min(page_size, bn))

