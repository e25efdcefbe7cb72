#!/usr/bin/env bash
# Launch lrmq.train on every worker of a Cloud TPU VM pod slice (multi-controller JAX, no Pathways/GKE).
#   launch/tpu_pod.sh [--dry-run] [--skip-setup] TPU_NAME ZONE [PROJECT] -- --config configs/paper1/pod_v5p64_8b_grpo.yaml [key=value ...]
#
# Every worker is set up from nothing, then runs the same command:
#   1) setup (skipped with --skip-setup): Python 3.11 (apt, when missing), the repository cloned into
#      $LRMQ_REPO_DIR (default ~/lrmq) from $LRMQ_GIT_URL (default: this checkout's origin) and checked out at
#      THIS checkout's commit (a commit the workers cannot fetch fails there, naming it), `make install` (the
#      pinned .venv), then jax[tpu] and the gs:// clients;
#   2) train: jax.distributed.initialize() discovers the peers (LRMQ_DISTRIBUTED=auto).
# The config is first resolved and validated on this machine (`python -m lrmq.train ARGS --print-config`, with
# $LRMQ_PYTHON, default this checkout's .venv): a missing file or an unknown key exits 2 with the config error before
# any gcloud command.
# Each gcloud command is printed before it runs; --dry-run prints them and runs nothing.
#
# The model and data may be in a bucket (model.checkpoint=gs://..., data.train_files=[gs://...]): each host streams
# only the weight rows of its own shards, nothing is copied to its disk (docs/tpu.md). The run directory must be
# shared storage so checkpoints are global: run.out_dir=gs://bucket/runs/NAME (the pod recipes' form; the bucket
# must exist, the workers' service account needs read/write access) or an NFS path. With a gs:// run dir, orbax
# writes each worker's checkpoint shards straight to the bucket; process 0 writes config.yaml, stages
# metrics.jsonl and tb/ under $TMPDIR and copies them up (every 30 s, at each checkpoint, at exit), and stages the
# HF exports (initial_policy/, final_policy/) under $TMPDIR before uploading them, so worker 0 needs local disk for
# one export (~2 bytes/param in bf16). Every worker takes part in the export. See docs/grpo.md and docs/tpu.md.
set -euo pipefail
DRY=0
SETUP=1
while [[ $# -gt 0 && $1 == --* && $1 != "--" ]]; do
  case $1 in
    --dry-run) DRY=1 ;;
    --skip-setup) SETUP=0 ;;
    *) echo "tpu_pod.sh: unknown option $1 (known: --dry-run, --skip-setup)" >&2; exit 2 ;;
  esac
  shift
done
TPU=${1:?usage: launch/tpu_pod.sh [--dry-run] [--skip-setup] TPU_NAME ZONE [PROJECT] -- lrmq.train arguments}
ZONE=${2:?zone}; shift 2
PROJECT_FLAG=()
if [[ $# -gt 0 && $1 != "--" ]]; then PROJECT_FLAG=(--project "$1"); shift; fi
[[ ${1:-} == "--" ]] && shift
[[ $# -gt 0 ]] || { echo "tpu_pod.sh: no lrmq.train arguments after --" >&2; exit 2; }

HERE=$(cd "$(dirname "$0")/.." && pwd)
# the config is resolved and validated here first (as `lrmq.train --print-config` does: the files, every key and
# value), so a typo exits 2 with the config error before any gcloud command, --dry-run or not
# ($LRMQ_PYTHON: a Python with lrmq's dependencies; default this checkout's .venv, else python3)
LOCAL_PY=${LRMQ_PYTHON:-$HERE/.venv/bin/python}
[[ -n ${LRMQ_PYTHON:-} || -x $LOCAL_PY ]] || LOCAL_PY=python3
(cd "$HERE" && JAX_PLATFORMS=cpu "$LOCAL_PY" -m lrmq.train "$@" --print-config >/dev/null) || {
  echo "tpu_pod.sh: the lrmq.train arguments do not resolve to a valid config (above); nothing was run" >&2; exit 2; }
COMMIT=$(git -C "$HERE" rev-parse HEAD)
GIT_URL=${LRMQ_GIT_URL:-$(git -C "$HERE" config --get remote.origin.url || true)}
[[ -n $GIT_URL ]] || { echo "tpu_pod.sh: no git remote to clone on the workers: set LRMQ_GIT_URL" >&2; exit 2; }
if [[ -n $(git -C "$HERE" status --porcelain --untracked-files=no) ]]; then
  echo "tpu_pod.sh: warning: this checkout has uncommitted changes; the workers run commit $COMMIT without them" >&2
fi
REPO=${LRMQ_REPO_DIR:-\$HOME/lrmq}
ARGS=$(printf '%q ' "$@")
SSH=(gcloud compute tpus tpu-vm ssh "$TPU" --zone "$ZONE" "${PROJECT_FLAG[@]}" --worker=all --command)

run() {  # print the gcloud command and, indented below it, the command every worker runs; then run it unless --dry-run
  echo "+ ${*:1:$#-1}"
  echo "    ${*: -1}"
  [[ $DRY == 1 ]] || "$@"
}

if [[ $SETUP == 1 ]]; then
  # gcsfs and google-cloud-storage: epath's gs:// backend and orbax's bucket checks
  run "${SSH[@]}" "set -e; command -v python3.11 >/dev/null || { sudo apt-get update -q && sudo apt-get install -y -q python3.11 python3.11-venv; }; [ -d $REPO/.git ] || git clone -q $(printf %q "$GIT_URL") $REPO; cd $REPO && git fetch -q origin && git checkout -q --detach $COMMIT && make install PY=python3.11 && .venv/bin/pip install -q 'jax[tpu]==0.10.2' 'gcsfs==2026.10.1' 'google-cloud-storage==3.17.1'"
fi
# train; SIGTERM (preemption) saves a checkpoint, rerunning this script resumes
run "${SSH[@]}" "cd $REPO && test \"\$(git rev-parse HEAD)\" = $COMMIT && LRMQ_DISTRIBUTED=auto .venv/bin/python -m lrmq.train $ARGS"
