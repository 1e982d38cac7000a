"""tasks/eval_harness.py: lm-evaluation-harness over a checkpoint, on local YAML tasks,
agrees with tasks/main.py (LAMBADA accuracy exactly, WikiText perplexity within 1e-6)."""
import json
import math
import os
import re
import subprocess
import sys

import torch

from megatron.text_generation import generate
from megatron.tokenizer import ByteLevelTokenizer
from tasks import main as tasks_main
from tasks.zeroshot_gpt.detokenizer import wikitext_detokenize
from tests import oracles
from tests.conftest import ROOT
from tests.distributed.run_ranks import _free_port
from tests.unit.test_tasks import checkpoint  # noqa: F401  (the fixture)

pytestmark = oracles.needs("lm-eval")

CONTEXTS = ["a cat sat on a mat", "aaaa aaaa aaaa", "zz zz zz zz", "ab ab ab ab ab",
            "the dog ran far " * 3 + "away", "x y", "hello hello", "one two one two one",
            "Q", "1 2 3 4", "tick tock tick", "(", "a-b-c", "Mm", "==", "what"]
WIKI_RAW = (" = Title = \n The cat sat on the mat , and the dog @-@ like fox ran . \n"
            " It 's 1 @,@ 000 km ( or so ) long . ") * 3
QUESTION = "Q: abc"
GEN_TOKENS = 6

YAML = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: {output_type}
{body}
"""
LAMBADA_BODY = """doc_to_text: "{{text[:-1]}}"
doc_to_target: "{{text[-1]}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true"""
WIKI_BODY = """doc_to_text: ""
doc_to_target: page
metric_list:
  - metric: word_perplexity"""
GEN_BODY = """doc_to_text: "{{{{q}}}}"
doc_to_target: "{{{{a}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: {tokens}
  do_sample: false
metric_list:
  - metric: exact_match""".format(tokens=GEN_TOKENS)


def _write_task(folder, name, output_type, rows, body):
    data = folder / f"{name}.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / f"{name}.yaml").write_text(YAML.format(name=name, data=data, output_type=output_type,
                                                     body=body))


def run_harness(root, include, out, tmp_path, tp=1):
    """tasks/eval_harness.py in its own process (under torchrun when tp > 1), offline."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", HF_DATASETS_OFFLINE="1",
               HF_HUB_OFFLINE="1", HF_DATASETS_CACHE=str(tmp_path / "hf_cache"),
               HF_HOME=str(tmp_path / "hf_home"))
    launcher = [sys.executable]
    if tp > 1:
        launcher += ["-m", "torch.distributed.run", "--nproc_per_node", str(tp),
                     "--master_addr", "127.0.0.1", "--master_port", str(_free_port())]
    command = launcher + [
        str(ROOT / "tasks" / "eval_harness.py"), "--load", root, "--tensor-model-parallel-size",
        str(tp), "--tasks", "lambada_local,wikitext_local,gen_local", "--include-path",
        str(include), "--offline", "--overlapping-eval", "4", "--batch-size", "3",
        "--bootstrap-iters", "0", "--results-json", str(out)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text()), done.stdout


def _lambada_texts(model, tok):
    """Every other context ends with its greedy next byte when that is printable ASCII (a
    passage the model gets right), the others with another byte; the last BPE (here: byte)
    token is the target."""
    nexts = [n[0] for n in generate(model, tok, CONTEXTS, 1, greedy=True, eod_stop=False)]
    return [c + (chr(n) if i % 2 == 0 and 33 <= n < 127 else "q" if n != ord("q") else "r")
            for i, (c, n) in enumerate(zip(CONTEXTS, nexts))]


def write_tasks(include, model, tok):
    """The three local tasks (LAMBADA-like, WikiText-like, generation); returns their texts."""
    include.mkdir()
    page = wikitext_detokenize(WIKI_RAW)
    answer = tok.detokenize(generate(model, tok, [QUESTION], GEN_TOKENS, greedy=True)[0])
    texts = _lambada_texts(model, tok)
    _write_task(include, "lambada_local", "loglikelihood", [{"text": t} for t in texts],
                LAMBADA_BODY)
    _write_task(include, "wikitext_local", "loglikelihood_rolling", [{"page": page}], WIKI_BODY)
    _write_task(include, "gen_local", "generate_until",
                [{"q": QUESTION, "a": answer.split("\n")[0]}], GEN_BODY)
    return texts, page


def check_against_main(results, root, model, tok, texts, page, tmp_path):
    """The harness's numbers are tasks/main.py's on the same text."""
    lambada = tmp_path / "lambada.jsonl"
    lambada.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    ours = tasks_main.main(["--load", root, "--task", "LAMBADA", "--valid-data", str(lambada)])
    assert 0 < ours["number correct"] < len(texts)  # the check can tell them apart
    assert results["lambada_local"]["acc,none"] == ours["avg accuracy"]

    wiki = tmp_path / "wiki.test.tokens"
    wiki.write_text(WIKI_RAW)
    ours = tasks_main.main(["--load", root, "--task", "WIKITEXT103", "--valid-data", str(wiki),
                            "--overlapping-eval", "4"])
    ids = tok.tokenize(page)
    words = len(re.split(r"\s+", page))
    harness_ll = -math.log(results["wikitext_local"]["word_perplexity,none"]) * words
    with torch.no_grad():  # the harness also scores the first token, after end-of-document
        first = torch.log_softmax(model(torch.tensor([[tok.eod]]), torch.tensor([[0]]))[0, 0], -1)
    ppl = math.exp(-(harness_ll - float(first[ids[0]])) / (len(ids) - 1))
    assert math.isclose(ppl, ours["ppl"], rel_tol=1e-6)
    assert results["gen_local"]["exact_match,none"] == 1.0


def test_harness_matches_tasks_main(checkpoint, tmp_path):  # noqa: F811 (the fixture)
    root, model = checkpoint
    tok = ByteLevelTokenizer()
    texts, page = write_tasks(tmp_path / "tasks", model, tok)
    results, stdout = run_harness(root, tmp_path / "tasks", tmp_path / "harness.json", tmp_path)
    assert "lambada_local" in stdout and "word_perplexity" in stdout  # the harness's table
    check_against_main(results, root, model, tok, texts, page, tmp_path)
