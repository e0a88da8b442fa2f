"""Decode and split-KV attention on the GPU through `ws.compile`'s per-shape choice, against the
torch reference in fp32; outputs poisoned with NaN first."""

import pytest

import wsched as ws

from attention_fusions import attention_inputs, make_attention
from test_gpu_attention import rel, run   # outputs poisoned, the call, the sync; the relative error

pytestmark = pytest.mark.gpu

_compiled = {}


def compiled(d, causal, gqa):
    key = (d, causal, gqa)
    if key not in _compiled:
        f = make_attention(d, causal=causal, lse=True, gqa=gqa)
        _compiled[key] = (f, ws.compile(f))
    return _compiled[key]


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("b, h, g, s, t", [
    (1, 32, 4, 1, 1), (1, 32, 4, 1, 127), (8, 32, 4, 1, 8193), (2, 32, 4, 3, 4097), (4, 32, 4, 16, 1000),
    (1, 32, 4, 64, 20000), (3, 8, 8, 1, 3000), (2, 16, 1, 1, 5000), (64, 32, 4, 1, 600)])
def test_decode_matches_torch(d, b, h, g, s, t):
    f, k = compiled(d, "bottom_right", g > 1)
    inputs = [x.cuda() for x in attention_inputs(b, h, s, t, d, gqa_groups=g if g > 1 else None, seed=t)]
    chosen = k.kernel_for(*inputs).schedule
    assert chosen.split_kv > 1 and chosen.pack_gqa == (g > 1)
    o, lse = run(f, k, inputs)
    ro, rlse = f.reference(*inputs)
    assert rel(o, ro) < 1e-2 and rel(lse, rlse) < 1e-3


@pytest.mark.parametrize("b, g, s, t", [(1, 32, 1, 4621), (2, 32, 3, 1172), (1, 16, 2, 30000), (1, 12, 3, 700)])
def test_one_kv_head_deals_its_rows_to_idle_sms(b, g, s, t):
    """MQA (one KV head, G query heads): the splits of a tile leave SMs idle, so its G x S rows go
    to tiles of whole merge chunks (8 rows at D128), all reading the same kv blocks."""
    import torch

    f, k = compiled(128, "bottom_right", True)
    inputs = [x.cuda() for x in attention_inputs(b, g, s, t, 128, gqa_groups=g, seed=t)]
    chosen = k.kernel_for(*inputs)
    _, scalars, _ = chosen._bind_inputs(inputs)
    params = chosen._host_params(scalars, torch.cuda.get_device_properties(0).multi_processor_count)
    assert params["splits"] > 1 and params["tile_rows"] < 64
    for _ in range(2):    # the tickets come back to zero: the next call merges again
        o, lse = run(f, k, inputs)
        ro, rlse = f.reference(*inputs)
        assert rel(o, ro) < 1e-2 and rel(lse, rlse) < 1e-3


@pytest.mark.parametrize("causal", [False, True])
def test_few_long_tiles_split_their_keys(causal):
    f, k = compiled(128, causal, False)
    shape = (1, 2, 4000, 4000) if causal else (1, 4, 1000, 30000)    # 64 and 32 tiles on 132 SMs
    inputs = [x.cuda() for x in attention_inputs(*shape, 128, seed=5)]
    assert k.kernel_for(*inputs).schedule.split_kv > 1
    for _ in range(3):    # the tickets come back to zero: the next call merges again
        o, lse = run(f, k, inputs)
        ro, rlse = f.reference(*inputs)
        assert rel(o, ro) < 1e-2 and rel(lse, rlse) < 1e-3


@pytest.mark.parametrize("variant, s, t", [("causal", 1, 8193), ("causal", 16, 1000), ("window", 3, 4097),
                                           ("window", 64, 20000)])
def test_masks_bounded_by_diagonals_decode_packed(variant, s, t):
    """A causal mask or a sliding window written with ws.where: the decode kernel packs the G
    heads as for ws.causal_mask (row mod S in the tile mask's bounds). Top-left, the rows see
    only the first keys: the splits past them see nothing and the merge takes their empty parts."""
    from attention_fusions import make_variant
    from test_gpu_attention import check_variant

    f = make_variant(128, variant, gqa=True, window=1000)
    k = ws.compile(f)
    inputs = [x.cuda() for x in attention_inputs(4, 32, s, t, 128, gqa_groups=4, seed=t)]
    chosen = k.kernel_for(*inputs).schedule
    assert chosen.pack_gqa and chosen.split_kv > 1
    check_variant(f, k, inputs)
