"""Peak memory at load: torch_dist reads each rank's share only (issue 20).

A GPT of 8 layers, hidden 256 (about 8.5 M parameters) trains one iteration at TP 2 and is
saved in torch_dist and in the torch format; then each is loaded at TP 1 x PP 2 (torch_dist
directly, the torch one with --universal-checkpoint). A thread samples the resident set
(/proc/self/statm, every 0.2 ms) during `api.load`; the peak growth over the resident
set before the load must stay below 1.25 x the rank's own share of weights and optimizer
state. The universal path's peak is printed for comparison (it reads and merges every
rank's full files). One spawn of 2 gloo ranks.
"""
import os
import threading
import time

import pytest

from tests.distributed.run_ranks import run_ranks
from tests.gpt_setup import preprocess_wiki, tiny_gpt_argv


PAGE = os.sysconf("SC_PAGE_SIZE")


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


class PeakRss:
    """The largest resident-set growth seen while the block runs."""

    def __enter__(self):
        self.base, self.peak, self._stop = _rss(), 0, False
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop:
            self.peak = max(self.peak, _rss() - self.base)
            time.sleep(0.0002)

    def __exit__(self, *exc):
        self._stop = True
        self._thread.join()
        self.peak = max(self.peak, _rss() - self.base)


def _own_share(models, optimizer) -> int:
    """Bytes of this rank's weights and optimizer state (main params, moments)."""
    import torch
    weights = sum(p.numel() * p.element_size() for m in models for p in m.parameters())
    state = sum(v.numel() * v.element_size() for s in optimizer.optimizer.state.values()
                for v in s.values() if torch.is_tensor(v) and v.dim() > 0)
    return weights + state


def _measured_load(record, load):
    """`load` (api.load), recording the peak memory growth while it runs."""
    def measured(root, run, **kwargs):
        with PeakRss() as peak:
            result = load(root, run, **kwargs)
        record.update(peak=peak.peak, share=_own_share(run.models, run.optimizer))
        return result
    return measured


def _argv(prefix, cache, *extra, iters):
    return tiny_gpt_argv(prefix, cache, "--eval-iters", "0", *extra, layers=8, hidden=256,
                         heads=4, iters=iters)


def _rank(rank, world_size, prefix, workdir):
    import pretrain_gpt
    from megatron.checkpointing import api
    cache = os.path.join(workdir, "cache")
    tp2 = ["--tensor-model-parallel-size", "2"]
    dist_dir, torch_dir = os.path.join(workdir, "dist"), os.path.join(workdir, "torch")
    pretrain_gpt.main(_argv(prefix, cache, *tp2, "--ckpt-format", "torch_dist", "--save",
                            dist_dir, iters=1))
    pretrain_gpt.main(_argv(prefix, cache, *tp2, "--save", torch_dir, iters=1))
    results, load = {}, api.load
    for name, extra in (("torch_dist", ["--ckpt-format", "torch_dist", "--load", dist_dir]),
                        ("universal", ["--universal-checkpoint", "--load", torch_dir])):
        record = {}
        api.load = _measured_load(record, load)
        pretrain_gpt.main(_argv(prefix, cache, "--pipeline-model-parallel-size", "2", *extra,
                                iters=1))
        results[name] = record
    return results


@pytest.fixture(scope="module")
def spawn2(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist-memory")
    return run_ranks(_rank, 2, preprocess_wiki(out, docs=10), str(out), timeout=900)


def test_torch_dist_load_peak_below_own_share(spawn2):
    for rank, result in enumerate(spawn2):
        dist, universal = result["torch_dist"], result["universal"]
        print(f"rank {rank}: own share {dist['share'] / 2**20:.1f} MiB, peak growth at load: "
              f"torch_dist {dist['peak'] / 2**20:.1f} MiB, --universal-checkpoint "
              f"{universal['peak'] / 2**20:.1f} MiB")
        assert dist["share"] > 20 * 2**20, dist  # the model is large enough to measure
        assert dist["peak"] < 1.25 * dist["share"], (rank, result)
