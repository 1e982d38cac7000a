"""Run inside fairseq's own environment (tests/fairseq_ref.py starts it): fairseq's answers.

    python fairseq_side.py logprobs CKPT DATA_DIR IDS.pt OUT.pt
        log-probabilities [b, s, V] of fairseq's model on the ids [b, s]
    python fairseq_side.py eval-lm OUT.json -- <fairseq-eval-lm arguments>
        fairseq-eval-lm itself; its returned loss and perplexity at full precision
"""
import json
import sys

import torch


def logprobs(ckpt, data, ids_path, out_path):
    from fairseq import checkpoint_utils
    models, _, _ = checkpoint_utils.load_model_ensemble_and_task([ckpt], arg_overrides={"data": data})
    model = models[0].eval()
    with torch.no_grad():
        net = model(torch.load(ids_path))
        torch.save(model.get_normalized_probs(net, log_probs=True).float(), out_path)


def eval_lm(out_path, argv):
    import fairseq_cli.eval_lm as eval_lm_cli
    results = {}
    original = eval_lm_cli.main

    def main(cfg, **kwargs):
        out = original(cfg, **kwargs)
        results.update({k: float(v) for k, v in out.items()})
        return out

    eval_lm_cli.main = main
    sys.argv = ["fairseq-eval-lm"] + argv
    eval_lm_cli.cli_main()
    with open(out_path, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    if sys.argv[1] == "logprobs":
        logprobs(*sys.argv[2:6])
    elif sys.argv[1] == "eval-lm":
        eval_lm(sys.argv[2], sys.argv[4:])
    else:
        raise SystemExit(f"unknown command {sys.argv[1]}")
