"""Pipeline parallelism: pure schedules, p2p communication and the schedule executor."""
from megatron.pipeline.executor import forward_backward
from megatron.pipeline.p2p import P2PCommunicator
from megatron.pipeline.schedule import (
    Action, Exchange, Kind, build_schedule, interleaved_one_f_one_b, no_pipelining, one_f_one_b,
)

__all__ = [
    "Action", "Exchange", "Kind", "P2PCommunicator", "build_schedule", "forward_backward",
    "interleaved_one_f_one_b", "no_pipelining", "one_f_one_b",
]
