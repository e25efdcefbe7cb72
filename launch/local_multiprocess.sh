#!/usr/bin/env bash
# Run lrmq.train as N cooperating JAX processes on this host (CPU: each process gets D forced devices).
# The same code path a TPU pod or multi-GPU host uses: one global mesh over all processes' devices.
#   launch/local_multiprocess.sh 2 4 --config configs/tiny_demo.yaml mesh.fsdp=8 run.out_dir=runs/mp
# run.out_dir may be a gs:// URL as on a pod; tests/test_pod_path.py does that against a fake GCS on 127.0.0.1
# (STORAGE_EMULATOR_HOST, TENSORSTORE_GCS_HTTP_URL, GOOGLE_AUTH_TOKEN_FOR_TESTING are passed through).
set -euo pipefail
N=${1:?number of processes}; D=${2:?devices per process}; shift 2
PORT=${LRMQ_PORT:-$((20000 + RANDOM % 20000))}
PY=${PYTHON:-.venv/bin/python}
pids=()
for ((i = 0; i < N; i++)); do
  LRMQ_COORDINATOR=127.0.0.1:$PORT LRMQ_NUM_PROCESSES=$N LRMQ_PROCESS_ID=$i JAX_PLATFORMS=cpu \
  XLA_FLAGS="${XLA_FLAGS:+$XLA_FLAGS }--xla_force_host_platform_device_count=$D" \
    "$PY" -m lrmq.train "$@" > >(sed "s/^/[proc $i] /") 2>&1 &
  pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=$?; done
exit $rc
