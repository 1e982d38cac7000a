#!/usr/bin/env bash
# Install the framework, the test dependencies and the oracles (the reference implementations
# of ../shared/references.md, tests/oracles.py), then run the whole test suite.
#   bash tests/run_tests.sh [pytest args...]
# A peer that does not install (offline) is reported in one line and its tests skip; with
# MEGATRON_REQUIRE_ORACLES=1 (.ci/run) that line ends the run with exit 1 instead, and no
# test may skip for want of an oracle.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
# torch: keep an installed build; otherwise the pinned CPU wheel (never an unpinned resolve).
$PY -c "import torch" 2>/dev/null || $PY -m pip install -q torch==2.13.0
$PY -m pip install -q -e ".[test]"   # transformers, lm-eval and matplotlib (benchmarks/report.py) come with the test extra
# DeepSpeed 0.19.8 for the launcher test: --no-deps keeps torch and numpy; its pure-Python
# deps are installed apart.
$PY -c "import deepspeed" 2>/dev/null || {
    $PY -m pip install -q --no-deps --no-build-isolation deepspeed==0.19.8 &&
    $PY -m pip install -q einops hjson msgpack ninja py-cpuinfo psutil pydantic tqdm packaging; } ||
    true
# Megatron-Core 0.16.1, the reference of --ckpt-format torch_dist and of the MoE layer;
# --no-deps, so torch and numpy stay as they are.
$PY -m pip install -q --no-deps megatron-core==0.16.1 psutil packaging || true
# fairseq in its own venv (numpy 1.x); the wheel is cached under ~/.cache/megatron-fairseq.
bash tests/install_fairseq.sh "$PY" || true
# one line naming any oracle that is missing; under MEGATRON_REQUIRE_ORACLES=1 it stops here
if ! $PY -m tests.oracles; then
    [ "${MEGATRON_REQUIRE_ORACLES:-0}" = "0" ] || exit 1
    echo "run_tests.sh: the tests of the missing oracles will skip" >&2
fi
exec $PY -m pytest -q -p no:cacheprovider tests "$@"
