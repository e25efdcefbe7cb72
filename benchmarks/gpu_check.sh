#!/usr/bin/env bash
# The pending GPU checks in one device call (benchmarks/gpu_check.py says what each part does): what only a GPU can
# measure, numerics on the hardware and speed. That the kernels compile (PTX for sm_90a / sm_80 / sm_100a, tensor-core
# instructions, shared memory, spills) is proven without a GPU by benchmarks/gpu_aot_kernels.py (docs/kernels.md).
# On the lent H200,
# from the repository root, with the image's python3 (its jax + CUDA plugin, torch, transformers, pytest):
#   bash benchmarks/gpu_check.sh            # run tool: timeout_s 420; results come back from $OUT
# Writes $OUT/log (this output), gpu_check.{json,md}, parts_log.txt, int4_h200.{json,md}.
# BUDGET (seconds, default 380) bounds all parts together; each part is a process with its own timeout.
set -o pipefail
OUT=${OUT:-runs/gpu_check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
nvidia-smi -L 2>&1 | tee "$OUT/log"
"$PY" benchmarks/gpu_check.py --out "$OUT" --budget "${BUDGET:-380}" 2>&1 | tee -a "$OUT/log"
