"""Megatron's second name for ``tools/preprocess_data.py``: the same tool, same flags.

The one implementation already spreads the work over ``--workers`` processes.
"""
import os
import sys

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)

from tools.preprocess_data import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
