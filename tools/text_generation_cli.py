"""A small client of tools/run_text_generation_server.py (Megatron-LM's `text_generation_cli.py`).

    python tools/text_generation_cli.py localhost:5000          # asks for prompts on stdin
    python tools/text_generation_cli.py localhost:5000 --prompt "Hello" --tokens-to-generate 16 \\
        --top_k 1 --logprobs

Each answer is printed as "Megatron Response: <text>" (the prompt and its
continuation); with --logprobs the log-probabilities follow on one line. A
refused request prints the server's reason on stderr and exits 1.
"""
import argparse
import json
import sys
import urllib.error
import urllib.request
from typing import Dict, Optional


class ServerError(RuntimeError):
    """The server refused the request or could not be reached; the message says why."""


def put(url: str, request: Dict, timeout: float = 600.0) -> Dict:
    """Send one request to `url` (host:port or a full URL) and return the decoded answer."""
    if "://" not in url:
        url = f"http://{url}"
    if not url.rstrip("/").endswith("/api"):
        url = url.rstrip("/") + "/api"
    data = json.dumps(request).encode()
    call = urllib.request.Request(url, data=data, method="PUT",
                                  headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(call, timeout=timeout) as answer:
            return json.loads(answer.read().decode())
    except urllib.error.HTTPError as err:
        reason = err.read().decode(errors="replace").strip()
        raise ServerError(f"HTTP {err.code}: {reason}") from None
    except (urllib.error.URLError, OSError) as err:
        raise ServerError(f"cannot reach {url}: {getattr(err, 'reason', err)}") from None


def build_request(prompt: str, ns) -> Dict:
    request = {"prompts": [prompt], "tokens_to_generate": ns.tokens_to_generate,
               "temperature": ns.temperature, "top_k": ns.top_k, "top_p": ns.top_p,
               "logprobs": ns.logprobs}
    if ns.random_seed is not None:
        request["random_seed"] = ns.random_seed
    return request


def get_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("url", help="the server: host:port or http://host:port/api")
    parser.add_argument("--prompt", action="append", default=None,
                        help="a prompt (repeatable); without it, prompts are read from stdin")
    parser.add_argument("--tokens-to-generate", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top_k", "--top-k", dest="top_k", type=int, default=0)
    parser.add_argument("--top_p", "--top-p", dest="top_p", type=float, default=0.0)
    parser.add_argument("--random-seed", type=int, default=None)
    parser.add_argument("--logprobs", action="store_true")
    return parser


def _prompts(ns):
    if ns.prompt:
        yield from ns.prompt
        return
    while True:
        try:
            yield input("Enter prompt: ")
        except EOFError:
            return


def main(argv: Optional[list] = None) -> int:
    ns = get_parser().parse_args(argv)
    for prompt in _prompts(ns):
        try:
            answer = put(ns.url, build_request(prompt, ns))
        except ServerError as err:
            print(f"text_generation_cli.py: error: {err}", file=sys.stderr)
            return 1
        print(f"Megatron Response: {answer['text'][0]}", flush=True)
        if answer.get("logprobs"):
            print(f"Logprobs: {json.dumps(answer['logprobs'][0])}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
