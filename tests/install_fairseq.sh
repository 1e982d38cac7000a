#!/usr/bin/env bash
# fairseq (fairseq-fixed 0.12.3.1), the reference of the fairseq tests, in its own virtual
# environment: its Cython extensions need numpy 1.x, ours is numpy 2. A .pth file in that
# venv names the site-packages of PYTHON's environment (a virtual environment or not) after
# its own, so it uses PYTHON's torch while its own numpy 1.26.4 wins. What fairseq's tasks,
# fairseq-train, fairseq-eval-lm and its example scripts import is installed with --no-deps
# at pinned versions, so a fresh machine gets the set that was checked (scikit-learn >= 1.7
# also needs narwhals). The wheel (~7 min to build on 2 cores) is cached in
# ~/.cache/megatron-fairseq/wheels (MEGATRON_FAIRSEQ_CACHE moves the venv and the wheels).
#   bash tests/install_fairseq.sh [PYTHON]
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
PY=${1:-${PYTHON:-python}}
CACHE=${MEGATRON_FAIRSEQ_CACHE:-$HOME/.cache/megatron-fairseq}
VENV=$CACHE/venv
WHEELS=$CACHE/wheels
VPY=$VENV/bin/python
probe() { "$VPY" "$HERE/fairseq_side.py" probe; }  # every module the fairseq tests import
if [ -x "$VPY" ] && probe >/dev/null 2>&1; then
    exit 0
fi
mkdir -p "$WHEELS"
[ -x "$VPY" ] || "$PY" -m venv "$VENV"
# PYTHON's site-packages, after the venv's own (and so after its numpy 1.26.4)
"$PY" -c "import site; print('\n'.join(site.getsitepackages()))" \
    > "$("$VPY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/megatron-outer-env.pth"
"$VPY" -m pip install -q numpy==1.26.4 cython==3.3.1 setuptools wheel
if ! ls "$WHEELS"/fairseq_fixed-0.12.3.1-*.whl >/dev/null 2>&1; then
    echo "building the fairseq-fixed 0.12.3.1 wheel (about 7 minutes on 2 cores)..."
    "$VPY" -m pip wheel -q --no-deps --no-build-isolation -w "$WHEELS" fairseq-fixed==0.12.3.1
fi
"$VPY" -m pip install -q --no-deps "$WHEELS"/fairseq_fixed-0.12.3.1-*.whl \
    hydra-core==1.3.2 omegaconf==2.3.0 antlr4-python3-runtime==4.9.3 PyYAML==6.0.3 \
    bitarray==3.12.3 sacrebleu==2.6.0 portalocker==4.4.2 tabulate==0.10.0 colorama==0.4.6 \
    lxml==6.1.3 regex==2026.5.9 packaging==26.2 tqdm==4.70.1 scikit-learn==1.9.1 \
    narwhals==2.29.0 scipy==1.17.1 joblib==1.6.0 cloudpickle==3.1.3 threadpoolctl==3.8.0 \
    sacremoses==0.2.0 click==8.5.1
probe
