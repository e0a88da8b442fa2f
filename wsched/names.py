"""Names the lowering gives its own roles, loop variables, lets, register tiles, buffers and
barriers: their one home.

The passes spell their names from here (or, for short-lived lets, as literals that a test checks
against `LOWERING_NAMES`: every name a lowered kernel declares that is not a kernel parameter must
be in this set). A fusion input whose name is one of these is passed to the kernel under
`<name>_in` (`wsched.partition.param_name`), so the IR never shadows a user's tensor.
"""

from __future__ import annotations

# Roles and the loop nests both roles run.
PRODUCER = "producer"
CONSUMER = "consumer"
TILE_VAR = "tile"
K_VAR = "k"
ACC = "acc"
K_BASE = "k_base"      # ring counter base when the k-iteration count varies per tile
K_COUNT = "kv_tiles"   # k iterations of this tile when it varies per tile (attention)
K_FIRST = "kv_first"   # the first kv block of a tile whose masks hide the blocks before it (attention)

# Matmul's epilogue walks the accumulator in slices (loop variable EPILOGUE_SLICE); split-K
# passes the split count as a host param and keeps fp32 partials and per-tile tickets in
# workspaces, each warpgroup's ticket read back through a smem slot.
EPILOGUE_SLICE = "j"
SPLITS = "splits"
PARTIALS = "partials"
TICKETS = "tickets"
UNIT_STEPS = "unit_steps"     # stream-K: the k steps of one CTA's range
TILE_SPLITS = "tile_splits"   # stream-K: how many CTAs' ranges one tile's k steps lie in
TICKET_SLOT = "ticket_slot"

# Attention's split-KV keeps each split's partial O, row max and row sum per tile (and takes the
# tickets, host param and ticket slot of split-K above).
PART_O = "part_o"
PART_M = "part_m"
PART_L = "part_l"
PART_ROWS = "part_rows"   # host param: the rows of a tile queries fill (GQA-packed decode: G x S of 64)
TILE_ROWS = "tile_rows"   # host param: the query rows between one tile's first and the next's (split-KV)
# split-KV merge: linear tiles of the merged O, row max and sum, a split's partial, max, sum and
# factor, the output cast, the rows' correction (docs/ir.md, "Linear tiles")
MERGE_O, MERGE_M, MERGE_L, MERGE_PART = "merge_o", "merge_m", "merge_l", "merge_part"
MERGE_MB, MERGE_LB, MERGE_C, MERGE_T = "merge_mb", "merge_lb", "merge_c", "merge_t"

# Named barrier ids (bar.sync): 0 is __syncthreads; WARPGROUP_BARRIER + wg syncs the 128 threads
# of one consumer warpgroup (a role of n warpgroups uses ids 1 .. n); ids from TOKEN_BARRIER on
# pass tokens between consumer warpgroups (attention ping-pong).
WARPGROUP_BARRIER = 1
TOKEN_BARRIER = 3

# A dynamic tile order (lowering/passes/dynamic_tiles.py): the next tile of a CTA from a global
# counter (a zeroed workspace), handed from the producer to the consumers through a smem ring.
TILE_COUNTER = "tile_counter"
TILE_SLOT = "tile_slot"
TILE_FULL = "tile_full"
TILE_EMPTY = "tile_empty"
TILE_NEXT = "tile_next"
TILE_COUNT = "tile_count"

# Attention's diagonal bias (score.DiagonalBias): its weight per tile, a term of it, and the
# [1, BN] tile of w * (j - r) a kv block adds to the scores.
BIAS_WEIGHT = "bias_w"
BIAS_TERM = "bias_u"
BIAS_COLS = "bias_t"

OFFSETS = "offsets"   # attention with packed sequences (ws.varlen): the entries of cu_seqlens
ID_SPANS = "id_spans"  # attention with a document mask: each row block's run of kv blocks (ir.SpanParam)

LOWERING_NAMES = frozenset({
    PRODUCER, CONSUMER, TILE_VAR, K_VAR, ACC, K_BASE, K_COUNT, K_FIRST,
    # circular buffer and wgmma protocol
    "s", "ph", "it", "tile_iter", "prev_s", "last_s", "prev_it", "prev_ph", "last_it", "last_ph",
    # dynamic tile order
    TILE_COUNTER, TILE_SLOT, TILE_FULL, TILE_EMPTY, TILE_NEXT, TILE_COUNT, "tile_s", "tile_ph", "fetched",
    # tile raster
    "m0", "n0", "tile_m", "tile_n", "tiles_m", "tiles_n", "num_tiles", "k_tiles", "group_size",
    "first_m", "first_n", "group_extent",
    # kernel scalars, builtins
    "wg", "cta_id", "num_ctas", "num_sms", "M", "N", "K", "S", "T",
    # attention
    "m_blocks", "m_block", "kv_blocks", "rest", "s_acc", "p", "o_acc", "m_run", "l_run", "m_blk",
    "corr", "o_t", "o", "lse", BIAS_WEIGHT, BIAS_TERM, BIAS_COLS, "heads", "G", "work", "kv_all", "kv_per", "kv_skip", PART_O, PART_M, PART_L, PART_ROWS, TILE_ROWS, MERGE_O, MERGE_M, MERGE_L, MERGE_PART,
    MERGE_MB, MERGE_LB, MERGE_C, MERGE_T, "chunk", "first_split", "in_group", "section", "first_head", "section_heads", "in_section",
    # attention: packed sequences (ws.varlen)
    ID_SPANS, "span_first", "span_count", "span_full", "span_fulls",
    "run_a0", "run_a1", "run_b0", "run_b1", "run_first", "run_count", "run_next",
    OFFSETS, "S_packed", "T_packed", "search_steps", "v_block", "seq", "span", "step", "half", "mid", "cu_mid",
    "q_start", "q_end", "k_start", "head", "kv_head", "go", "q_off0", "q_off1", "k_off0", "k_off1",
    # outputs, buffers, barriers
    "out", "A", "B", "Q", "V", "full", "empty",
    # matmul: epilogue slices and split-K
    EPILOGUE_SLICE, SPLITS, PARTIALS, TICKETS, TICKET_SLOT, ACC + "_" + EPILOGUE_SLICE, "num_units", "split", "out_tile", "k_begin",
    "k_end", "k_count", "ticket", "last_split", "src_split", "part_t", "slice_t",
    # matmul: stream-K
    UNIT_STEPS, TILE_SPLITS, "sk_begin", "sk_end", "sk_last", "tile_k0", "first_cta", "hand_over",
})
