"""fairseq (`fairseq-fixed` 0.12.3.1) as the reference of the fairseq tests.

fairseq's Cython extensions are built against numpy 1.x and do not import under the
numpy 2 of our environment, so fairseq lives in its own virtual environment (our
environment's packages behind its own numpy 1.26.4; built by tests/install_fairseq.sh) and
runs in subprocesses: its command-line tools, its own Megatron-11b scripts, and
tests/fairseq_side.py. FAIRSEQ_PYTHON names that environment's python; the default is
install_fairseq.sh's. Tests reach it through tests/oracles.py ("fairseq").
"""
import json
import os
import subprocess
from typing import List, Optional

import torch

from tests.data_setup import bpe_dir

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_VENV = os.path.join(os.path.expanduser("~"), ".cache", "megatron-fairseq", "venv")


def fairseq_python() -> Optional[str]:
    """The python of fairseq's environment, or None when fairseq is not installed there."""
    cache = os.environ.get("MEGATRON_FAIRSEQ_CACHE")
    default = os.path.join(cache, "venv") if cache else DEFAULT_VENV
    python = os.environ.get("FAIRSEQ_PYTHON") or os.path.join(default, "bin", "python")
    if not os.path.isfile(python):
        return None
    probe = subprocess.run([python, os.path.join(HERE, "fairseq_side.py"), "probe"],
                           capture_output=True, env=_env())
    return python if probe.returncode == 0 else None


def _env() -> dict:
    """Ours without PYTHONPATH (our `megatron` must not shadow anything there), one thread."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    return env


def run(python: str, args: List[str], cwd: str, timeout: int = 600) -> str:
    """A fairseq module (`-m fairseq_cli.train`) or script in fairseq's environment."""
    done = subprocess.run([python] + args, cwd=cwd, env=_env(), capture_output=True, text=True,
                          timeout=timeout)
    if done.returncode != 0:
        raise AssertionError(f"fairseq {' '.join(args[:2])} failed:\n{done.stderr[-3000:]}")
    return done.stdout + done.stderr


def fairseq_script(python: str, relative: str) -> str:
    """Path of a script shipped in the fairseq package (its examples/)."""
    find = ("import importlib.util as u; "
            "print(u.find_spec('fairseq').submodule_search_locations[0])")  # imports nothing
    out = subprocess.run([python, "-c", find], capture_output=True, text=True, check=True)
    return os.path.join(out.stdout.strip().splitlines()[-1], relative)


def bpe_encode(python: str, src: str, dst: str, cwd: str) -> None:
    """fairseq's GPT-2 BPE encoder script (--keep-empty, as the Megatron-11b README)."""
    script = fairseq_script(python, os.path.join("examples", "roberta", "multiprocessing_bpe_encoder.py"))
    run(python, [script, "--encoder-json", str(bpe_dir() / "vocab.json"),
                 "--vocab-bpe", str(bpe_dir() / "merges.txt"), "--inputs", src,
                 "--outputs", dst, "--keep-empty", "--workers", "1"], cwd)


def detokenize(python: str, src: str, dst: str, cwd: str) -> None:
    """fairseq's examples/megatron_11b/detok.py."""
    script = fairseq_script(python, os.path.join("examples", "megatron_11b", "detok.py"))
    with open(os.path.join(cwd, dst), "w", encoding="utf-8") as f:
        subprocess.run([python, script, src], cwd=cwd, env=_env(), stdout=f, check=True)


def preprocess(python: str, cwd: str, dest: str, srcdict: Optional[str] = None, **prefixes) -> None:
    args = ["-m", "fairseq_cli.preprocess", "--only-source", "--destdir", dest, "--workers", "1"]
    if srcdict:
        args += ["--srcdict", srcdict]
    for split, path in prefixes.items():
        args += [f"--{split}pref", path]
    run(python, args, cwd)


TRAIN_FLAGS = ["--task", "language_modeling", "--arch", "transformer_lm", "--cpu", "--num-workers", "0",
               "--decoder-layers", "2", "--decoder-embed-dim", "32", "--decoder-ffn-embed-dim", "64",
               "--decoder-attention-heads", "4", "--decoder-input-dim", "32",
               "--decoder-output-dim", "32", "--decoder-normalize-before",
               "--share-decoder-input-output-embed", "--activation-fn", "gelu",
               "--tokens-per-sample", "128", "--sample-break-mode", "none", "--batch-size", "8",
               "--max-update", "20", "--optimizer", "adam", "--lr", "0.001",
               "--no-epoch-checkpoints", "--seed", "1", "--disable-validation", "--log-format", "simple"]


def train(python: str, cwd: str, data: str, save_dir: str) -> str:
    """A tiny pre-LN transformer_lm trained 20 updates by fairseq-train; its checkpoint."""
    run(python, ["-m", "fairseq_cli.train", data, "--save-dir", save_dir] + TRAIN_FLAGS, cwd)
    return os.path.join(save_dir, "checkpoint_last.pt")


def logprobs(python: str, ckpt: str, data: str, ids: torch.Tensor, cwd: str) -> torch.Tensor:
    ids_path, out_path = os.path.join(cwd, "ids.pt"), os.path.join(cwd, "logprobs.pt")
    torch.save(ids, ids_path)
    run(python, [os.path.join(HERE, "fairseq_side.py"), "logprobs", ckpt, data, ids_path, out_path], cwd)
    return torch.load(out_path, weights_only=True)


def eval_lm(python: str, data: str, ckpt: str, cwd: str, tokens_per_sample: int,
            context_window: int, subset: str = "test"):
    """(results {loss, perplexity}, the log) of fairseq-eval-lm."""
    out = os.path.join(cwd, "eval_lm.json")
    log = run(python, [os.path.join(HERE, "fairseq_side.py"), "eval-lm", out, "--", data,
                       "--path", ckpt, "--cpu", "--num-workers", "0", "--gen-subset", subset,
                       "--tokens-per-sample", str(tokens_per_sample),
                       "--context-window", str(context_window), "--batch-size", "16"], cwd)
    with open(out) as f:
        return json.load(f), log


def rel_diff(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """Max elementwise relative difference."""
    return float(((ours.double() - ref.double()).abs() / ref.double().abs().clamp_min(1e-30)).max())

