"""Numerical faults and stop requests in a real (tiny) training run."""
import math
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import pretrain_gpt
from megatron.model import GPTModel
from tests.conftest import ROOT
from tests.gpt_setup import one_thread
from tests.reliability_setup import (FULL_DISK_RUN, bad_token_dataset, byte_dataset,
                                     one_thread_env, run_entry, session_processes, tiny_argv)


@pytest.fixture(autouse=True)
def _one_thread():
    with one_thread():
        yield

NAN_PARAM = "language_model.encoder.layers.1.mlp.dense_4h_to_h.weight"


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    out = tmp_path_factory.mktemp("runs")
    return byte_dataset(out), out / "cache"


@pytest.fixture
def nan_weight(monkeypatch):
    """Every model starts with one nan weight: every loss and gradient is nan."""
    original = GPTModel.init_weights

    def init(self, seed):
        original(self, seed)
        with torch.no_grad():
            dict(self.named_parameters())[NAN_PARAM][0, 0] = float("nan")
    monkeypatch.setattr(GPTModel, "init_weights", init)


@pytest.mark.parametrize("flags, words", [
    (["--check-for-nan-in-loss-and-grad"],
     "iteration 1: nan/inf loss or gradient on rank 0 (first parameter with a non-finite gradient: "
     "language_model.embedding.word_embeddings.weight)"),
    (["--max-consecutive-nan-iterations", "2"],
     "iteration 2: 2 iterations in a row with a nan/inf loss or gradient norm"),
])
def test_nan_run_stops_with_one_line(data, nan_weight, capsys, flags, words):
    with pytest.raises(SystemExit) as exc:
        pretrain_gpt.main(tiny_argv(*data, *flags, iters=20))
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 1 and len(err.splitlines()) == 1 and words in err, err


def test_inf_grad_norm_is_a_nan_iteration(data):
    """A gradient whose norm is not finite: the step is not applied and (without fp16 loss
    scaling) the trainer counts it as a nan iteration. The norm is accumulated in float64,
    so finite fp32 gradients never overflow it; 1e30 everywhere is a finite, clipped step."""
    from megatron.arguments import parse_args
    from megatron.mpu import single_process_state
    from megatron.training.parallelize import build_model
    from megatron.training.trainer import Trainer
    config, _ = parse_args(tiny_argv(*data), world_size=1)
    config.model.padded_vocab_size = 272
    pstate = single_process_state()
    models = build_model(config, pstate, "cpu",
                                lambda **kw: pretrain_gpt.model_provider(config, None, **kw))
    trainer = Trainer(config, pstate, "cpu", models, None)
    before = [p.detach().clone() for p in models[0].parameters()]
    params = list(models[0].parameters())
    for p in params:
        p.main_grad.fill_(1e30)
    params[-1].main_grad[0] = float("inf")
    applied, norm, overflow = trainer.optimizer.step()
    assert not applied and overflow and trainer.optimizer.grad_scaler is None
    assert all(torch.equal(a, b) for a, b in zip(before, params))
    for p in params:
        p.main_grad.fill_(1e30)
    applied, norm, overflow = trainer.optimizer.step()
    assert applied and not overflow and math.isfinite(norm)


def _train_until(argv, iteration):
    """Start pretrain_gpt.py in its own process group; return it once it has logged `iteration`."""
    proc = subprocess.Popen([sys.executable, str(ROOT / "pretrain_gpt.py"), *map(str, argv)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=ROOT, env=one_thread_env(), start_new_session=True)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if f" iteration {iteration:8d}/" in line:
            return proc, lines
    raise AssertionError("".join(lines[-20:]))


def _stopped_at(lines):
    exits = [line for line in lines if "exiting program at iteration" in line]
    assert len(exits) == 1, "".join(lines[-20:])
    return int(exits[0].split("exiting program at iteration")[1].split(":")[0])


def test_sigterm_saves_the_current_iteration_and_resumes_exactly(data, tmp_path):
    """--exit-signal-handler: SIGTERM to the process group (as SLURM sends it; the data
    loader worker gets it too) finishes the iteration, saves it, exits 0; resuming gives
    the losses of an uninterrupted run."""
    save = tmp_path / "ckpt"
    argv = tiny_argv(*data, "--exit-signal-handler", "--save", save, "--num-workers", "1", iters=60)
    proc, lines = _train_until(argv, 2)
    os.killpg(proc.pid, signal.SIGTERM)
    lines += proc.stdout.readlines()
    assert proc.wait(timeout=120) == 0, "".join(lines[-20:])
    stopped = _stopped_at(lines)
    assert "SIGTERM received (--exit-signal-handler)" in "".join(lines)
    assert (save / "latest_checkpointed_iteration.txt").read_text() == str(stopped)
    end = ["--exit-interval", str(stopped + 2)]
    full = pretrain_gpt.main(tiny_argv(*data, *end, iters=60)).history
    resumed = pretrain_gpt.main(tiny_argv(*data, *end, "--load", save, iters=60)).history
    assert [h["iteration"] for h in resumed] == [stopped + 1, stopped + 2]
    assert resumed == full[stopped:]


def test_kill_switch_and_time_limit_stop_cleanly(data, tmp_path, capsys):
    switch = tmp_path / "stop-now"
    switch.write_text("")
    state = pretrain_gpt.main(tiny_argv(*data, "--kill-switch-path", switch, "--save",
                                        tmp_path / "a", iters=50))
    assert [h["iteration"] for h in state.history] == [1]
    assert (tmp_path / "a" / "latest_checkpointed_iteration.txt").read_text() == "1"
    state = pretrain_gpt.main(tiny_argv(*data, "--exit-duration-in-mins", "1e-9", iters=50))
    out = capsys.readouterr().out
    assert [h["iteration"] for h in state.history] == [1] and "--exit-duration-in-mins 1e-09 reached" in out


def test_exit_interval_without_save_warns(data, capsys):
    pretrain_gpt.main(tiny_argv(*data, "--exit-interval", "1", iters=5))
    assert "WARNING: --exit-interval 1 without --save" in capsys.readouterr().out


def test_stale_build_lock_of_a_killed_build_is_cleared(tmp_path, monkeypatch):
    """torch's `lock` file outlives a killed build and would make the next one wait forever."""
    from megatron.fused import kernels as fk
    monkeypatch.setenv("MEGATRON_FUSED_BUILD_DIR", str(tmp_path))
    monkeypatch.delenv("MEGATRON_DISABLE_FUSED_BUILD", raising=False)
    name, spec = next(iter(fk._extension_specs().items()))
    if fk.importlib.util.find_spec(name) is not None:
        pytest.skip("a setup.py build of the kernels is installed; nothing is compiled")
    build_dir = tmp_path / f"{name}-{fk._build_key(name, spec)}"
    build_dir.mkdir()
    (build_dir / "lock").write_text("")
    seen = []
    monkeypatch.setattr(fk, "_compile", lambda n, s, d, v: seen.append((d / "lock").exists()) or "built")
    with pytest.warns(RuntimeWarning, match="removed a stale build lock"):
        assert fk._load_or_build(name, spec, False) == "built"
    assert seen == [False]


@pytest.fixture(scope="module")
def bad_tokens(tmp_path_factory):
    return bad_token_dataset(tmp_path_factory.mktemp("badtok"))


def _exits(argv, status, words, code=None):
    """The run ends within 30 s with `status`, one line holding `words`, nothing left behind."""
    rc, err, seconds = run_entry(argv, timeout=90, code=code)
    assert rc == status and len(err) == 1 and words in err[0], (rc, err[-5:])
    assert seconds < 30, seconds
    return seconds


def test_every_error_exits_with_loader_workers_alive(data, bad_tokens, tmp_path):
    """With --num-workers 2, errors raised while the loader workers are alive (a full disk at
    a save, a token beyond the vocabulary in a worker) and start-up refusals (a nan blend
    weight, a --seq-length leaving no samples, a kill switch in a missing directory) each exit
    2 with one line, within 30 s, leaving no process behind."""
    workers = ["--num-workers", "2"]
    times = {}
    times["full disk"] = _exits(tiny_argv(*data, *workers, "--save", tmp_path / "full",
                                          "--save-interval", "2", iters=6),
                                2, "no space left on device", code=FULL_DISK_RUN)
    times["token"] = _exits(tiny_argv(bad_tokens, data[1], *workers), 2,
                            "holds token id 700, outside the vocabulary of size 257")
    times["nan weight"] = _exits(tiny_argv(data[0], data[1], *workers) + [
        "--data-path", "nan", data[0], "1", data[0]], 2, "every weight must be a finite number")
    times["seq length"] = _exits(tiny_argv(*data, *workers, "--position-embedding-type", "rope",
                                           "--seq-length", "4000000000",
                                           "--max-position-embeddings", "4000000000"),
                                 2, "--seq-length 4000000000 leaves no samples")
    times["kill switch"] = _exits(tiny_argv(*data, *workers, "--kill-switch-path",
                                            tmp_path / "no" / "such" / "stop"),
                                  2, "--kill-switch-path")
    print(f"exit seconds: {times}")


def test_a_run_owns_its_save(data, tmp_path):
    """Two concurrent runs on one --save: the second exits 2 naming the first. After the first
    is SIGKILLed (no process of it is left), a new run takes the stale lock over with a notice
    and saves; every checkpoint in the directory verifies."""
    from megatron.checkpointing.model_file import read_model_file
    save = tmp_path / "ckpt"
    first, lines = _train_until(tiny_argv(*data, "--save", save, "--save-interval", "2",
                                          "--num-workers", "2", iters=100000), 3)
    try:
        rc, err, seconds = run_entry(tiny_argv(*data, "--save", save, "--num-workers", "2", iters=2))
        assert rc == 2 and len(err) == 1 and seconds < 30, (rc, err, seconds)
        assert f"--save {save} is in use by another run: pid {first.pid} on host" in err[0], err
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    deadline = time.monotonic() + 10
    while session_processes(first.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not session_processes(first.pid)
    proc = subprocess.run([sys.executable, str(ROOT / "pretrain_gpt.py"),
                           *map(str, tiny_argv(*data, "--save", save, "--exit-interval", "3",
                                               "--num-workers", "2", iters=100000))],
                          capture_output=True, text=True, cwd=ROOT, env=one_thread_env(), timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"took over the stale lock of pid {first.pid}" in proc.stdout, proc.stdout[-2000:]
    assert not (save / ".megatron_save.lock").exists()  # released at exit
    files = sorted(save.glob("iter_*/mp_rank_00/model_optim_rng.pt"))
    assert len(files) >= 2 and not list(save.rglob("*.tmp.*"))
    for path in files:
        read_model_file(str(path))  # checksum-verified
    assert (save / "latest_checkpointed_iteration.txt").read_text() == "3"


def test_server_on_a_busy_port_is_one_line_and_releases_the_ranks(capsys):
    """The text-generation server cannot listen: one line, exit 2, and the heartbeat thread
    and the other ranks are stopped (Server.stop), so nothing keeps the process alive."""
    import socket
    import threading
    from tools import run_text_generation_server as server_tool

    class Fake:
        stopped = threading.Event()
        heartbeat = stopped.wait  # the heartbeat thread waits until stop()

        def stop(self):
            self.stopped.set()

    fake = Fake()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(SystemExit) as exc:
            server_tool.serve(fake, "127.0.0.1", port, 1)
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and len(err.splitlines()) == 1 and f"--port {port}" in err, err
    assert fake.stopped.is_set()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # serve() installed its handler
