"""Hosts that fail, in the test bed (issue 35, item 3): an elastic job (`--nnodes 1:2
--max-restarts 2`) that loses a host, SIGKILLed or cut off the network, ends restarted on the
host that is left, resumed from the last complete checkpoint at the new world size, and
finished, with the losses and the sample order of an uninterrupted run; the log says each
event in one line."""
import os
import re
import time

import pytest

import pretrain_gpt
from megatron.data.sample_record import ENV, read_records
from tests.gpt_setup import losses, one_thread
from tests.multinode.bed import leftovers, test_bed
from tests.multinode.jobs import job_env, start_torchrun, wait_all
from tests.reliability_setup import byte_dataset, tiny_argv

ITERS = 16  # the host is lost after iteration 2: the rest must outlast a poll
GLOBAL = 4  # tiny_argv: micro 2, global 4
TIMEOUT_MINUTES = 0.25  # --distributed-timeout-minutes of the cut-off test
LINE = re.compile(r" iteration +(\d+)/ +\d+ \| consumed samples: +(\d+) \|.*?\| lm loss: "
                  r"([0-9.E+-]+) \|")
ELASTIC = ["--rdzv-conf", "last_call_timeout=5,keep_alive_interval=1,keep_alive_max_attempt=3"]
LOADED = re.compile(r"successfully loaded checkpoint from .* at iteration (\d+)")
RESTART = " > restart 1 of at most 2 by torchrun's elastic agent, now at world size 1"
SILENT = re.compile(r"pretrain_gpt.py: error: rank \d \(pipeline stage 0, data-parallel rank "
                    r"\d\) waited --distributed-timeout-minutes 0.25 in .*; a peer rank "
                    r"stopped responding")


def _latest(save) -> int:
    try:
        return int(open(os.path.join(str(save), "latest_checkpointed_iteration.txt")).read())
    except (OSError, ValueError):
        return 0


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """(flags, one process's losses, the micro batches it drew) of the tiny run."""
    out = tmp_path_factory.mktemp("failures")
    argv = tiny_argv(byte_dataset(out, docs=60), out / "cache", iters=ITERS)
    record = out / "samples"
    record.mkdir()
    os.environ[ENV] = str(record)
    try:
        with one_thread():
            reference = losses(pretrain_gpt.main(argv))
    finally:
        del os.environ[ENV]
    return argv, reference, read_records(record)[(0, 0)]


def _run_losing_a_host(tmp_path, argv, lose, hosts=("node01", "node02"), flags=()):
    """Start the elastic job on `hosts`, call `lose(bed, started)` once iteration 2 is
    saved; returns (exit codes, {host: log}, iteration saved when lost, what lose returned)."""
    save = tmp_path / "ckpt"
    job = argv + ["--save", save, "--load", save, "--save-interval", "2", *flags]
    env = job_env(**{ENV: str(tmp_path / "samples")})
    (tmp_path / "samples").mkdir()
    with test_bed(list(hosts)) as bed:
        started = start_torchrun(bed, job, tmp_path, nproc=1, nnodes="1:2", env=env,
                                 extra=["--max-restarts", "2", *ELASTIC])
        deadline = time.monotonic() + 240
        while _latest(save) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _latest(save) >= 2, open(started[0][2]).read()[-3000:]
        lost_at = _latest(save)
        result = lose(bed, started)
        codes = wait_all(started[:1], 300)
        texts = {host: open(path).read() for host, _, path in started}
    assert leftovers(bed) == {"namespaces": [], "files": []}
    return codes, texts, lost_at, result


def _assert_resumed_like_uninterrupted(texts, survivor, lost_at, uninterrupted, records):
    """The survivor's job restarted once, resumed from a checkpoint at or after the loss at
    world size 1, and every iteration's consumed samples, loss and samples are the
    uninterrupted run's."""
    _, reference, reference_batches = uninterrupted
    text = texts[survivor]
    assert RESTART in text, text[-4000:]
    resumed = int(LOADED.findall(text)[-1])
    assert resumed >= lost_at
    assert f" > resumed at iteration {resumed} with layout TP 1 x PP 1 x DP 1 (world size 1)" \
        in text, text[-4000:]
    final = {}  # iteration -> (consumed samples, loss), the restarted run's where repeated
    for log in texts.values():
        for iteration, consumed, loss in LINE.findall(log):
            final.setdefault(int(iteration), []).append((int(consumed), float(loss)))
    final = {i: runs[-1] if i > resumed else runs[0] for i, runs in final.items()}
    assert sorted(final) == list(range(1, ITERS + 1)), text[-4000:]
    assert [final[i][0] for i in sorted(final)] == [GLOBAL * i for i in range(1, ITERS + 1)]
    assert [final[i][1] for i in sorted(final)] == pytest.approx(reference, rel=1e-5, abs=1e-6)
    first = sorted(s for (restart, _), batches in records.items() if restart == 0
                   for b in batches for s in b if s < resumed * GLOBAL)
    after = [s for b in records[(1, 0)] for s in b][:(ITERS - resumed) * GLOBAL]
    assert after[0] == resumed * GLOBAL  # the restart drew from where the checkpoint stopped
    drawn = [s for b in reference_batches for s in b][:ITERS * GLOBAL]
    assert first + after == drawn == list(range(ITERS * GLOBAL))


def test_a_killed_host_ends_in_a_restarted_resumed_finished_job(uninterrupted, tmp_path):
    argv = uninterrupted[0]
    codes, texts, lost_at, _ = _run_losing_a_host(tmp_path, argv, lambda bed, _: bed.kill("node02"))
    assert codes == {"node01": 0}, texts["node01"][-4000:]
    assert re.search(r"lost its connection to a peer rank in .*: that rank exited",
                     texts["node01"]), texts["node01"][-4000:]
    _assert_resumed_like_uninterrupted(texts, "node01", lost_at, uninterrupted,
                                       read_records(tmp_path / "samples"))


def _cut_off(bed, started):
    """Pull node01's cable; returns the seconds until its last process has gone (None: not
    within the bound) and whether any of them still had a file open under --save then."""
    bed.link("node01", up=False)
    cut = time.monotonic()
    bound = TIMEOUT_MINUTES * 60 + 30
    while time.monotonic() - cut < bound + 5:
        if not bed.pids("node01"):
            return time.monotonic() - cut
        time.sleep(0.2)
    return None


def test_a_host_cut_off_the_network_ends_in_a_restarted_resumed_finished_job(uninterrupted,
                                                                              tmp_path):
    """node01 holds rank 0 (the rendezvous orders hosts by name) and so the --save lock;
    node02 holds the rendezvous store. Cut off mid-run, node01's rank waits
    --distributed-timeout-minutes, prints its line, releases --save and stops its agent; node02's
    rank prints its line, its agent restarts it alone and it resumes."""
    argv = uninterrupted[0]
    codes, texts, lost_at, gone_after = _run_losing_a_host(
        tmp_path, argv, _cut_off, hosts=("node02", "node01"),
        flags=["--distributed-timeout-minutes", str(TIMEOUT_MINUTES)])
    survivor, cut = texts["node02"], texts["node01"]
    print(f"the cut-off host's processes were gone {gone_after} s after the cut")
    assert codes == {"node02": 0}, survivor[-4000:]
    assert gone_after is not None and gone_after <= TIMEOUT_MINUTES * 60 + 30, cut[-4000:]
    assert SILENT.search(survivor) and "Traceback" not in survivor.split(RESTART)[0], \
        survivor[-4000:]
    line = [ln for ln in cut.splitlines() if ln.startswith("pretrain_gpt.py: error:")]
    assert len(line) == 1 and SILENT.search(line[0]), cut[-4000:]
    assert line[0].endswith(", and this host cannot reach the rendezvous store node02:29400 "
                            "either: it is cut off from the job; stopping its torchrun agent "
                            "too"), line[0]
    assert "Traceback" not in cut, cut[-4000:]
    assert not os.path.exists(tmp_path / "ckpt" / ".megatron_save.lock")
    _assert_resumed_like_uninterrupted(texts, "node02", lost_at, uninterrupted,
                                       read_records(tmp_path / "samples"))
