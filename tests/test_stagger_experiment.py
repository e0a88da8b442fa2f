"""scripts/stagger_experiment.py's IR edits of attention kernels (consumer warpgroups out of step,
two stages of Q) keep the protocol: every edit simulates to the reference under several
interleavings, a stagger longer than the K/V ring deadlocks (the simulator names the waits), and
the edited kernels build for sm_90a without spills. The timings are the script's, on a GPU."""

import importlib.util
from pathlib import Path

import pytest

import wsched as ws
from attention_fusions import make_attention, make_variant, variant_inputs
from fusions import matmul
from wsched.lowering.simulate.errors import DeadlockError

SCRIPT = Path(__file__).parent.parent / "scripts" / "stagger_experiment.py"
spec = importlib.util.spec_from_file_location("stagger_experiment", SCRIPT)
experiment = importlib.util.module_from_spec(spec)
spec.loader.exec_module(experiment)

FUSIONS = {"window d128": (lambda: make_variant(128, "window", window=200), 128),
           "causal d64": (lambda: make_attention(64, causal=True, lse=True), 64)}


def rel(out, ref) -> float:
    out, ref = (x[0] if isinstance(x, tuple) else x for x in (out, ref))
    return float((out.float() - ref.float()).norm() / ref.float().norm())


@pytest.mark.parametrize("case", sorted(FUSIONS))
def test_every_edit_simulates_to_the_reference(case):
    make, head_dim = FUSIONS[case]
    fusion = make()
    base = ws.compile(fusion).primary
    args = variant_inputs(fusion, 1, 2, 520, 650, head_dim, seed=4)
    ref = fusion.reference(*args)
    names = []
    for name, kernel, edit in experiment.variants(base):
        edited = kernel.with_ir(edit(kernel.ir), build=False)
        for seed in range(3):
            assert rel(edited.simulate(*args, seed=seed, num_sms=3), ref) < 1e-2, (name, seed)
        names.append(name)
    assert names[:2] == ["stagger1", "stagger2"] and "two_q_stagger1" in names


def test_a_stagger_longer_than_the_ring_deadlocks():
    fusion = make_attention(64, causal=True, lse=True)
    base = ws.compile(fusion).primary
    edited = base.with_ir(experiment.stagger(base.ir, base.schedule.stages + 1), build=False)
    with pytest.raises(DeadlockError, match=rf"bar\.sync {experiment.STAGGER_BARRIER}, 256"):
        edited.simulate(*variant_inputs(fusion, 1, 2, 520, 520, 64, seed=1), num_sms=3)


def test_the_edits_refuse_a_kernel_they_do_not_fit():
    matmul_ir = ws.compile(matmul, build=False).primary.ir
    with pytest.raises(ValueError, match="stagger: not a cooperative attention kernel"):
        experiment.stagger(matmul_ir, 1)
    with pytest.raises(ValueError, match=r"double_q: 'barrier q_full\[1\]' is not in the kernel"):
        experiment.double_q(matmul_ir)


@pytest.mark.nvcc
@pytest.mark.parametrize("case", sorted(FUSIONS))
def test_the_edited_kernels_build_without_spills(case):
    base = ws.compile(FUSIONS[case][0]()).primary
    for name, kernel, edit in experiment.variants(base, ds=(1,)):
        resources = kernel.with_ir(edit(kernel.ir), build=True).resources
        assert resources.spill_stores == 0 and resources.spill_loads == 0, name
