"""Attention fusions shared by the attention tests, the example and the benchmark."""

import math

import torch

import wsched as ws


def make_attention(head_dim: int, causal: bool | str = False, lse: bool = False, gqa: bool = False,
                   name: str | None = None, dtype=ws.bf16):
    """softmax(Q K^T / sqrt(d)) V over [B, H, S, D] (or [B, Hkv, G, S, D] with K/V broadcast over G).
    The default name encodes the variant, so equal variants give equal kernels (one build)."""
    name = name or (f"attn_d{head_dim}{'_causal' if causal else ''}{'_br' if causal == 'bottom_right' else ''}"
                    f"{'_lse' if lse else ''}"
                    f"{'_gqa' if gqa else ''}_{dtype.name}")
    scale = 1.0 / math.sqrt(head_dim)
    if gqa:
        def attention(q: ws.Tensor[dtype, "B", "HK", "G", "S", head_dim],
                      k: ws.Tensor[dtype, "B", "HK", 1, "T", head_dim],
                      v: ws.Tensor[dtype, "B", "HK", 1, "T", head_dim]):
            return _body(q, k, v, scale, causal, lse, dtype)
    else:
        def attention(q: ws.Tensor[dtype, "B", "H", "S", head_dim],
                      k: ws.Tensor[dtype, "B", "H", "T", head_dim],
                      v: ws.Tensor[dtype, "B", "H", "T", head_dim]):
            return _body(q, k, v, scale, causal, lse, dtype)
    attention.__name__ = name
    return ws.fusion(attention)


def _body(q, k, v, scale, causal, lse, dtype):
    s = ws.matmul(q, k.transpose(-1, -2)) * scale
    if causal:
        s = ws.causal_mask(s, align="bottom_right" if causal == "bottom_right" else "top_left")
    o = ws.matmul(ws.softmax(s, dim=-1), v).to(dtype)
    return (o, ws.logsumexp(s, dim=-1)) if lse else o


def attention_inputs(B, H, S, T, D, device="cpu", seed=0, gqa_groups=None, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    if gqa_groups:
        shapes = [(B, H // gqa_groups, gqa_groups, S, D), (B, H // gqa_groups, 1, T, D), (B, H // gqa_groups, 1, T, D)]
    else:
        shapes = [(B, H, S, D), (B, H, T, D), (B, H, T, D)]
    return [torch.randn(s, generator=g).to(dtype).to(device) for s in shapes]
