"""Attention fusions shared by the attention tests, the example and the benchmark."""

import itertools
import math

import torch

import wsched as ws
from wsched.workloads.attention.schedule import VALUE_DIMS


def dims_text(head_dim: int) -> str:
    """"d128", or "d192v128" where V's head dim differs (in names of fusions and benchmark rows)."""
    value_dim = VALUE_DIMS.get(head_dim, head_dim)
    return f"d{head_dim}" + (f"v{value_dim}" if value_dim != head_dim else "")


def make_attention(head_dim: int, causal: bool | str = False, lse: bool = False, gqa: bool = False,
                   name: str | None = None, dtype=ws.bf16):
    """softmax(Q K^T / sqrt(d)) V over [B, H, S, D] (or [B, Hkv, G, S, D] with K/V broadcast over G);
    V and O have the head dim the kernels implement beside D (128 beside 192, else D).
    The default name encodes the variant, so equal variants give equal kernels (one build)."""
    name = name or (f"attn_{dims_text(head_dim)}{'_causal' if causal else ''}"
                    f"{'_br' if causal == 'bottom_right' else ''}{'_lse' if lse else ''}"
                    f"{'_gqa' if gqa else ''}_{dtype.name}")
    scale = 1.0 / math.sqrt(head_dim)
    dv = VALUE_DIMS.get(head_dim, head_dim)
    if gqa:
        def attention(q: ws.Tensor[dtype, "B", "HK", "G", "S", head_dim],
                      k: ws.Tensor[dtype, "B", "HK", 1, "T", head_dim],
                      v: ws.Tensor[dtype, "B", "HK", 1, "T", dv]):
            return _body(q, k, v, scale, causal, lse, dtype)
    else:
        def attention(q: ws.Tensor[dtype, "B", "H", "S", head_dim],
                      k: ws.Tensor[dtype, "B", "H", "T", head_dim],
                      v: ws.Tensor[dtype, "B", "H", "T", dv]):
            return _body(q, k, v, scale, causal, lse, dtype)
    attention.__name__ = name
    return ws.fusion(attention)


def _body(q, k, v, scale, causal, lse, dtype):
    s = ws.matmul(q, k.transpose(-1, -2)) * scale
    if causal:
        s = ws.causal_mask(s, align="bottom_right" if causal == "bottom_right" else "top_left")
    o = ws.matmul(ws.softmax(s, dim=-1), v).to(dtype)
    return (o, ws.logsumexp(s, dim=-1)) if lse else o


def make_paged_attention(head_dim: int, page_size: int, causal: bool = False, lengths: bool = True,
                         lse: bool = False, dtype=ws.bf16):
    """Attention of Q [B, HK, G, S, D] against a paged K / V cache ([pages, page_size, HK, D]
    through an i32 block table [B, max_pages]), each sequence holding its first seq_lens[b] keys
    (`lengths`); `causal`: bottom-right, aligned to each sequence's length (a chunk of S new
    tokens at the end of its cache). Without `lengths` the fusion takes no seq_lens."""
    scale = 1.0 / math.sqrt(head_dim)
    name = (f"paged{page_size}_d{head_dim}{'_causal' if causal else ''}{'' if lengths else '_full'}"
            f"{'_lse' if lse else ''}_{dtype.name}")

    def scores(q, k_cache, block_table, seq_lens):
        s = ws.matmul(q, ws.paged(k_cache, block_table).transpose(-1, -2)) * scale
        s = ws.key_lengths(s, seq_lens) if seq_lens is not None else s
        return ws.causal_mask(s, align="bottom_right") if causal else s

    def finish(s, v_cache, block_table):
        o = ws.matmul(ws.softmax(s, dim=-1), ws.paged(v_cache, block_table)).to(dtype)
        return (o, ws.logsumexp(s, dim=-1)) if lse else o

    if lengths:
        def attention(q: ws.Tensor[dtype, "B", "HK", "G", "S", head_dim],
                      k_cache: ws.Tensor[dtype, "P", page_size, "HK", head_dim],
                      v_cache: ws.Tensor[dtype, "P", page_size, "HK", head_dim],
                      block_table: ws.Tensor[ws.i32, "B", "MP"], seq_lens: ws.Tensor[ws.i32, "B"]):
            return finish(scores(q, k_cache, block_table, seq_lens), v_cache, block_table)
    else:
        def attention(q: ws.Tensor[dtype, "B", "HK", "G", "S", head_dim],
                      k_cache: ws.Tensor[dtype, "P", page_size, "HK", head_dim],
                      v_cache: ws.Tensor[dtype, "P", page_size, "HK", head_dim],
                      block_table: ws.Tensor[ws.i32, "B", "MP"]):
            return finish(scores(q, k_cache, block_table, None), v_cache, block_table)
    attention.__name__ = name
    return ws.fusion(attention)


def paged_inputs(lens, page_size, head_dim, hk=2, g=2, s=1, spare_pages=3, seed=0, device="cpu",
                 dtype=torch.bfloat16):
    """Q, the K and V caches, the block table and the lengths for `make_paged_attention`: every
    sequence's pages shuffled across the cache beside spare pages no table names; a table's unused
    tail entries name page 0 (as serving engines pad them)."""
    gen = torch.Generator().manual_seed(seed)
    need = [max(1, -(-n // page_size)) for n in lens]
    pages = sum(need) + spare_pages
    order = torch.randperm(pages, generator=gen)
    table = torch.zeros(len(lens), max(need), dtype=torch.int32)
    at = 0
    for b, n in enumerate(need):
        table[b, :n] = order[at:at + n].int()
        at += n
    q = torch.randn((len(lens), hk, g, s, head_dim), generator=gen)
    caches = [torch.randn((pages, page_size, hk, head_dim), generator=gen) for _ in range(2)]
    return [x.to(dtype).to(device) for x in (q, *caches)] + [table.to(device),
                                                              torch.tensor(lens, dtype=torch.int32, device=device)]


def attention_inputs(B, H, S, T, D, device="cpu", seed=0, gqa_groups=None, dtype=torch.bfloat16):
    """Q, K, V of random normal values; V of the head dim the kernels implement beside D."""
    g = torch.Generator().manual_seed(seed)
    dv = VALUE_DIMS.get(D, D)
    if gqa_groups:
        shapes = [(B, H // gqa_groups, gqa_groups, S, D), (B, H // gqa_groups, 1, T, D), (B, H // gqa_groups, 1, T, dv)]
    else:
        shapes = [(B, H, S, D), (B, H, T, D), (B, H, T, dv)]
    return [torch.randn(s, generator=g).to(dtype).to(device) for s in shapes]


# --- score functions and masks between Q K^T and the softmax (issue 11) -----------------------

VARIANTS = ("causal", "window", "softcap", "alibi", "document", "document_causal", "softcap_window", "sinks")


def make_variant(head_dim: int, variant: str, gqa: bool = False, lse: bool = True, window: int = 100,
                 softcap: float = 30.0, name: str | None = None, dtype=ws.bf16):
    """Attention with a score function written in the DSL, as a model would:

        causal          ws.where(j <= i, s, -ws.inf)
        window          ws.where((j <= i) & (i - j < window), s, -ws.inf)       (Mistral)
        softcap         softcap * tanh(s / softcap), causal                        (Gemma 2)
        alibi           s + slope[h] * (j - i), causal                             (ALiBi)
        document        ws.where(doc_q == doc_k, s, -ws.inf)                       (packed sequences)
        document_causal document mask and causal
        softcap_window  softcap and the causal sliding window
        sinks           causal, with a learned logit per head in the softmax's denominator

    ALiBi reads a slope per head ([H, 1, 1]; [HK, G, 1, 1] with GQA), sinks a logit per head
    (the same shape), the document masks the
    document id of every query ([B, 1, S, 1]) and key ([B, 1, 1, T]): `variant_inputs` makes them."""
    assert variant in VARIANTS, variant
    scale = 1.0 / math.sqrt(head_dim)
    name = name or f"attn_{dims_text(head_dim)}_{variant}{'_lse' if lse else ''}{'_gqa' if gqa else ''}_{dtype.name}"

    def body(q, k, v, *extra):
        s = ws.matmul(q, k.transpose(-1, -2)) * scale
        i, j = ws.positions(s)
        if variant in ("softcap", "softcap_window"):
            s = softcap * ws.tanh(s / softcap)
        if variant == "alibi":
            s = s + extra[0] * (j - i)
        if variant in ("softcap", "alibi"):
            s = ws.causal_mask(s)
        if variant in ("causal", "sinks"):
            s = ws.where(j <= i, s, -ws.inf)
        if variant in ("window", "softcap_window"):
            s = ws.where((j <= i) & (i - j < window), s, -ws.inf)
        if variant.startswith("document"):
            s = ws.where(extra[0] == extra[1], s, -ws.inf)
        if variant == "document_causal":
            s = ws.where(j <= i, s, -ws.inf)
        sink = extra[0] if variant == "sinks" else None
        o = ws.matmul(ws.softmax(s, dim=-1, sink=sink), v).to(dtype)
        return (o, ws.logsumexp(s, dim=-1, sink=sink)) if lse else o

    heads = ("HK", "G") if gqa else ("H",)
    kv_heads = ("HK", 1) if gqa else ("H",)
    ones = (1,) * len(heads)
    q_spec = ws.Tensor[(dtype, "B", *heads, "S", head_dim)]
    k_spec = ws.Tensor[(dtype, "B", *kv_heads, "T", head_dim)]
    v_spec = ws.Tensor[(dtype, "B", *kv_heads, "T", VALUE_DIMS.get(head_dim, head_dim))]
    if variant == "alibi":
        def attention(q: q_spec, k: k_spec, v: v_spec, slope: ws.Tensor[(ws.f32, *heads, 1, 1)]):
            return body(q, k, v, slope)
    elif variant == "sinks":
        def attention(q: q_spec, k: k_spec, v: v_spec, sink: ws.Tensor[(ws.f32, *heads, 1, 1)]):
            return body(q, k, v, sink)
    elif variant.startswith("document"):
        def attention(q: q_spec, k: k_spec, v: v_spec, doc_q: ws.Tensor[(ws.i32, "B", *ones, "S", 1)],
                      doc_k: ws.Tensor[(ws.i32, "B", *ones, 1, "T")]):
            return body(q, k, v, doc_q, doc_k)
    else:
        def attention(q: q_spec, k: k_spec, v: v_spec):
            return body(q, k, v)
    attention.__name__ = name
    return ws.fusion(attention)


def flex_mods(variant: str, extra: list, window: int = 100, softcap: float = 30.0) -> tuple:
    """FlexAttention's (score_mod, mask_mod) of a `make_variant` fusion (not sinks: Flex has no sink
    logit), on the same inputs (`extra`: the fusion's inputs after Q, K, V, as `variant_inputs`
    makes them) and the same window and cap."""
    def causal(b, h, q, kv):
        return q >= kv

    def in_window(b, h, q, kv):
        return (q >= kv) & (q - kv < window)

    def capped(score, b, h, q, kv):
        return softcap * torch.tanh(score / softcap)

    if variant == "alibi":
        slope = extra[0].reshape(-1)
        return (lambda score, b, h, q, kv: score + slope[h] * (kv - q)), causal
    if variant.startswith("document"):
        doc = extra[0].reshape(extra[0].shape[0], -1)
        if variant == "document_causal":
            return None, lambda b, h, q, kv: (doc[b, q] == doc[b, kv]) & (q >= kv)
        return None, lambda b, h, q, kv: doc[b, q] == doc[b, kv]
    return {"causal": (None, causal), "window": (None, in_window), "softcap": (capped, causal),
            "softcap_window": (capped, in_window)}[variant]


def variant_inputs(fusion, B, H, S, T, D, device="cpu", seed=0, gqa_groups=None, dtype=torch.bfloat16,
                   documents=4):
    """Q, K, V and the extra inputs of a `make_variant` fusion: ALiBi slopes 2^(-8 h / H), document
    ids of `documents` packed documents of random lengths (queries and keys share the ids of their
    first min(S, T) positions)."""
    q, k, v = attention_inputs(B, H, S, T, D, device=device, seed=seed, gqa_groups=gqa_groups, dtype=dtype)
    extra = [node for node in fusion.inputs[3:]]
    if not extra:
        return [q, k, v]
    g = torch.Generator().manual_seed(seed + 1)
    if extra[0].id == "slope":
        slope = torch.tensor([2.0 ** (-8.0 * (h + 1) / H) for h in range(H)])
        return [q, k, v, slope.reshape(*q.shape[1:-2], 1, 1).to(device)]
    if extra[0].id == "sink":   # logits about as large as the scores' (a sink takes a share of every row)
        return [q, k, v, (torch.randn(*q.shape[1:-2], 1, 1, generator=g) + 2).to(device)]
    length = max(S, T)
    cuts = torch.sort(torch.randperm(length - 1, generator=g)[:documents - 1] + 1).values
    ids = torch.zeros(B, length, dtype=torch.int32)
    for b in range(B):
        shift = int(torch.randint(0, max(length // 8, 1), (1,), generator=g))
        ids[b] = torch.bucketize(torch.arange(length) + shift, cuts, right=True).to(torch.int32)
    ones = (1,) * (q.dim() - 3)
    doc_q = ids[:, :S].reshape(B, *ones, S, 1).contiguous().to(device)
    doc_k = ids[:, :T].reshape(B, *ones, 1, T).contiguous().to(device)
    return [q, k, v, doc_q, doc_k]


def make_varlen_attention(head_dim: int, causal: bool | str = False, lse: bool = True, gqa: bool = False,
                          dtype=ws.bf16):
    """Attention over packed sequences (FlashAttention's varlen): Q [NQ, H, D] (GQA: [NQ, HK, G,
    D] against K / V [NK, HK, 1, D]), sequence b holding query rows cu_q[b] .. cu_q[b+1] - 1 and
    key rows cu_k[b] .. cu_k[b+1] - 1; O (and LSE) returned packed like Q."""
    scale = 1.0 / math.sqrt(head_dim)
    dv = VALUE_DIMS.get(head_dim, head_dim)
    name = (f"varlen_{dims_text(head_dim)}{'_causal' if causal else ''}{'_br' if causal == 'bottom_right' else ''}"
            f"{'_lse' if lse else ''}{'_gqa' if gqa else ''}_{dtype.name}")

    def body(q, k, v, cu_q, cu_k):
        s = ws.matmul(ws.varlen(q, cu_q), ws.varlen(k, cu_k).transpose(-1, -2)) * scale
        if causal:
            s = ws.causal_mask(s, align="bottom_right" if causal == "bottom_right" else "top_left")
        o = ws.packed(ws.matmul(ws.softmax(s, dim=-1), ws.varlen(v, cu_k)).to(dtype), cu_q)
        return (o, ws.packed(ws.logsumexp(s, dim=-1), cu_q)) if lse else o

    if gqa:
        def attention(q: ws.Tensor[dtype, "NQ", "HK", "G", head_dim], k: ws.Tensor[dtype, "NK", "HK", 1, head_dim],
                      v: ws.Tensor[dtype, "NK", "HK", 1, dv], cu_q: ws.Tensor[ws.i32, "B1"],
                      cu_k: ws.Tensor[ws.i32, "B1"]):
            return body(q, k, v, cu_q, cu_k)
    else:
        def attention(q: ws.Tensor[dtype, "NQ", "H", head_dim], k: ws.Tensor[dtype, "NK", "H", head_dim],
                      v: ws.Tensor[dtype, "NK", "H", dv], cu_q: ws.Tensor[ws.i32, "B1"],
                      cu_k: ws.Tensor[ws.i32, "B1"]):
            return body(q, k, v, cu_q, cu_k)
    attention.__name__ = name
    return ws.fusion(attention)


def varlen_inputs(q_lens, k_lens, heads: int, head_dim: int, kv_heads: int | None = None, seed: int = 0,
                  device: str = "cpu", dtype=torch.bfloat16):
    """Packed q, k, v (GQA where kv_heads is given: q [NQ, HK, G, D], k / v [NK, HK, 1, D]) and
    the i32 offsets cu_q, cu_k of sequences with these query and key counts."""
    g = torch.Generator().manual_seed(seed)
    dv = VALUE_DIMS.get(head_dim, head_dim)
    cu_q, cu_k = (torch.tensor([0] + list(itertools.accumulate(lens)), dtype=torch.int32) for lens in (q_lens, k_lens))
    nq, nk = int(cu_q[-1]), int(cu_k[-1])
    q_heads = (kv_heads, heads // kv_heads) if kv_heads else (heads,)
    kv = (kv_heads, 1) if kv_heads else (heads,)
    q = torch.randn(nq, *q_heads, head_dim, generator=g)
    k = torch.randn(nk, *kv, head_dim, generator=g)
    v = torch.randn(nk, *kv, dv, generator=g)
    return tuple(x.to(device=device, dtype=dtype) for x in (q, k, v)) + (cu_q.to(device), cu_k.to(device))


def make_varlen_paged_attention(head_dim: int, page_size: int | None, causal: bool = True, lse: bool = True,
                                dtype=ws.bf16):
    """Packed queries against a KV cache (a serving engine's mixed batch: chunks of new tokens
    per sequence, FlashAttention's varlen with a block table and seqused_k): Q [NQ, HK, G, D]
    with i32 offsets cu_q [B+1], K / V paged ([pages, page_size, HK, D] through a [B, max_pages]
    table; contiguous [B, HK, 1, T, D] where page_size is None) holding seq_lens[b] keys of
    sequence b, bottom-right causal per sequence; O and LSE packed like Q."""
    scale = 1.0 / math.sqrt(head_dim)
    name = (f"varlen_{'paged' + str(page_size) if page_size else 'cache'}_d{head_dim}{'_causal' if causal else ''}"
            f"{'_lse' if lse else ''}_{dtype.name}")

    def body(q, k, v, cu_q, seq_lens):
        s = ws.key_lengths(ws.matmul(ws.varlen(q, cu_q), k.transpose(-1, -2)) * scale, seq_lens)
        s = ws.causal_mask(s, align="bottom_right") if causal else s
        o = ws.packed(ws.matmul(ws.softmax(s, dim=-1), v).to(dtype), cu_q)
        return (o, ws.packed(ws.logsumexp(s, dim=-1), cu_q)) if lse else o

    if page_size:
        def attention(q: ws.Tensor[dtype, "NQ", "HK", "G", head_dim],
                      k_cache: ws.Tensor[dtype, "P", page_size, "HK", head_dim],
                      v_cache: ws.Tensor[dtype, "P", page_size, "HK", head_dim],
                      block_table: ws.Tensor[ws.i32, "B", "MP"], cu_q: ws.Tensor[ws.i32, "B+1"],
                      seq_lens: ws.Tensor[ws.i32, "B"]):
            return body(q, ws.paged(k_cache, block_table), ws.paged(v_cache, block_table), cu_q, seq_lens)
    else:
        def attention(q: ws.Tensor[dtype, "NQ", "HK", "G", head_dim], k: ws.Tensor[dtype, "B", "HK", 1, "T", head_dim],
                      v: ws.Tensor[dtype, "B", "HK", 1, "T", head_dim], cu_q: ws.Tensor[ws.i32, "B+1"],
                      seq_lens: ws.Tensor[ws.i32, "B"]):
            return body(q, k, v, cu_q, seq_lens)
    attention.__name__ = name
    return ws.fusion(attention)


def varlen_paged_inputs(q_lens, k_lens, page_size, head_dim, hk=2, g=2, seed=0, device="cpu", dtype=torch.bfloat16):
    """Inputs of `make_varlen_paged_attention`: packed Q [sum(q_lens), hk, g, D], the caches
    (paged as `paged_inputs` makes them, or contiguous [B, hk, 1, max(k_lens), D] where page_size
    is None), the table, cu_q and the key lengths."""
    gen = torch.Generator().manual_seed(seed)
    cu_q = torch.tensor([0] + list(itertools.accumulate(q_lens)), dtype=torch.int32)
    q = torch.randn((int(cu_q[-1]), hk, g, head_dim), generator=gen).to(dtype).to(device)
    lens = torch.tensor(k_lens, dtype=torch.int32, device=device)
    if page_size is None:
        t = max(max(k_lens), 1)
        k, v = (torch.randn((len(k_lens), hk, 1, t, head_dim), generator=gen).to(dtype).to(device) for _ in range(2))
        return [q, k, v, cu_q.to(device), lens]
    _, k_cache, v_cache, table, _ = paged_inputs(k_lens, page_size, head_dim, hk=hk, g=g, seed=seed, device=device,
                                                 dtype=dtype)
    return [q, k_cache, v_cache, table, cu_q.to(device), lens]


def make_biased(spelling, sink: bool = False, per_query: bool = False, d: int = 64, align: str = "top_left"):
    """Causal attention with a bias spelt by `spelling(s, i, j, slope, per_query)`, s the scores
    times 1/8, slope one number per head, per_query one per query (an input with `per_query`);
    LSE out; with `sink`, the slope is also a sink logit."""
    def body(q, k, v, slope, per_query=None):
        s = ws.matmul(q, k.transpose(-1, -2)) * 0.125
        i, j = ws.positions(s)
        s = ws.causal_mask(spelling(s, i, j, slope, per_query), align=align)
        logit = slope if sink else None
        return (ws.matmul(ws.softmax(s, dim=-1, sink=logit), v).to(ws.bf16),
                ws.logsumexp(s, dim=-1, sink=logit))

    x_spec = ws.Tensor[(ws.bf16, "B", "H", "S", d)]
    kv_spec = ws.Tensor[(ws.bf16, "B", "H", "T", d)]
    if per_query:
        def attention(q: x_spec, k: kv_spec, v: kv_spec, slope: ws.Tensor[ws.f32, "H", 1, 1],
                      per_query: ws.Tensor[ws.f32, "B", "H", "S", 1]):
            return body(q, k, v, slope, per_query)
    else:
        def attention(q: x_spec, k: kv_spec, v: kv_spec, slope: ws.Tensor[ws.f32, "H", 1, 1]):
            return body(q, k, v, slope)
    return ws.fusion(attention)


def biased_inputs(B, H, S, T, d=64, seed=0, per_query=False, device="cpu"):
    """Q, K, V and the inputs of `make_biased`: ALiBi slopes 2^(-8 h / H), a number per query."""
    q, k, v = attention_inputs(B, H, S, T, d, seed=seed, device=device)
    gen = torch.Generator().manual_seed(seed)
    slope = 2.0 ** (-8 * torch.arange(1, H + 1, dtype=torch.float32) / H)
    extra = [slope.reshape(H, 1, 1)] + ([torch.randn(B, H, S, 1, generator=gen)] if per_query else [])
    return [q, k, v, *(x.to(device) for x in extra)]


def union_mask(head_dim: int, kind: str, prefix: int = 300, window: int = 256, sinks: int = 4, lse: bool = True):
    """prefix_lm: (j <= i) | (j < prefix), a causal mask with a bidirectional prefix;
    streaming: ((j <= i) & (i - j < window)) | (j < sinks), a sliding window that also keeps
    the first `sinks` keys (StreamingLLM); prefix_window: the prefix LM and, as a second mask,
    i - j < window."""
    def attention(q: ws.Tensor[ws.bf16, "B", "H", "S", head_dim], k: ws.Tensor[ws.bf16, "B", "H", "T", head_dim],
                  v: ws.Tensor[ws.bf16, "B", "H", "T", head_dim]):
        s = ws.matmul(q, k.transpose(-1, -2)) * head_dim ** -0.5
        i, j = ws.positions(s)
        keep = ((j <= i) & (i - j < window)) | (j < sinks) if kind == "streaming" else (j <= i) | (j < prefix)
        s = ws.where(keep, s, -ws.inf)
        if kind == "prefix_window":   # and a window of its own: the union's hull, bounded by the window
            s = ws.where(i - j < window, s, -ws.inf)
        o = ws.matmul(ws.softmax(s, dim=-1), v).to(ws.bf16)
        return (o, ws.logsumexp(s, dim=-1)) if lse else o
    attention.__name__ = f"attn_{kind}_d{head_dim}{'_lse' if lse else ''}"
    return ws.fusion(attention)
