#!/usr/bin/env bash
# Run lrmq.train as N cooperating JAX processes on this host (CPU: each process gets D forced devices).
# The same code path a TPU pod or multi-GPU host uses: one global mesh over all processes' devices.
#   launch/local_multiprocess.sh 2 4 --config configs/tiny_demo.yaml mesh.fsdp=8 run.out_dir=runs/mp
# run.out_dir may be a gs:// URL as on a pod; tests/test_pod_path.py does that against a fake GCS on 127.0.0.1
# (STORAGE_EMULATOR_HOST, TENSORSTORE_GCS_HTTP_URL, GOOGLE_AUTH_TOKEN_FOR_TESTING are passed through).
# The coordinator's port: $LRMQ_PORT, else a free one below the kernel's ephemeral range (a port there can be any
# outgoing connection's meanwhile: process 0 then cannot start the coordinator). When a process fails, the others
# are stopped (TERM, KILL after 10 s) and the launch exits with its status: a peer waiting for a coordinator or a
# collective that will never come would otherwise hang the launch.
set -euo pipefail
N=${1:?number of processes}; D=${2:?devices per process}; shift 2
PY=${PYTHON:-.venv/bin/python}
PORT=${LRMQ_PORT:-$("$PY" - <<'PORTS'
import random, socket
try:  # ports the kernel hands out to outgoing connections start here
    low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
except (OSError, ValueError):
    low = 32768
high = low if low > 21000 else 65536
for _ in range(200):
    port = random.randrange(20000, high)
    try:  # [::] as the coordinator binds it (dual stack: an IPv4 holder of the port refuses it too)
        with socket.socket(socket.AF_INET6 if socket.has_ipv6 else socket.AF_INET) as s:
            s.bind(("::" if s.family == socket.AF_INET6 else "0.0.0.0", port))
    except OSError:
        continue
    print(port)
    break
else:
    raise SystemExit("local_multiprocess.sh: no free port for the coordinator in 200 tries; set LRMQ_PORT")
PORTS
)}
pids=()
for ((i = 0; i < N; i++)); do
  LRMQ_COORDINATOR=127.0.0.1:$PORT LRMQ_NUM_PROCESSES=$N LRMQ_PROCESS_ID=$i JAX_PLATFORMS=cpu \
  XLA_FLAGS="${XLA_FLAGS:+$XLA_FLAGS }--xla_force_host_platform_device_count=$D" \
    "$PY" -m lrmq.train "$@" > >(sed "s/^/[proc $i] /") 2>&1 &
  pids+=($!)
done

ended() {  # whether child $1 has ended (bash reaps it as it ends; a zombie until then)
  [[ ! -r /proc/$1/stat || $(cut -d' ' -f3 "/proc/$1/stat" 2>/dev/null) == Z ]]
}

stop() {  # TERM the given processes, KILL those still running 10 s later
  kill -TERM "$@" 2>/dev/null || true
  local t p alive
  for ((t = 0; t < 100; t++)); do
    alive=0
    for p in "$@"; do ended "$p" || alive=1; done
    ((alive)) || return 0
    sleep 0.1
  done
  kill -KILL "$@" 2>/dev/null || true
}

rc=0
running=("${pids[@]}")
while ((${#running[@]})); do
  left=()
  for p in "${running[@]}"; do
    if ! ended "$p"; then left+=("$p"); continue; fi
    status=0
    wait "$p" || status=$?
    if ((status && !rc)); then
      rc=$status
      echo "local_multiprocess.sh: process $p exited with status $status; stopping the others" >&2
    fi
  done
  running=("${left[@]+"${left[@]}"}")
  if ((rc)); then
    ((${#running[@]} == 0)) || stop "${running[@]}"
    for p in "${running[@]+"${running[@]}"}"; do wait "$p" || true; done
    break
  fi
  ((${#running[@]} == 0)) || sleep 0.2
done
exit $rc
