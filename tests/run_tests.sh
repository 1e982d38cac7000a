#!/usr/bin/env bash
# Install the framework and the test dependencies, then run the whole test suite.
#   bash tests/run_tests.sh [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
# torch: keep an installed build; otherwise the pinned CPU wheel (never an unpinned resolve).
$PY -c "import torch" 2>/dev/null || $PY -m pip install -q torch==2.13.0
$PY -m pip install -q -e ".[test]"
# fairseq, the reference of tests/distributed/test_fairseq.py, in its own venv (numpy 1.x);
# the wheel is cached under ~/.cache/megatron-fairseq. Without it those tests skip.
bash tests/install_fairseq.sh "$PY" || echo "run_tests.sh: fairseq could not be installed; its tests will skip" >&2
exec $PY -m pytest -q -p no:cacheprovider tests "$@"
