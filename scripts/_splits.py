"""Scratch: split-KV unit counts after the linear merge (faked split rules), cold L2, vs cuDNN."""
import sys, time
sys.path.insert(0, "tests"); sys.path.insert(0, "benchmarks"); sys.path.insert(0, "scripts")
from concurrent.futures import ThreadPoolExecutor
import torch, wsched as ws
from wsched.lowering import ir
from wsched.workloads.attention import loops
from attention_fusions import make_attention
import decode as dec

orig = loops.split_count
def rule(few_tiles, per_sm):
    def split_count(s, nb, rows, keys="T"):
        bm, bn, _ = s.tile
        tiles = ir.mul(loops._heads(nb), ir.ceil_div(rows, bm))
        blocks = ir.emax(1, ir.ceil_div(keys, bn))
        longest = ir.emax(1, ir.div(blocks, loops.MIN_KV_BLOCKS_PER_SPLIT))
        few = ir.BinOp("<=", ir.mul(few_tiles, tiles), ir.Var("num_sms"))
        units = ir.emax(1, ir.div(ir.mul("num_sms", per_sm), ir.mul(tiles, ir.add(1, few))))
        wanted = ir.emin(ir.emin(s.split_kv, longest), units)
        return ir.ceil_div(blocks, ir.ceil_div(blocks, wanted))
    return split_count
from wsched.workloads.attention import schedule as sched_mod
import wsched.codegen.emit as emit_mod
def build(rule_fn, max_split, unroll=8):
    emit_mod.SERIAL_UNROLL_MAX = unroll
    loops.split_count = rule_fn
    sched_mod.MAX_SPLIT_KV = max_split
    import wsched.workloads.attention as att
    k = ws.compile(make_attention(128, gqa=True), build=False)
    for i in range(len(k.variants)):
        k._variant_kernel(i)
    loops.split_count = orig
    sched_mod.MAX_SPLIT_KV = 32
    emit_mod.SERIAL_UNROLL_MAX = 8
    return k
kernels = {"old": build(rule(16, 1), 32), "new": build(orig, 32), "new_u16": build(orig, 32, 16), "new64_u16": build(orig, 64, 16)}
SHAPES = [(1, 8, 1024), (1, 8, 8192), (1, 8, 32768), (1, 32, 8192), (8, 8, 8192), (1, 8, 16384), (1, 8, 65536), (1, 4, 8192), (1, 4, 16384), (1, 4, 32768), (1, 2, 8192), (1, 2, 32768), (1, 1, 8192), (1, 1, 32768), (1, 1, 131072), (2, 2, 32768)]
timer = dec.ColdTimer(40)
data = {}
for B, HK, T in SHAPES:
    G = 32 // HK
    q = torch.randn(B, HK, G, 1, 128, dtype=torch.bfloat16, device="cuda")
    kk = torch.randn(B, HK, 1, T, 128, dtype=torch.bfloat16, device="cuda"); v = torch.randn_like(kk)
    args = (q, kk, v)
    cs = {}
    for name, k in kernels.items():
        c = k.choose(args, 132)
        c.compile_cuda()
        cs[name] = c
    cud = dec.sdpa(dec.SDPBackend.CUDNN_ATTENTION, q.reshape(B, HK * G, 1, 128), kk.reshape(B, HK, T, 128), v.reshape(B, HK, T, 128))
    ts = {n: [] for n in list(cs) + ["cuDNN"]}
    for _ in range(3):
        for n, c in cs.items():
            ts[n].append(timer(lambda: c._run(args, None, c._natives)))
        ts["cuDNN"].append(timer(cud))
    spl = {n: c._host_params(c._bind_inputs(args)[1], 132)["splits"] for n, c in cs.items()}
    print(f"B{B} H32/{HK} T{T}: " + "  ".join(f"{n}({spl.get(n, '-')}) {min(t):.1f}" for n, t in ts.items()), flush=True)
