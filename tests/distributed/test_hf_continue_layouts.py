"""Continuing a converted Hugging Face model at TP 2 x PP 2 starts from transformers' loss.

The parent saves one small random model per family with a word tokenizer and converts
it to TP 2 x PP 2; one spawn of 4 gloo ranks continues each with `pretrain_gpt.py
--load <converted>` and only data / batch / schedule / --save flags. The first
iteration's loss (last stage) must be transformers' loss on the batch the first stage
trained on; the continued checkpoint exports as the original architecture. In the same
spawn, greedy generation from the TP 2 x PP 2 LLaMA conversion without layout flags (TP 2,
its stages merged in memory, DP 2) gives the tokens of the TP 1 conversion.
"""
import json
import os

from tests import oracles
from tests.distributed.run_ranks import run_ranks
from tests.hf_models import FAMILIES, converted, save_hf_model, save_word_tokenizer
from tests.unit.test_hf_continue import GREEDY, NO_DROPOUT, hf_loss, run_flags
from tools import convert_checkpoint

pytestmark = oracles.needs("transformers")


def _worker(rank, world_size, cases, generate_from):
    import pretrain_gpt
    from tools import generate_samples_gpt
    real, seen = pretrain_gpt.gpt_batch, []

    def recording(*args, **kwargs):
        out = real(*args, **kwargs)
        seen.append((out[0].clone(), out[1].clone()))
        return out
    pretrain_gpt.gpt_batch = recording
    results = {}
    for name, ckpt, save in cases:
        seen.clear()
        state = pretrain_gpt.main(["--load", ckpt, "--tensor-model-parallel-size", "2",
                                   "--pipeline-model-parallel-size", "2", *run_flags(save)])
        history = [h["lm loss"] for h in state.history]
        results[name] = (history[0] if history else None, seen[0] if seen else None)
    # torchrun --nproc_per_node 4 tools/generate_samples_gpt.py --load <TP 2 x PP 2>, no layout
    records = generate_samples_gpt.main(["--load", generate_from, *GREEDY])
    return results, [r["tokens"] for r in records]


def test_continue_at_tp2_pp2_starts_from_transformers_loss(tmp_path):
    cases, models = [], {}
    for name in sorted(FAMILIES):
        work = tmp_path / name
        models[name] = save_hf_model(name, str(work / "hf"), **NO_DROPOUT.get(name, {}))
        save_word_tokenizer(str(work / "hf"), models[name].config.vocab_size - 1)
        cases.append((name, converted(str(work), name, 2, 2), str(work / "trained")))
    from tools import generate_samples_gpt
    llama = tmp_path / "llama"
    reference = [r["tokens"] for r in generate_samples_gpt.main(
        ["--load", converted(str(llama), "llama"), *GREEDY])]
    ranks = run_ranks(_worker, 4, cases, str(llama / "ckpt_tp2_pp2"), timeout=600)
    assert all(tokens == reference for _, tokens in ranks)
    results = [r for r, _ in ranks]
    for name, model in models.items():
        batch = results[0][name][1]  # rank 0: TP rank 0 of the first stage
        last = [r[name][0] for r in results if r[name][0] is not None]
        assert len(last) == 2, (name, last)  # the two TP ranks of the last stage
        expected = hf_loss(model, *batch)
        for loss in last:
            assert abs(loss - expected) / expected < 1e-5, (name, loss, expected)
        exported = tmp_path / name / "exported"
        assert convert_checkpoint.main(["--from", "megatron", "--to", "hf", "--load",
                                        str(tmp_path / name / "trained"), "--save",
                                        str(exported)]) == 0
        config = json.loads((exported / "config.json").read_text())
        assert config["architectures"] == model.config.architectures
        assert os.path.isfile(exported / "tokenizer.json")
