"""Hangs: a peer that stops responding ends the run within --distributed-timeout-minutes.

Every collective and p2p call then times out (the process groups are created with
that timeout). The guard turns the backend's timeout error into one line naming
this rank, its pipeline stage, the micro batch and the operation it waited in (the
timer running at that moment: forward-recv, grads-all-reduce, optimizer, ...).
"""
import contextlib
import functools

from megatron.checkpointing.io import CheckpointError

_TIMEOUT_WORDS = ("timed out", "timeout", "connection closed", "connection reset", "broken pipe")


class DistributedTimeoutError(RuntimeError):
    """A collective or p2p operation gave up waiting for a peer rank; `silent`: the peer
    went quiet (a hang, a host cut off) rather than closed its connection."""

    def __init__(self, message: str, silent: bool = True):
        super().__init__(message)
        self.silent = silent


def peer_exited(err: BaseException) -> bool:
    """The peer's end of the connection closed (it exited) rather than went silent."""
    text = str(err).lower()
    return any(word in text for word in _TIMEOUT_WORDS[2:])


def is_timeout(err: BaseException) -> bool:
    text = str(err).lower()
    return any(word in text for word in _TIMEOUT_WORDS)


class HangGuard:
    def __init__(self, pstate, minutes: float):
        self.pstate, self.minutes = pstate, minutes
        self.timers = None
        self.microbatch = 0
        self.operation = None

    def counting(self, forward_step):
        """`forward_step` that also records which micro batch this rank is on."""
        @functools.wraps(forward_step)
        def step(*args, **kwargs):
            self.microbatch += 1
            return forward_step(*args, **kwargs)
        return step

    @contextlib.contextmanager
    def watch(self, iteration: int, operation=None):
        """Run a block that communicates; a timeout in it becomes DistributedTimeoutError."""
        self.microbatch, self.operation = 0, operation
        if self.timers is not None:
            self.timers.current = None
        try:
            yield
        except (DistributedTimeoutError, CheckpointError):  # already one line (a save's own)
            raise
        except RuntimeError as err:
            if not is_timeout(err):
                raise
            exited = peer_exited(err)
            raise DistributedTimeoutError(self.describe(iteration, exited),
                                          silent=not exited) from None
        finally:
            self.operation = None

    def describe(self, iteration: int, exited: bool = False) -> str:
        p = self.pstate
        operation = self.operation or getattr(self.timers, "current", None) or "a collective"
        micro = f"micro batch {self.microbatch}" if self.microbatch else "no micro batch yet"
        where = f"rank {p.rank} (pipeline stage {p.pp_rank}, data-parallel rank {p.dp_rank})"
        if exited:
            return (f"{where} lost its connection to a peer rank in {operation} ({micro}, iteration "
                    f"{iteration}): that rank exited; its own error line says why")
        return (f"{where} waited --distributed-timeout-minutes {self.minutes:g} in {operation} "
                f"({micro}, iteration {iteration}); a peer rank stopped responding")
