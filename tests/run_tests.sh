#!/usr/bin/env bash
# Install the framework and the test dependencies, then run the whole test suite.
#   bash tests/run_tests.sh [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
# torch: keep an installed build; otherwise the pinned CPU wheel (never an unpinned resolve).
$PY -c "import torch" 2>/dev/null || $PY -m pip install -q torch==2.13.0
$PY -m pip install -q -e ".[test]"
# DeepSpeed 0.19.8 for the launcher test (../shared/references.md): --no-deps keeps torch and
# numpy; its pure-Python deps are installed apart.
$PY -c "import deepspeed" 2>/dev/null || {
    $PY -m pip install -q --no-deps --no-build-isolation deepspeed==0.19.8 &&
    $PY -m pip install -q einops hjson msgpack ninja py-cpuinfo psutil pydantic tqdm packaging; } ||
    echo "DeepSpeed did not install: its launcher test is skipped" >&2
# Megatron-Core 0.16.1, the reference of --ckpt-format torch_dist and of the MoE layer
# (../shared/references.md):
# --no-deps, so torch and numpy stay as they are; its tests skip when this fails (offline).
$PY -m pip install -q --no-deps megatron-core==0.16.1 psutil packaging \
    || echo "megatron-core not installed: its interoperability tests are skipped" >&2
# fairseq, the reference of tests/distributed/test_fairseq.py, in its own venv (numpy 1.x);
# the wheel is cached under ~/.cache/megatron-fairseq. Without it those tests skip.
bash tests/install_fairseq.sh "$PY" || echo "run_tests.sh: fairseq could not be installed; its tests will skip" >&2
exec $PY -m pytest -q -p no:cacheprovider tests "$@"
