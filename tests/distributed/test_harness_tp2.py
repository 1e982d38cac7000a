"""tasks/eval_harness.py at TP=2 under torchrun gives tasks/main.py's numbers (TP=1)."""
from megatron.tokenizer import ByteLevelTokenizer
from tests import oracles
from tests.unit.test_harness import check_against_main, run_harness, write_tasks
from tests.unit.test_tasks import checkpoint  # noqa: F401  (the fixture)
from tools import merge_mp_partitions

pytestmark = oracles.needs("lm-eval")


def test_harness_at_tp2(checkpoint, tmp_path):  # noqa: F811 (the fixture)
    root, model = checkpoint
    tp2 = str(tmp_path / "tp2")
    assert merge_mp_partitions.main(["--load", root, "--save", tp2,
                                     "--target-tensor-model-parallel-size", "2"]) == 0
    tok = ByteLevelTokenizer()
    texts, page = write_tasks(tmp_path / "tasks", model, tok)
    results, _ = run_harness(tp2, tmp_path / "tasks", tmp_path / "harness.json", tmp_path, tp=2)
    check_against_main(results, root, model, tok, texts, page, tmp_path)
