"""Run inside fairseq's own environment (tests/fairseq_ref.py starts it): fairseq's answers.

    python fairseq_side.py logprobs CKPT DATA_DIR IDS.pt OUT.pt
        log-probabilities [b, s, V] of fairseq's model on the ids [b, s]
    python fairseq_side.py eval-lm OUT.json -- <fairseq-eval-lm arguments>
        fairseq-eval-lm itself; its returned loss and perplexity at full precision, and
        the same from its per-token scores summed in float64 (fairseq sums in float32)
    python fairseq_side.py probe
        imports every module the fairseq tests use (tests/install_fairseq.sh checks with it)
"""
import math
import json
import sys

import torch


PROBED = ["fairseq.data.data_utils_fast", "fairseq.tasks", "fairseq.checkpoint_utils",
          "fairseq.data.encoders.gpt2_bpe", "fairseq_cli.preprocess", "fairseq_cli.train",
          "fairseq_cli.eval_lm", "sklearn", "sacremoses"]


def probe():
    import importlib
    for name in PROBED:
        importlib.import_module(name)


def logprobs(ckpt, data, ids_path, out_path):
    from fairseq import checkpoint_utils
    models, _, _ = checkpoint_utils.load_model_ensemble_and_task([ckpt], arg_overrides={"data": data})
    model = models[0].eval()
    with torch.no_grad():
        net = model(torch.load(ids_path, weights_only=True))
        torch.save(model.get_normalized_probs(net, log_probs=True).float(), out_path)


def _float64_sums(scorer_class, sums):
    """Wrap SequenceScorer.generate to add every hypothesis' scores up in float64."""
    generate = scorer_class.generate

    def wrapped(self, models, sample, **kwargs):
        hypos = generate(self, models, sample, **kwargs)
        for hypos_i in hypos:
            scores = hypos_i[0]["positional_scores"].double()
            sums["nats"] += float(scores.sum())
            sums["count"] += scores.numel()
        return hypos
    scorer_class.generate = wrapped


def eval_lm(out_path, argv):
    import fairseq_cli.eval_lm as eval_lm_cli
    results, sums = {}, {"nats": 0.0, "count": 0}
    _float64_sums(eval_lm_cli.SequenceScorer, sums)
    original = eval_lm_cli.main

    def main(cfg, **kwargs):
        out = original(cfg, **kwargs)
        results.update({k: float(v) for k, v in out.items()})
        return out

    eval_lm_cli.main = main
    sys.argv = ["fairseq-eval-lm"] + argv
    eval_lm_cli.cli_main()
    loss64 = -sums["nats"] / sums["count"] / math.log(2)
    results.update(loss_float64=loss64, perplexity_float64=2 ** loss64, count=sums["count"])
    with open(out_path, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    if sys.argv[1] == "logprobs":
        logprobs(*sys.argv[2:6])
    elif sys.argv[1] == "eval-lm":
        eval_lm(sys.argv[2], sys.argv[4:])
    elif sys.argv[1] == "probe":
        probe()
    else:
        raise SystemExit(f"unknown command {sys.argv[1]}")
