#!/usr/bin/env bash
# Launch lrmq.train on every worker of a Cloud TPU VM pod slice (multi-controller JAX, no Pathways/GKE).
#   launch/tpu_pod.sh TPU_NAME ZONE [PROJECT] -- --config configs/paper1/pod_v5p64_8b_grpo.yaml [key=value ...]
# Each worker runs the same command; jax.distributed.initialize() discovers the peers (LRMQ_DISTRIBUTED=auto).
# The run directory must be shared storage so checkpoints are global: run.out_dir=gs://bucket/runs/NAME (the
# pod recipes' form; the bucket must exist, the workers' service account needs write access) or an NFS path.
# With a gs:// run dir: orbax writes each worker's checkpoint shards straight to the bucket; process 0 writes
# config.yaml, stages metrics.jsonl and tb/ under $TMPDIR and copies them up (every 30 s, at each checkpoint,
# at exit), and stages the HF exports (initial_policy/, final_policy/) under $TMPDIR before uploading them, so
# worker 0 needs local disk for one export (~2 bytes/param in bf16). Every worker takes part in the export:
# the parameters are sharded across hosts and are gathered one tensor at a time. See docs/grpo.md.
set -euo pipefail
TPU=${1:?tpu name}; ZONE=${2:?zone}; shift 2
PROJECT_FLAG=()
if [[ $# -gt 0 && $1 != "--" ]]; then PROJECT_FLAG=(--project "$1"); shift; fi
[[ ${1:-} == "--" ]] && shift
REPO=${LRMQ_REPO_DIR:-\$HOME/lrmq}
ARGS=$(printf '%q ' "$@")
# 1) install the same commit on every worker (make install creates .venv with pinned versions); gcsfs and
#    google-cloud-storage are what gs:// run dirs need (epath's gs:// backend; orbax's bucket checks)
gcloud compute tpus tpu-vm ssh "$TPU" --zone "$ZONE" "${PROJECT_FLAG[@]}" --worker=all \
  --command "cd $REPO && git pull --ff-only && make install PY=python3.11 && .venv/bin/pip install -q 'jax[tpu]==0.10.2' 'gcsfs==2026.10.1' 'google-cloud-storage==3.17.1'"
# 2) train; SIGTERM (preemption) saves a checkpoint, rerunning this script resumes
gcloud compute tpus tpu-vm ssh "$TPU" --zone "$ZONE" "${PROJECT_FLAG[@]}" --worker=all \
  --command "cd $REPO && LRMQ_DISTRIBUTED=auto .venv/bin/python -m lrmq.train $ARGS"
