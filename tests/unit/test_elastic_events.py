"""The one-line log events of an elastic job and the sample record (megatron/training/
elastic_events.py, megatron/data/sample_record.py), without processes."""
import socket

from megatron.data.sample_record import ENV, read_records, record_path
from megatron.data.samplers import build_pretraining_data_loader
from megatron.mpu.topology import ParallelDims
from megatron.training import elastic_events


def test_restart_and_resume_lines(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    assert elastic_events.restart_line(4) is None
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
    assert elastic_events.restart_line(2) == \
        " > restart 1 of at most 3 by torchrun's elastic agent, now at world size 2"
    assert elastic_events.resumed_line(6, ParallelDims(8, tp=2, pp=2, virtual_pp=2)) == \
        " > resumed at iteration 6 with layout TP 2 x PP 2 (virtual 2) x DP 2 (world size 8)"
    assert elastic_events.resumed_line(0, ParallelDims(1), weights_of=6) == \
        " > starting at iteration 0 from the weights of iteration 6 with layout TP 1 x PP 1 x " \
        "DP 1 (world size 1)"
    assert elastic_events.layout_text(ParallelDims(4, cp=2, ep=2)) == \
        "TP 1 x PP 1 x CP 2 x EP 2 x DP 2 (world size 4)"


def test_the_rendezvous_probe(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert elastic_events.unreachable_store() is None  # not under torchrun: nothing to probe
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    server = socket.create_server(("127.0.0.1", 0))
    monkeypatch.setenv("PET_RDZV_ENDPOINT", f"127.0.0.1:{server.getsockname()[1]}")
    monkeypatch.setattr(elastic_events.os, "getppid", lambda: 0)  # no agent command line
    assert elastic_events.rendezvous_endpoint() == ("127.0.0.1", server.getsockname()[1])
    assert elastic_events.unreachable_store() is None
    port = server.getsockname()[1]
    server.close()
    assert elastic_events.unreachable_store() == f"127.0.0.1:{port}"
    monkeypatch.setenv("PET_RDZV_ENDPOINT", "node0")
    assert elastic_events.rendezvous_endpoint() == ("node0", 29400)


def test_the_sample_record_lists_each_micro_batch(monkeypatch, tmp_path):
    monkeypatch.setenv(ENV, str(tmp_path))
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    loader = build_pretraining_data_loader(list(range(20)), 8, 2, 1, 2, record_to=record_path())
    assert [b.tolist() for b in loader] == [[10, 11], [14, 15], [18, 19]]
    assert read_records(tmp_path) == {(2, 1): [[10, 11], [14, 15], [18, 19]]}


def test_only_a_torchrun_parent_is_read_or_stopped(monkeypatch, tmp_path):
    """The endpoint comes from the agent's command line; a parent that is not torchrun (a
    shell, a subreaper after the agent died) is neither read nor signalled."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    monkeypatch.delenv("PET_RDZV_ENDPOINT", raising=False)
    agent = ["/usr/bin/python", "-m", "torch.distributed.run", "--rdzv-endpoint", "node02:29500",
             "pretrain_gpt.py"]
    cmdline = tmp_path / "cmdline"
    real_open = open
    monkeypatch.setattr("builtins.open", lambda path, *a, **k: real_open(
        cmdline if str(path).startswith("/proc/") else path, *a, **k))
    killed = []
    monkeypatch.setattr(elastic_events.os, "kill", lambda pid, sig: killed.append(pid))
    monkeypatch.setattr(elastic_events.os, "getppid", lambda: 4242)
    cmdline.write_bytes("\0".join(agent).encode())
    assert elastic_events.rendezvous_endpoint() == ("node02", 29500)
    elastic_events.stop_cut_off_agent()
    assert killed == [4242]
    cmdline.write_bytes(b"/bin/sh\0-c\0--rdzv-endpoint\0node02:29500")
    assert elastic_events.rendezvous_endpoint() is None
    elastic_events.stop_cut_off_agent()
    assert killed == [4242]


def test_the_hang_guard_leaves_a_saves_own_error_and_marks_silent_peers():
    import pytest
    from megatron.checkpointing.io import CheckpointError
    from megatron.mpu.parallel_state import ParallelState
    from megatron.training.hang_guard import DistributedTimeoutError, HangGuard
    guard = HangGuard(ParallelState(ParallelDims(1)), 0.25)
    with pytest.raises(CheckpointError, match="^a save that timed out elsewhere$"):
        with guard.watch(4, "the checkpoint save of iteration 4"):
            raise CheckpointError("a save that timed out elsewhere")
    with pytest.raises(DistributedTimeoutError) as err:
        with guard.watch(4, "the checkpoint save of iteration 4"):
            raise RuntimeError("Timed out waiting 15000ms for recv operation to complete")
    assert err.value.silent and "waited --distributed-timeout-minutes 0.25 in the checkpoint " \
        "save of iteration 4 (no micro batch yet, iteration 4)" in str(err.value)
    with pytest.raises(DistributedTimeoutError) as err:
        with guard.watch(5):
            raise RuntimeError("Connection closed by peer [10.77.0.2]:1234")
    assert not err.value.silent and guard.operation is None
