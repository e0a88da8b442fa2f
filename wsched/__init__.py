"""wsched: a tensor DAG written in Python, compiled to warp-specialized Hopper kernels."""

from .dtypes import DType, bf16, f16, f32, i32
from .errors import ArgumentError, FusionError
from .dsl import (
    Tensor, add, cast, causal_mask, div, exp, exp2, gelu, log, logsumexp, matmul, maximum, minimum,
    mul, neg, relu, sigmoid, silu, softmax, sub, tanh,
)
from .dsl import eq, ge, gt, inf, key_lengths, le, logical_and, logical_not, logical_or, lt, ne, paged, positions, where
from .dsl import packed, varlen

from .dsl import reduce_max as max, reduce_sum as sum  # noqa: A001 (ws.max, ws.sum, like torch)
from .fusion import Fusion, Node, fusion

# The pipeline: schedule, lower, compile (see wsched/api.py).
from .api import CompiledKernel, compile, lower, schedule_for  # noqa: A004 (ws.compile, like torch.compile)
from .partition import Partition
from .schedule import Schedule, ScheduleError
from .workloads import WORKLOADS, Workload, partition, workload_for
