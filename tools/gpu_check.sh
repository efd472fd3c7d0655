#!/usr/bin/env bash
# The GPU checks, as one short script for a lent GPU machine (see DEVELOPERS.md / the device tool).
#
# Runs, with the machine's own CUDA torch (no install: the GPU image ships torch, transformers,
# safetensors, hypothesis, pytest, jaxtyping, tqdm, matplotlib):
#   1. `refppo verify` (every core step vs its naive twin, on CPU and CUDA);
#   2. every `gpu`-marked test (CUDA golden replay with its stated tolerance, verify on CUDA,
#      a bf16 CUDA training run);
#   3. the CUDA golden replay's max deviations from the CPU golden, printed for CHANGELOG.md;
#   4. the re-scoring check on CUDA (`refppo diff --actor DIR --device cuda`, tools/rescore_gpu_check.py):
#      a float32 trainer pass matches, a pass without temperature is named, bf16 precision statistics.
# Everything it prints is also written under $OUT (or ./gpu-check-out) for the record.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu-check-out}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HYPOTHESIS_PROFILE=ci
PY="${PYTHON:-python3}"
exec > >(tee "$OUT/gpu_check.log") 2>&1
rc=0
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
"$PY" -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'transformers', transformers.__version__)"
echo "== refppo verify"
"$PY" -m refppo verify || rc=1
echo "== gpu-marked tests"
"$PY" -m pytest -q -m gpu -p no:cacheprovider tests || rc=1
echo "== CUDA golden replay vs the CPU golden"
"$PY" tools/make_golden.py --check --device cuda || rc=1
echo "== re-scoring with the trainer's checkpoints on CUDA"
"$PY" tools/rescore_gpu_check.py --device cuda || rc=1
echo "gpu_check: exit $rc"
exit "$rc"
