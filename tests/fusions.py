"""Fusions shared by the lowering, simulator, codegen and GPU tests."""

import wsched as ws


@ws.fusion
def matmul(a: ws.Tensor[ws.bf16, "M", "K"], b: ws.Tensor[ws.bf16, "K", "N"]):
    return ws.matmul(a, b).to(ws.bf16)


@ws.fusion
def mlp(a: ws.Tensor[ws.bf16, "M", "K"], b: ws.Tensor[ws.bf16, "K", "N"], bias: ws.Tensor[ws.bf16, "N"]):
    return ws.gelu(ws.matmul(a, b) + bias).to(ws.bf16)


@ws.fusion
def linear_relu_residual(x: ws.Tensor[ws.bf16, "M", "K"], w: ws.Tensor[ws.bf16, "N", "K"],
                         bias: ws.Tensor[ws.bf16, "N"], res: ws.Tensor[ws.bf16, "M", "N"]):
    y = ws.relu(ws.matmul(x, w.transpose(-1, -2)) + bias)
    return (y * 0.5 + res).to(ws.bf16)


@ws.fusion
def scaled_silu_f32(a: ws.Tensor[ws.bf16, "M", "K"], b: ws.Tensor[ws.bf16, "K", "N"],
                    scale: ws.Tensor[ws.f32, "M", 1]):
    return ws.silu(ws.matmul(a, b) * scale)


@ws.fusion
def matmul_f16(a: ws.Tensor[ws.f16, "M", "K"], b: ws.Tensor[ws.f16, "K", "N"]):
    return ws.matmul(a, b).to(ws.f16)


@ws.fusion
def gated(a: ws.Tensor[ws.bf16, "M", "K"], w: ws.Tensor[ws.bf16, "K", "N"], g: ws.Tensor[ws.bf16, "M", "N"]):
    return (ws.silu(ws.matmul(a, w)) * g).to(ws.bf16)


def inputs_for(fusion, M, N, K, device="cpu", dtype=None, seed=0):
    """Fresh random inputs of the right shapes and dtypes (normal, scaled to keep sums O(1))."""
    import torch

    g = torch.Generator(device="cpu").manual_seed(seed)
    sizes = {"M": M, "N": N, "K": K}
    out = []
    for node in fusion.inputs:
        shape = [sizes[d] if isinstance(d, str) else d for d in node.shape]
        t = torch.randn(shape, generator=g)
        if node.id in ("a", "x"):
            t = t / K ** 0.5
        out.append(t.to(node.dtype.torch_dtype).to(device))
    return out


def simulated_under_interleavings(kernel, M, N, K, num_sms, seeds=range(4), input_seed=5):
    """The simulator's `out` of a 2-D matmul kernel (`kernel.kernel`) on one set of inputs under
    the interleavings `seeds`, NaN-poisoned first, with each run's report: a split tile's sum must
    come out the same bits whichever unit arrives last."""
    import torch
    from wsched.lowering.simulate import simulate

    a, b = inputs_for(matmul, M, N, K, seed=input_seed)
    runs = []
    for seed in seeds:
        out = torch.full((M, N), float("nan"), dtype=torch.bfloat16)
        report = simulate(kernel.kernel, {"M": M, "N": N, "K": K, "a": a, "b": b, "out": out}, num_sms=num_sms, seed=seed)
        runs.append((out, report))
    return runs
