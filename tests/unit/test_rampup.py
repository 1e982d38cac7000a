"""--rampup-batch-size START INCR SAMPLES: the global batch grows with the consumed
samples, the log line reports it, the lr schedule advances by samples, and a
resumed run continues the ramp where it stopped."""
import re

import pytest

import pretrain_gpt
from tests.gpt_setup import one_thread, preprocess_wiki, tiny_gpt_argv

# START 2, INCR 2, SAMPLES 24 towards --global-batch-size 8: (8 - 2) / 2 = 3 increments,
# one every 24 / 3 = 8 consumed samples (micro batch 2, one rank).
RAMPUP = ["--rampup-batch-size", "2", "2", "24"]
BATCHES = [2, 2, 2, 2, 4, 4, 6, 6, 8, 8]
CONSUMED = [2, 4, 6, 8, 12, 16, 22, 28, 36, 44]
LOG = re.compile(r" iteration +(\d+)/ +(\d+) \| consumed samples: +(\d+) \| .*"
                 r"learning rate: ([0-9.E+-]+) \| global batch size: +(\d+) \|")


def expected_lr(consumed: int, max_lr=1e-3, train_iters=10, gbs=8, warmup_fraction=0.1) -> float:
    """Linear warm-up then linear decay, both measured in samples (Megatron's rule:
    decay over train_iters x the final global batch)."""
    decay = train_iters * gbs
    warmup = int(warmup_fraction * decay)
    if consumed <= warmup:
        return max_lr * consumed / warmup
    return max_lr * (1.0 - (consumed - warmup) / (decay - warmup))


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("corpus")
    return preprocess_wiki(tmp, docs=3), str(tmp / "cache")


def _train(corpus, capsys, *extra):
    """Run pretrain_gpt in this process; returns (state, parsed log lines)."""
    prefix, cache = corpus
    capsys.readouterr()
    with one_thread():
        state = pretrain_gpt.main(tiny_gpt_argv(prefix, cache, "--eval-iters", "0", *RAMPUP,
                                                *extra, layers=1, hidden=32, iters=10))
    lines = [LOG.search(line) for line in capsys.readouterr().out.splitlines()]
    return state, [(int(m[1]), int(m[3]), float(m[4]), int(m[5])) for m in lines if m]


def test_rampup_grows_the_batch_and_moves_the_lr_by_samples(small_corpus, capsys):
    state, log = _train(small_corpus, capsys)
    assert [entry[0] for entry in log] == list(range(1, 11))
    assert [entry[3] for entry in log] == BATCHES
    assert [entry[1] for entry in log] == CONSUMED
    assert state.consumed_train == 44 and state.iteration == 10
    for (_, consumed, lr, _), c in zip(log, CONSUMED):
        assert lr == pytest.approx(expected_lr(c), rel=1e-3, abs=1e-9), (consumed, lr)
    assert log[3][2] == pytest.approx(1e-3, rel=1e-3)  # warm-up ends at 8 samples, iteration 4


def test_resumed_rampup_continues_from_the_consumed_samples(small_corpus, capsys, tmp_path):
    save = str(tmp_path / "ckpt")
    first, log = _train(small_corpus, capsys, "--save", save, "--exit-interval", "5")
    assert [entry[3] for entry in log] == BATCHES[:5]
    resumed, log = _train(small_corpus, capsys, "--load", save)
    assert [entry[0] for entry in log] == list(range(6, 11))
    assert [entry[3] for entry in log] == BATCHES[5:]
    assert [entry[1] for entry in log] == CONSUMED[5:]
    assert [entry[2] for entry in log] == pytest.approx([expected_lr(c) for c in CONSUMED[5:]],
                                                        rel=1e-3)
