"""Write a small corpus of real English text that every Python installation has.

    python tools/stdlib_corpus.py --output corpus.jsonl [--max-mb 4]

Documents (loose JSON, one {"text": ...} per line) come from the language
reference topics in `pydoc_data.topics` and the docstrings of the standard
library's top-level modules, in a fixed order, so the quick start needs no
download and gives the same corpus on every machine with the same Python.
"""
import argparse
import ast
import json
import os
import sys
import sysconfig

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)

from megatron.files import write_durably  # noqa: E402


def pydoc_topics():
    try:
        from pydoc_data.topics import topics
    except ImportError:  # some distributions strip it; docstrings remain
        return
    for name in sorted(topics):
        text = topics[name].strip()
        if text:
            yield text


def module_docstrings(max_files: int = 400):
    stdlib = sysconfig.get_paths()["stdlib"]
    files = sorted(f for f in os.listdir(stdlib) if f.endswith(".py"))[:max_files]
    for filename in files:
        try:
            with open(os.path.join(stdlib, filename), encoding="utf-8") as f:
                tree = ast.parse(f.read())
        except (SyntaxError, UnicodeDecodeError, OSError):
            continue
        docs = [ast.get_docstring(node) for node in ast.walk(tree)
                if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef))]
        text = "\n\n".join(d.strip() for d in docs if d and len(d.split()) >= 8)
        if text:
            yield text


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", required=True, help="loose JSON file to write")
    parser.add_argument("--max-mb", type=float, default=4.0, help="stop after this many MB of text")
    args = parser.parse_args(argv)
    limit = int(args.max_mb * 1e6)
    texts, written = [], 0
    for text in list(pydoc_topics()) + list(module_docstrings()):
        if written >= limit:
            break
        texts.append(text)
        written += len(text)
    write_durably(args.output, lambda out: [out.write((json.dumps({"text": t}) + "\n").encode())
                                            for t in texts])
    docs = len(texts)
    print(f"wrote {docs} documents ({written / 1e6:.2f} MB of text) to {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
