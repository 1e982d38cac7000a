#!/usr/bin/env bash
# fairseq (fairseq-fixed 0.12.3.1), the reference of the fairseq tests, in its own virtual
# environment: its Cython extensions need numpy 1.x, ours is numpy 2. The venv sees the
# system site packages (torch, scikit-learn, sacremoses...) and pins numpy 1.26.4 over them.
# The wheel (~7 min to build on 2 cores) is cached in ~/.cache/megatron-fairseq/wheels.
#   bash tests/install_fairseq.sh [PYTHON]
set -euo pipefail
PY=${1:-${PYTHON:-python}}
CACHE=${MEGATRON_FAIRSEQ_CACHE:-$HOME/.cache/megatron-fairseq}
VENV=$CACHE/venv
WHEELS=$CACHE/wheels
VPY=$VENV/bin/python
if [ -x "$VPY" ] && "$VPY" -c "import fairseq.data.data_utils_fast, fairseq_cli" 2>/dev/null; then
    exit 0
fi
mkdir -p "$WHEELS"
[ -x "$VPY" ] || "$PY" -m venv --system-site-packages "$VENV"
"$VPY" -m pip install -q numpy==1.26.4 cython setuptools wheel
if ! ls "$WHEELS"/fairseq_fixed-0.12.3.1-*.whl >/dev/null 2>&1; then
    echo "building the fairseq-fixed 0.12.3.1 wheel (about 7 minutes on 2 cores)..."
    "$VPY" -m pip wheel -q --no-deps --no-build-isolation -w "$WHEELS" fairseq-fixed==0.12.3.1
fi
"$VPY" -m pip install -q --no-deps "$WHEELS"/fairseq_fixed-0.12.3.1-*.whl \
    hydra-core==1.3.2 omegaconf==2.3.0 antlr4-python3-runtime==4.9.3 PyYAML bitarray sacrebleu \
    portalocker tabulate colorama lxml scikit-learn scipy joblib threadpoolctl tqdm sacremoses
"$VPY" -c "import fairseq.data.data_utils_fast, fairseq_cli"
