"""Partition: load sub-DAG, compute sub-DAG, channels, and the errors for fusions it cannot split."""

import pytest

import wsched as ws
from wsched.schedule import ScheduleError
from wsched.workloads import partition
from wsched.workloads.matmul.schedule import default_schedule

from fusions import linear_relu_residual, mlp, scaled_silu_f32


def test_mlp_partition_cuts_the_operands_into_one_channel():
    p = partition(mlp, default_schedule())
    (ch,) = p.channels
    assert [(ld.tensor, ld.buffer, ld.major, ld.box, ld.boxes) for ld in ch.loads] == [
        ("a", "A", "k", (128, 64), 1), ("b", "B", "n", (64, 64), 4)]
    assert ch.bytes_per_stage == 128 * 64 * 2 + 64 * 256 * 2 == 49152
    assert sorted(p.load_dag.nodes) == sorted(["a", "b", "tma_load(a)", "tma_load(b)", "A[stage]", "B[stage]"])
    assert p.workload.name == "matmul"
    assert [n.op for n in p.payload.epilogue] == ["add", "gelu", "cast"]
    assert [n.id for n in p.payload.side_inputs] == ["bias"]
    assert p.payload.tiles["bias"].layout == "row"
    assert p.dims == {"M": ("a", 0), "K": ("a", 1), "N": ("b", 1)}


def test_partition_prints_both_nests_and_the_channel(golden):
    golden.check("mlp.partition.txt", str(partition(mlp, default_schedule())))


def test_transposed_weight_is_loaded_k_major():
    p = partition(linear_relu_residual, default_schedule())
    b = p.channels[0].loads[1]
    assert (b.tensor, b.major, b.box, b.boxes) == ("w", "k", (256, 64), 1)
    assert p.dims["N"] == ("w", 0)
    assert {n.id: p.payload.tiles[n.id].layout for n in p.payload.side_inputs} == {"bias": "row", "res": "full"}


def test_column_vector_side_input():
    p = partition(scaled_silu_f32, ws.schedule_for(scaled_silu_f32))   # staging sized for f32 outputs
    assert p.payload.tiles["scale"].layout == "col"
    assert p.outputs[0].dtype.name == "f32"


def test_two_matmuls_need_the_attention_schedule():
    @ws.fusion
    def two(a: ws.Tensor[ws.bf16, "M", "K"], b: ws.Tensor[ws.bf16, "K", "N"], c: ws.Tensor[ws.bf16, "N", "P"]):
        return ws.matmul(ws.matmul(a, b).to(ws.bf16), c)

    with pytest.raises(ScheduleError, match="exactly one matmul in two, found 2; a matmul -> softmax -> matmul fusion "
                                            "is scheduled as attention"):
        partition(two, default_schedule())


def test_reduction_in_the_epilogue_is_rejected_with_its_source_line():
    @ws.fusion
    def rowsum(a: ws.Tensor[ws.bf16, "M", "K"], b: ws.Tensor[ws.bf16, "K", "N"]):
        return ws.matmul(a, b).sum(dim=-1)

    with pytest.raises(ScheduleError, match=r"n1 = sum\(\.\.\.\) at test_partition\.py:\d+: the matmul epilogue fuses elementwise ops only"):
        partition(rowsum, default_schedule())


def test_operand_computed_in_the_fusion_cannot_be_loaded_by_tma():
    @ws.fusion
    def pre(a: ws.Tensor[ws.bf16, "M", "K"], b: ws.Tensor[ws.bf16, "K", "N"]):
        return ws.matmul(ws.relu(a), b)

    with pytest.raises(ScheduleError, match=r"matmul operand a is n0 = relu\(\.\.\.\) at test_partition\.py:\d+: an MMA operand must be a fusion input"):
        partition(pre, default_schedule())
