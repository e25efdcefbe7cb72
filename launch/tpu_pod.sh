#!/usr/bin/env bash
# Launch lrmq.train on every worker of a Cloud TPU VM pod slice (multi-controller JAX, no Pathways/GKE).
#   launch/tpu_pod.sh TPU_NAME ZONE [PROJECT] -- --config configs/paper1/pod_v5p64_8b_grpo.yaml [key=value ...]
# Each worker runs the same command; jax.distributed.initialize() discovers the peers (LRMQ_DISTRIBUTED=auto).
# The run directory must be shared storage (a gs:// bucket or NFS) so checkpoints are global.
set -euo pipefail
TPU=${1:?tpu name}; ZONE=${2:?zone}; shift 2
PROJECT_FLAG=()
if [[ $# -gt 0 && $1 != "--" ]]; then PROJECT_FLAG=(--project "$1"); shift; fi
[[ ${1:-} == "--" ]] && shift
REPO=${LRMQ_REPO_DIR:-\$HOME/lrmq}
ARGS=$(printf '%q ' "$@")
# 1) install the same commit on every worker (make install creates .venv with pinned versions)
gcloud compute tpus tpu-vm ssh "$TPU" --zone "$ZONE" "${PROJECT_FLAG[@]}" --worker=all \
  --command "cd $REPO && git pull --ff-only && make install PY=python3.11 && .venv/bin/pip install -q 'jax[tpu]==0.10.2'"
# 2) train; SIGTERM (preemption) saves a checkpoint, rerunning this script resumes
gcloud compute tpus tpu-vm ssh "$TPU" --zone "$ZONE" "${PROJECT_FLAG[@]}" --worker=all \
  --command "cd $REPO && LRMQ_DISTRIBUTED=auto .venv/bin/python -m lrmq.train $ARGS"
