"""Serve a GPT checkpoint over HTTP with Megatron-LM's text-generation API.

    torchrun --nproc_per_node 2 tools/run_text_generation_server.py --load CKPT \\
        --tensor-model-parallel-size 2 --port 5000
    curl -X PUT http://127.0.0.1:5000/api -H 'Content-Type: application/json' \\
        -d '{"prompts": ["The meaning of life is"], "tokens_to_generate": 32, "top_k": 40}'

`PUT /api` takes a JSON object: "prompts" (list of 1..128 strings), and optionally
"tokens_to_generate" (int >= 0, default 64), "temperature" (0 < t <= 100,
default 1), "top_k" (0..1000; 1 is greedy), "top_p" (0..1), "logprobs" (bool),
"random_seed" (int >= 0: sampling reproducible per request), "add_BOS"
(bool: start each prompt with end-of-document; needed for empty prompts) and
"no_log" (bool). It answers {"text": [...], "segments": [[...]], "logprobs": ...}:
each prompt followed by its continuation, the same split into tokens, and
(with "logprobs") the log-probability of every token after the first under the
model (temperature 1, normalized over the tokenizer's vocabulary: padding
rows never count), else null. A bad request gets
HTTP 400 and a one-line reason; the server goes on serving.

Rank 0 serves (Flask on waitress); the other ranks wait for each request,
broadcast to them as a small header tensor and the request's JSON bytes, and
all ranks run the generation together. Requests are served one at a time in
arrival order. Model and tokenizer flags default to the checkpoint's stored
config. Pipeline-parallel checkpoints must be re-sharded to one stage first.
"""
import json
import os
import signal
import sys
import threading
from dataclasses import asdict, dataclass
from typing import Dict, List, Optional

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from megatron.arguments import build_parser, fail  # noqa: E402
from megatron.text_generation import GenerationError, forward_full, generate  # noqa: E402
from megatron.checkpointing.io import CheckpointError  # noqa: E402
from megatron.training.initialize import initialize_distributed  # noqa: E402
from megatron.training.checkpoint_setup import (build_tokenizer_and_vocab,  # noqa: E402
                                            load_inference_models, parse_inference_args)

MAX_PROMPTS = 128
UNSUPPORTED = ("beam_width", "top_p_decay", "top_p_bound", "stop_on_double_eol", "stop_on_eol",
               "prevent_newline_after_colon", "stop_token", "length_penalty")
RENAMED = {"max_len": "tokens_to_generate", "sentences": "prompts"}
GENERATE, NOOP, STOP = 0, 1, 2  # commands rank 0 broadcasts to the other ranks
HEARTBEAT_S = 60.0  # an idle server pings the other ranks so their wait never times out


class BadRequest(ValueError):
    """A request the server refuses with HTTP 400; the message is the one-line reason."""


@dataclass
class Request:
    """A validated generation request (the fields of Megatron's API)."""

    prompts: List[str]
    tokens_to_generate: int = 64
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 0.0
    logprobs: bool = False
    random_seed: int = -1
    add_BOS: bool = False
    no_log: bool = False


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check(ok: bool, reason: str) -> None:
    if not ok:
        raise BadRequest(reason)


def _check_prompts(prompts, add_bos: bool) -> None:
    _check(isinstance(prompts, list) and all(isinstance(p, str) for p in prompts),
           "prompts must be a list of strings")
    _check(0 < len(prompts) <= MAX_PROMPTS,
           f"prompts must hold 1 to {MAX_PROMPTS} strings, got {len(prompts)}")
    _check(add_bos or all(prompts), "an empty prompt needs add_BOS: true")


def parse_request(body) -> Request:
    """Validate a request body (the decoded JSON); raises BadRequest with the reason."""
    _check(isinstance(body, dict), "the body must be a JSON object with a \"prompts\" list")
    for old, new in RENAMED.items():
        _check(old not in body, f"{old} is not used any more; send {new}")
    unsupported = [k for k in body if k in UNSUPPORTED]
    _check(not unsupported, f"{', '.join(unsupported)}: not supported by this server")
    unknown = sorted(set(body) - set(Request.__dataclass_fields__) - set(UNSUPPORTED))
    _check(not unknown, f"unknown field(s): {', '.join(unknown)}")
    _check("prompts" in body, "prompts is required: a list of strings")
    req = Request(**body)
    _check(_is_int(req.tokens_to_generate) and req.tokens_to_generate >= 0,
           "tokens_to_generate must be an integer >= 0")
    for name in ("logprobs", "add_BOS", "no_log"):
        _check(isinstance(getattr(req, name), bool), f"{name} must be true or false")
    _check(req.tokens_to_generate > 0 or req.logprobs,
           "tokens_to_generate 0 only makes sense with logprobs: true")
    _check(_is_number(req.temperature) and 0.0 < req.temperature <= 100.0,
           "temperature must be a number in (0, 100]")
    _check(_is_int(req.top_k) and 0 <= req.top_k <= 1000, "top_k must be an integer in 0..1000")
    _check(_is_number(req.top_p) and 0.0 <= req.top_p <= 1.0, "top_p must be a number in [0, 1]")
    _check(not (req.top_k > 0 and req.top_p > 0), "top_k and top_p cannot both be set")
    _check(_is_int(req.random_seed) and req.random_seed >= -1,
           "random_seed must be an integer >= 0")
    _check_prompts(req.prompts, req.add_BOS)
    return req


def _prompt_ids(req: Request, tokenizer) -> List[List[int]]:
    bos = [tokenizer.eod] if req.add_BOS else []
    return [bos + tokenizer.tokenize(p) for p in req.prompts]


def _log_probs(model, rows: List[List[int]], eod: int) -> List[List[float]]:
    """Log-probability of each token after the first of every row, under the model."""
    longest = max(len(r) for r in rows)
    tokens = torch.full((len(rows), longest), eod, dtype=torch.long,
                        device=model.head_weight().device)
    for i, row in enumerate(rows):
        tokens[i, :len(row)] = torch.tensor(row, dtype=torch.long)
    logits = forward_full(model, tokens).float()
    chosen = F.log_softmax(logits[:, :-1], dim=-1).gather(-1, tokens[:, 1:, None])[..., 0]
    return [chosen[i, :len(row) - 1].tolist() for i, row in enumerate(rows)]


def run_request(model, tokenizer, req: Request) -> Dict:
    """Generate for a request (every rank calls this together); Megatron's response."""
    prompts = _prompt_ids(req, tokenizer)
    greedy = req.top_k == 1
    new = generate(model, tokenizer, prompts, req.tokens_to_generate, greedy=greedy,
                   top_k=0 if greedy else req.top_k, top_p=req.top_p,
                   temperature=req.temperature,
                   seed=None if req.random_seed < 0 else req.random_seed)
    rows = [p + n for p, n in zip(prompts, new)]
    logprobs = _log_probs(model, rows, tokenizer.eod) if req.logprobs else None
    return {"text": [tokenizer.detokenize(r) for r in rows],
            "segments": [[tokenizer.detokenize([t]) for t in r] for r in rows],
            "logprobs": logprobs}


class Broadcaster:
    """Rank 0 sends each command (and request) to every other rank over the world group."""

    def __init__(self, device):
        self.device = device
        self.active = dist.is_initialized() and dist.get_world_size() > 1

    def send(self, command: int, req: Optional[Request] = None) -> None:
        if not self.active:
            return
        payload = json.dumps(asdict(req)).encode() if req is not None else b""
        header = torch.tensor([command, len(payload)], dtype=torch.long, device=self.device)
        dist.broadcast(header, src=0)
        if payload:
            data = torch.tensor(list(payload), dtype=torch.uint8, device=self.device)
            dist.broadcast(data, src=0)

    def receive(self):
        """(command, Request or None), on a rank other than 0."""
        header = torch.zeros(2, dtype=torch.long, device=self.device)
        dist.broadcast(header, src=0)
        command, size = (int(v) for v in header.tolist())
        if not size:
            return command, None
        data = torch.empty(size, dtype=torch.uint8, device=self.device)
        dist.broadcast(data, src=0)
        return command, Request(**json.loads(bytes(data.tolist()).decode()))


def follow(model, tokenizer, channel: Broadcaster) -> None:
    """The loop of every rank but 0: run each broadcast request until told to stop."""
    while True:
        command, req = channel.receive()
        if command == STOP:
            return
        if command == GENERATE:
            try:
                run_request(model, tokenizer, req)
            except GenerationError:
                pass  # rank 0 reports it to the client


class Server:
    """Rank 0's side: validates, queues (one request at a time) and answers requests."""

    def __init__(self, model, tokenizer, channel: Broadcaster):
        self.model, self.tokenizer, self.channel = model, tokenizer, channel
        self.lock = threading.Lock()
        self.stopped = threading.Event()

    def handle(self, body):
        """(status, JSON-able body or one-line reason) of one request."""
        try:
            req = parse_request(body)
        except BadRequest as err:
            return 400, str(err)
        with self.lock:
            if self.stopped.is_set():
                return 503, "the server is shutting down"
            if not req.no_log:
                print(f" request: {len(req.prompts)} prompt(s), tokens_to_generate "
                      f"{req.tokens_to_generate}", flush=True)
            self.channel.send(GENERATE, req)
            try:
                return 200, run_request(self.model, self.tokenizer, req)
            except GenerationError as err:
                return 400, str(err).splitlines()[0]

    def heartbeat(self) -> None:
        while not self.stopped.wait(HEARTBEAT_S):
            with self.lock:
                if not self.stopped.is_set():
                    self.channel.send(NOOP)

    def stop(self) -> None:
        with self.lock:
            if not self.stopped.is_set():
                self.stopped.set()
                self.channel.send(STOP)


def build_app(server: Server):
    from flask import Flask, jsonify, request
    app = Flask("megatron_text_generation")

    @app.route("/api", methods=["PUT"])
    def api():
        body = request.get_json(silent=True)
        if body is None:
            return "the body must be JSON (Content-Type: application/json)", 400
        status, answer = server.handle(body)
        return (jsonify(answer), status) if status == 200 else (answer, status)

    return app


def get_parser():
    parser = build_parser("Serve a GPT checkpoint over HTTP (PUT /api)")
    g = parser.add_argument_group("text generation server")
    g.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (0.0.0.0: every interface)")
    g.add_argument("--port", type=int, default=5000)
    g.add_argument("--server-threads", type=int, default=8,
                   help="HTTP worker threads (requests still run one at a time)")
    return parser


def serve(server: Server, host: str, port: int, threads: int) -> None:
    """Serve until SIGINT / SIGTERM, then release the other ranks."""
    from waitress import serve as waitress_serve
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    threading.Thread(target=server.heartbeat, daemon=True).start()
    print(f" * serving PUT http://{host}:{port}/api", flush=True)
    try:
        waitress_serve(build_app(server), host=host, port=port, threads=threads)
    except KeyboardInterrupt:
        pass
    except OSError as err:  # the address is in use or cannot be bound
        fail(f"--host {host} --port {port}: cannot listen there ({err.strerror or err}); "
             f"choose another --port")
    finally:
        server.stop()  # the heartbeat thread ends and the other ranks are released


def main(argv=None) -> None:
    config, ns, stored = parse_inference_args(get_parser(), argv, one_stage=True)
    if config.parallel.pipeline_model_parallel_size > 1:
        fail("the server needs one pipeline stage; re-shard the checkpoint with "
             "tools/merge_mp_partitions.py --target-pipeline-model-parallel-size 1")
    if not 0 < ns.port < 65536 or ns.server_threads < 1:
        fail(f"--port must be in 1..65535 (got {ns.port}) and --server-threads >= 1 "
             f"(got {ns.server_threads})")
    tokenizer = build_tokenizer_and_vocab(config, stored)
    pstate, device = initialize_distributed(config)
    try:
        models, _ = load_inference_models(config, pstate, device, vocab_size=tokenizer.vocab_size)
    except CheckpointError as err:
        fail(str(err))
    channel = Broadcaster(device)
    if dist.is_initialized() and dist.get_rank() != 0:
        follow(models[0], tokenizer, channel)
    else:
        serve(Server(models[0], tokenizer, channel), ns.host, ns.port, ns.server_threads)


if __name__ == "__main__":
    main()
