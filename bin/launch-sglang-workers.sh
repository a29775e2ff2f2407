#!/usr/bin/env bash
# Launch N SGLang workers on this host, ready for mmroute, and wait until all are healthy.
#
#   bin/launch-sglang-workers.sh N MODEL [extra `python -m sglang.launch_server` args...]
#
# Worker i (0-based) runs `python -m sglang.launch_server --model-path MODEL` with:
#   CUDA_VISIBLE_DEVICES  GPUs i*G .. i*G+G-1 (G = GPUS_PER_WORKER; G > 1 adds --tp-size G)
#   --port                BASE_PORT+i
#   --kv-events-config    ZMQ publisher bound on tcp://*:KV_BASE+2i, replay ROUTER on
#                         tcp://*:KV_BASE+2i+1, topic "" (docs/sglang.md)
#   --page-size PAGE_SIZE --enable-cache-report --enable-metrics
# Extra args go last, so they win over the defaults above. Do not pass --dp-size: rank r
# would publish on port+r, which is this worker's replay port.
#
# It waits until every worker's /health answers 200, reads each one's /server_info
# (version, page size, kv_events section), then prints the exact `mmroute serve` line
# for the fleet and keeps running: Ctrl-C (or SIGTERM) stops all workers. A worker that
# exits or stays unhealthy past TIMEOUT fails the launch (named, with the tail of its
# log), and the others are stopped.
#
# Builds whose /server_info has a kv_events section need only their URL in the serve
# line (mmroute discovers the KV endpoint); for older builds the line carries kv=.
# replay= is always printed: /server_info does not advertise the replay endpoint.
#
# Environment overrides (defaults in brackets):
#   BASE_PORT [30000]       HTTP port of worker i = BASE_PORT+i
#   KV_BASE [5557]          KV events port of worker i = KV_BASE+2i, replay = KV_BASE+2i+1
#   HOST [0.0.0.0]          address the HTTP servers listen on
#   ADVERTISE_HOST []       address the router should dial; default 127.0.0.1 when HOST is
#                           0.0.0.0/::/127.0.0.1, else HOST (set it when the router runs elsewhere)
#   LOG_DIR [./mmroute-logs/sglang]  worker-I.log per worker
#   GPUS_PER_WORKER [1]     GPUs per worker (tensor parallel size); 0 = do not set
#                           CUDA_VISIBLE_DEVICES (GPUs chosen by the caller)
#   GPU_OFFSET [0]          first GPU index to use
#   PAGE_SIZE [16]          KV page size in tokens (1, SGLang's CUDA default, is refused by mmroute)
#   TIMEOUT [900]           seconds to wait for all workers to be healthy
#   NAME_PREFIX [sglang]    worker names in the serve line: NAME_PREFIX-i (unique across hosts!)
#   SGLANG_PYTHON [python3] the Python interpreter that has sglang installed
#   DETACH [0]              1: exit once healthy and leave the workers running
set -euo pipefail
# shellcheck source=lib/workers.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib/workers.sh"
ENGINE=SGLang

parse_launch_args "$@"
BASE_PORT=${BASE_PORT:-30000}
KV_BASE=${KV_BASE:-5557}
HOST=${HOST:-0.0.0.0}
LOG_DIR=${LOG_DIR:-./mmroute-logs/sglang}
GPUS_PER_WORKER=${GPUS_PER_WORKER:-1}
GPU_OFFSET=${GPU_OFFSET:-0}
TIMEOUT=${TIMEOUT:-900}
NAME_PREFIX=${NAME_PREFIX:-sglang}
SGLANG_PYTHON=${SGLANG_PYTHON:-python3}
PAGE_SIZE=${PAGE_SIZE:-16}
DETACH=${DETACH:-0}
require_uints BASE_PORT KV_BASE GPUS_PER_WORKER GPU_OFFSET TIMEOUT PAGE_SIZE
resolve_hosts
command -v "$SGLANG_PYTHON" >/dev/null 2>&1 || { echo "error: '$SGLANG_PYTHON' not found (set SGLANG_PYTHON=/path/to/python)" >&2; exit 2; }
mkdir -p "$LOG_DIR"
install_stop_traps

# The router must know the name clients use.
SERVED=()
for ((a = 0; a < ${#EXTRA[@]}; a++)); do
    case ${EXTRA[a]} in
        --served-model-name=*) SERVED=("${EXTRA[a]#*=}") ;;
        --served-model-name) ((a + 1 < ${#EXTRA[@]})) && SERVED=("${EXTRA[a + 1]}") ;;
    esac
done

sglang_args() {  # sglang_args PORT KV REPLAY -> ARGS (`python -m sglang.launch_server` arguments of one worker)
    ARGS=(-m sglang.launch_server --model-path "$MODEL" --host "$HOST" --port "$1"
        --kv-events-config "{\"publisher\":\"zmq\",\"endpoint\":\"tcp://*:$2\",\"replay_endpoint\":\"tcp://*:$3\",\"topic\":\"\"}"
        --page-size "$PAGE_SIZE" --enable-cache-report --enable-metrics)
    if ((GPUS_PER_WORKER > 1)); then ARGS+=(--tp-size "$GPUS_PER_WORKER"); fi
}
launch_workers "$SGLANG_PYTHON" sglang_args
wait_healthy

# What each worker says about itself: the serve line needs kv= only without discovery.
server_info() {  # "VERSION PAGE_SIZE KV_PORT_BASE|- SCHEME" of the worker at $1
    python3 - "$1" <<'PY' 2>/dev/null || echo "? ? - ?"
import json, re, sys, urllib.request
info = json.load(urllib.request.urlopen(sys.argv[1] + "/server_info", timeout=10))
kv = info.get("kv_events") if isinstance(info.get("kv_events"), dict) else {}
base = kv.get("endpoint_port_base")
version = str(info.get("version") or "?")
m = re.match(r"v?(\d+)\.(\d+)\.(\d+)", version)
v = tuple(int(x) for x in m.groups()) if m else None
# mmroute.routing.views.sglang_scheme_for_version: mm_hashes honoured from 0.5.18.
scheme = "?" if v is None else "wide" if v >= (0, 5, 23) else "legacy" if v >= (0, 5, 18) else "none"
print(version, info.get("page_size") or "?", base if isinstance(base, int) else "-", scheme)
PY
}

SPECS=()
for ((i = 0; i < N; i++)); do
    port=$(http_port "$i")
    read -r version page base scheme < <(server_info "http://$CHECK_HOST:$port") || true
    spec="http://$ADVERTISE_HOST:$port"
    if [[ $base == - ]]; then
        spec+=",kv=tcp://$ADVERTISE_HOST:$(kv_port "$i")"
        echo "worker $i: SGLang $version, page size $page, no kv_events in /server_info: kv= given explicitly" >&2
    else
        echo "worker $i: SGLang $version, page size $page, KV endpoint discovered by mmroute (port $base)" >&2
    fi
    spec+=",replay=tcp://$ADVERTISE_HOST:$(replay_port "$i"),name=$NAME_PREFIX-$i"
    SPECS+=("$spec")
    if [[ $page == 1 ]]; then
        echo "warning: worker $i runs with page size 1; mmroute refuses it (pass --page-size 16 or more)" >&2
    fi
    if [[ $scheme == none ]]; then
        echo "warning: worker $i (SGLang $version) predates mm_hashes (0.5.18): image pages route on their text prefix only" >&2
    fi
done

serve=(mmroute serve --model "$MODEL")
if ((${#SERVED[@]})); then serve+=(--served-model-name "${SERVED[@]}"); fi
serve+=(--workers "${SPECS[@]}")
print_serve_line "${serve[@]}"
supervise
