"""tools/run_text_generation_server.py: request validation, and a real HTTP client against
the server at TP=2 on CPU (torchrun), compared with tools/generate_samples_gpt.py at TP=2."""
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from megatron.tokenizer import ByteLevelTokenizer
from tests.conftest import ROOT
from tests.distributed.run_ranks import _free_port, run_ranks
from tests.unit.test_generation import checkpoint  # noqa: F401  (the fixture)
from tools import merge_mp_partitions, text_generation_cli
from tools.run_text_generation_server import BadRequest, parse_request

requests = pytest.importorskip("requests")
pytest.importorskip("waitress")

PROMPTS = ["Once upon a time", "The cat", "x", "a much longer prompt than the others",
           "1 2 3", "Hello, world", "zzz", "The meaning of", "q", "GPT"]
NEW_TOKENS = 12
SEED = 100


# -- validation (no server) -------------------------------------------------------------
@pytest.mark.parametrize("body, reason", [
    ([1], "JSON object"), ({}, "prompts is required"), ({"prompts": "a"}, "list of strings"),
    ({"prompts": []}, "1 to 128"), ({"prompts": [""]}, "add_BOS"),
    ({"prompts": ["a"], "max_len": 3}, "send tokens_to_generate"),
    ({"prompts": ["a"], "tokens_to_generate": -1}, "tokens_to_generate"),
    ({"prompts": ["a"], "tokens_to_generate": 0}, "logprobs"),
    ({"prompts": ["a"], "temperature": 0}, "temperature"),
    ({"prompts": ["a"], "top_k": 2.5}, "top_k"), ({"prompts": ["a"], "top_p": 2.0}, "top_p"),
    ({"prompts": ["a"], "top_k": 3, "top_p": 0.5}, "cannot both"),
    ({"prompts": ["a"], "random_seed": "7"}, "random_seed"),
    ({"prompts": ["a"], "logprobs": 1}, "logprobs"),
    ({"prompts": ["a"], "beam_width": 2}, "not supported"), ({"prompts": ["a"], "x": 1}, "unknown"),
])
def test_bad_requests_name_the_problem(body, reason):
    with pytest.raises(BadRequest, match=reason):
        parse_request(body)


def test_good_request_defaults():
    req = parse_request({"prompts": ["a", ""], "add_BOS": True, "top_p": 0.9, "random_seed": 3})
    assert (req.tokens_to_generate, req.temperature, req.top_k, req.top_p) == (64, 1.0, 0, 0.9)


# -- the server at TP=2 -------------------------------------------------------------------
def _reference(rank, world_size, root):
    """What tools/generate_samples_gpt.py gives at TP=2: greedy, then seeded top-k sampling
    (--micro-batch-size 1: prompt i is drawn with seed SEED + i)."""
    from tools import generate_samples_gpt
    base = ["--load", root, "--tensor-model-parallel-size", "2", "--micro-batch-size", "1",
            "--out-seq-length", str(NEW_TOKENS)] + [a for p in PROMPTS for a in ("--prompt", p)]
    greedy = generate_samples_gpt.main(base + ["--greedy"])
    sampled = generate_samples_gpt.main(base + ["--top_k", "5", "--seed", str(SEED)])
    return [r["tokens"] for r in greedy], [r["tokens"] for r in sampled]


def _start_server(root, port, log):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
               "--master_addr", "127.0.0.1", "--master_port", str(_free_port()),
               str(ROOT / "tools" / "run_text_generation_server.py"), "--load", root,
               "--tensor-model-parallel-size", "2", "--port", str(port)]
    return subprocess.Popen(command, cwd=str(ROOT), env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)


def _wait_listening(proc, port, log_path, timeout=120.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"the server exited ({proc.returncode}):\n{open(log_path).read()[-3000:]}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.5)
    pytest.fail(f"the server did not listen within {timeout} s:\n{open(log_path).read()[-3000:]}")


def _stop(proc):
    if proc.poll() is None:
        proc.terminate()  # torchrun passes SIGTERM on to its ranks
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def _put(url, body):
    return requests.put(url, json=body, timeout=120)


def _ask_all(url):
    """The 20 requests at once: every prompt greedily and with its seed."""
    bodies = [{"prompts": [p], "tokens_to_generate": NEW_TOKENS, "top_k": 1} for p in PROMPTS]
    bodies += [{"prompts": [p], "tokens_to_generate": NEW_TOKENS, "top_k": 5,
                "random_seed": SEED + i} for i, p in enumerate(PROMPTS)]
    with ThreadPoolExecutor(len(bodies)) as pool:
        answers = list(pool.map(lambda body: _put(url, body), bodies))
    assert [a.status_code for a in answers] == [200] * len(bodies)
    return [a.json() for a in answers]


def _check_bad_requests(url):
    for response in (requests.put(url, data="not json", timeout=60,
                                  headers={"Content-Type": "application/json"}),
                     _put(url, {"prompts": "a"}),
                     _put(url, {"prompts": ["a"], "top_k": 3, "top_p": 0.5}),
                     _put(url, {"prompts": ["x" * 60], "tokens_to_generate": 10})):  # > 64 places
        assert response.status_code == 400, response.text
        assert response.text.strip() and len(response.text.strip().splitlines()) == 1


def test_server_at_tp2_matches_the_sampling_tool(checkpoint, tmp_path, capsys):
    model = checkpoint[1]
    root = str(tmp_path / "tp2")
    assert merge_mp_partitions.main(["--load", str(checkpoint[0]), "--save", root,
                                     "--target-tensor-model-parallel-size", "2"]) == 0
    greedy, sampled = run_ranks(_reference, 2, root, timeout=240)[0]
    tok = ByteLevelTokenizer()
    expected = [tok.detokenize(tok.tokenize(p) + ids)
                for p, ids in zip(PROMPTS * 2, greedy + sampled)]
    assert greedy != sampled

    port, log_path = _free_port(), tmp_path / "server.log"
    url = f"http://127.0.0.1:{port}/api"
    with open(log_path, "w") as log:
        proc = _start_server(root, port, log)
        try:
            _wait_listening(proc, port, log_path)
            answers = _ask_all(url)
            assert [a["text"][0] for a in answers] == expected
            assert all(a["logprobs"] is None and "".join(a["segments"][0]) == a["text"][0]
                       for a in answers[:3])
            _check_bad_requests(url)
            scored = _put(url, {"prompts": [PROMPTS[0]], "tokens_to_generate": NEW_TOKENS,
                                "top_k": 1, "logprobs": True}).json()  # still serving
            assert scored["text"][0] == expected[0]
            capsys.readouterr()
            assert text_generation_cli.main([f"127.0.0.1:{port}", "--prompt", PROMPTS[1],
                                             "--top_k", "1", "--tokens-to-generate",
                                             str(NEW_TOKENS)]) == 0
            assert capsys.readouterr().out == f"Megatron Response: {expected[1]}\n"
        finally:
            _stop(proc)
    ids = torch.tensor([tok.tokenize(PROMPTS[0]) + greedy[0]])
    model.vocab_limit = tok.vocab_size  # as the server loads it: padding rows never count
    with torch.no_grad():
        logits = model(ids, torch.arange(ids.shape[1]).unsqueeze(0))[0, :-1]
    want = torch.log_softmax(logits.float(), -1).gather(-1, ids[0, 1:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(scored["logprobs"][0]), want, rtol=1e-4, atol=1e-4)
