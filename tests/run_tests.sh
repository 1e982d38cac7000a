#!/usr/bin/env bash
# Install the framework and the test dependencies, then run the whole test suite.
#   bash tests/run_tests.sh [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
# torch: keep an installed build; otherwise the pinned CPU wheel (never an unpinned resolve).
$PY -c "import torch" 2>/dev/null || $PY -m pip install -q torch==2.13.0
$PY -m pip install -q -e ".[test]"
# Megatron-Core 0.16.1: the reference of the MoE layer tests (../shared/references.md); no deps,
# so torch and numpy stay as they are.
$PY -m pip install -q --no-deps megatron-core==0.16.1 packaging psutil
exec $PY -m pytest -q -p no:cacheprovider tests "$@"
