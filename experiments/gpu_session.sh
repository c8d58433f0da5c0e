#!/bin/bash
# What a lent GPU runs, in one call (about 5 minutes on an H200): the Pallas kernels'
# checks and timings (gpu_kernels.py), the two diagnostics, then the trainer's scanned GPT
# step per engine (gpu_step.py), on whatever jax the GPU host has (0.10.2 to 0.12: the
# engine reads a scan through zeropp_jax.interpreter._jaxpr_compat on each). Logs and tables go to $OUT
# (default /tmp/gpu_session). The run of 2026-12-04: experiments/results/gpu_h200/.
set -u
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/gpu_session}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
$PY -c "import sys, jax, flax, optax; print(sys.version.split()[0], 'jax', jax.__version__, \
'flax', flax.__version__, 'optax', optax.__version__, jax.devices())" 2>&1 | tee "$OUT/env.log"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee -a "$OUT/env.log"
timeout 200 $PY experiments/gpu_kernels.py --sizes-mib 64 256 --budget-s 120 2>&1 \
    | tee "$OUT/gpu_kernels.log"
echo "gpu_kernels exit ${PIPESTATUS[0]}" | tee -a "$OUT/gpu_kernels.log"
$PY experiments/gpu_diagnostics/scan_params.py > "$OUT/scan_params.log" 2>&1
timeout 60 $PY experiments/gpu_diagnostics/recip.py 2>&1 | head -4 > "$OUT/recip.log"
timeout 240 $PY experiments/gpu_step.py --engines "XLA FSDP,ZeRO-3,ZeRO++,zeropp_delta2" \
    --out "$OUT" 2>&1 | tee "$OUT/gpu_step.log"
echo "gpu_step exit ${PIPESTATUS[0]}" | tee -a "$OUT/gpu_step.log"
