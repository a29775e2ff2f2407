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

usage() {
    sed -n '2,4p' "$0" | sed 's/^# \{0,1\}//' >&2
    echo "See the header of $0 for the environment overrides." >&2
    exit 2
}

[[ $# -ge 2 ]] || usage
N=$1
MODEL=$2
shift 2
EXTRA=("$@")
[[ $N =~ ^[1-9][0-9]*$ ]] || { echo "error: N must be a positive integer, got '$N'" >&2; exit 2; }

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
for v in BASE_PORT KV_BASE GPUS_PER_WORKER GPU_OFFSET TIMEOUT PAGE_SIZE; do
    [[ ${!v} =~ ^[0-9]+$ ]] || { echo "error: $v must be a non-negative integer, got '${!v}'" >&2; exit 2; }
done
case $HOST in
    0.0.0.0 | :: | "[::]" | 127.0.0.1 | localhost) CHECK_HOST=127.0.0.1 ;;
    *) CHECK_HOST=$HOST ;;
esac
ADVERTISE_HOST=${ADVERTISE_HOST:-$CHECK_HOST}
command -v "$SGLANG_PYTHON" >/dev/null 2>&1 || { echo "error: '$SGLANG_PYTHON' not found (set SGLANG_PYTHON=/path/to/python)" >&2; exit 2; }
mkdir -p "$LOG_DIR"

PIDS=()
KEEP=0
USE_SETSID=0
command -v setsid >/dev/null 2>&1 && USE_SETSID=1

stop_all() {
    # Each worker leads its own process group (setsid): TERM the group so SGLang's
    # scheduler and detokenizer processes go too, then KILL what is left after a grace period.
    local pid alive t
    for pid in "${PIDS[@]}"; do
        if kill -0 "$pid" 2>/dev/null; then
            if [[ $USE_SETSID == 1 ]]; then kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
            else kill -TERM "$pid" 2>/dev/null || true; fi
        fi
    done
    for ((t = 0; t < 30; t++)); do
        alive=0
        for pid in "${PIDS[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
        [[ $alive == 0 ]] && break
        sleep 1
    done
    for pid in "${PIDS[@]}"; do
        if [[ $USE_SETSID == 1 ]]; then kill -KILL -- "-$pid" 2>/dev/null || true; fi
        kill -KILL "$pid" 2>/dev/null || true
    done
    wait "${PIDS[@]}" 2>/dev/null || true
}

on_exit() {
    local rc=$?
    trap - EXIT INT TERM
    if [[ $KEEP != 1 && ${#PIDS[@]} -gt 0 ]]; then
        echo "stopping ${#PIDS[@]} SGLang worker(s)..." >&2
        stop_all
    fi
    exit "$rc"
}
trap on_exit EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

http_status() {  # HTTP status of GET $1, "000" when nothing answers
    if command -v curl >/dev/null 2>&1; then
        curl -s -o /dev/null -m 5 -w '%{http_code}' "$1" 2>/dev/null || true
    else
        python3 - "$1" <<'PY' 2>/dev/null || echo 000
import sys, urllib.error, urllib.request
try:
    print(urllib.request.urlopen(sys.argv[1], timeout=5).status)
except urllib.error.HTTPError as e:
    print(e.code)
except Exception:
    print("000")
PY
    fi
}

shquote() {  # shell words, quoted only where needed (readable, copy-paste safe)
    local out="" w
    for w in "$@"; do
        if [[ -n $w && $w =~ ^[A-Za-z0-9_./:=,@%+-]+$ ]]; then out+="${out:+ }$w"
        else out+="${out:+ }'${w//\'/\'\\\'\'}'"; fi
    done
    printf '%s\n' "$out"
}

fail() {
    echo "error: $*" >&2
    exit 1
}

# The router must know the name clients use.
SERVED=()
for ((a = 0; a < ${#EXTRA[@]}; a++)); do
    case ${EXTRA[a]} in
        --served-model-name=*) SERVED=("${EXTRA[a]#*=}") ;;
        --served-model-name) ((a + 1 < ${#EXTRA[@]})) && SERVED=("${EXTRA[a + 1]}") ;;
    esac
done

SPECS=()
LOGS=()
for ((i = 0; i < N; i++)); do
    port=$((BASE_PORT + i))
    kv=$((KV_BASE + 2 * i))
    replay=$((KV_BASE + 2 * i + 1))
    first=$((GPU_OFFSET + i * GPUS_PER_WORKER))
    gpus=""
    for ((g = 0; g < GPUS_PER_WORKER; g++)); do gpus+="${gpus:+,}$((first + g))"; done
    args=(-m sglang.launch_server --model-path "$MODEL" --host "$HOST" --port "$port"
        --kv-events-config "{\"publisher\":\"zmq\",\"endpoint\":\"tcp://*:$kv\",\"replay_endpoint\":\"tcp://*:$replay\",\"topic\":\"\"}"
        --page-size "$PAGE_SIZE" --enable-cache-report --enable-metrics)
    if ((GPUS_PER_WORKER > 1)); then args+=(--tp-size "$GPUS_PER_WORKER"); fi
    args+=(${EXTRA[@]+"${EXTRA[@]}"})  # (bash < 4.4 treats an empty array as unset)
    log="$LOG_DIR/worker-$i.log"
    LOGS+=("$log")
    printf '%q ' "CUDA_VISIBLE_DEVICES=${gpus:-(inherited)}" "$SGLANG_PYTHON" "${args[@]}" >"$log"
    echo >>"$log"
    # GPUS_PER_WORKER=0: no pinning, the worker inherits CUDA_VISIBLE_DEVICES.
    envs=(env)
    [[ -n $gpus ]] && envs+=("CUDA_VISIBLE_DEVICES=$gpus")
    if [[ $USE_SETSID == 1 ]]; then
        setsid "${envs[@]}" "$SGLANG_PYTHON" "${args[@]}" >>"$log" 2>&1 </dev/null &
    else
        "${envs[@]}" "$SGLANG_PYTHON" "${args[@]}" >>"$log" 2>&1 </dev/null &
    fi
    PIDS+=("$!")
    echo "worker $i: pid ${PIDS[i]}, GPUs ${gpus:-inherited}, http://$CHECK_HOST:$port, KV tcp://*:$kv (replay $replay), log $log" >&2
done

echo "waiting up to ${TIMEOUT}s for $N worker(s) to answer /health..." >&2
READY=()
for ((i = 0; i < N; i++)); do READY+=(0); done
left=$N
start=$SECONDS
while ((left > 0)); do
    for ((i = 0; i < N; i++)); do
        [[ ${READY[i]} == 1 ]] && continue
        if ! kill -0 "${PIDS[i]}" 2>/dev/null; then
            rc=0
            wait "${PIDS[i]}" || rc=$?
            echo "--- last lines of ${LOGS[i]} ---" >&2
            tail -n 30 "${LOGS[i]}" >&2 || true
            fail "worker $i (port $((BASE_PORT + i))) exited with status $rc before becoming healthy; see ${LOGS[i]}"
        fi
        if [[ $(http_status "http://$CHECK_HOST:$((BASE_PORT + i))/health") == 200 ]]; then
            READY[i]=1
            left=$((left - 1))
            echo "worker $i healthy after $((SECONDS - start))s" >&2
        fi
    done
    ((left == 0)) && break
    if ((SECONDS - start >= TIMEOUT)); then
        for ((i = 0; i < N; i++)); do
            [[ ${READY[i]} == 1 ]] && continue
            echo "--- last lines of ${LOGS[i]} ---" >&2
            tail -n 30 "${LOGS[i]}" >&2 || true
            echo "error: worker $i (http://$CHECK_HOST:$((BASE_PORT + i))/health, log ${LOGS[i]}) not healthy after ${TIMEOUT}s" >&2
        done
        exit 1
    fi
    sleep 2
done

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
    port=$((BASE_PORT + i))
    kv=$((KV_BASE + 2 * i))
    replay=$((KV_BASE + 2 * i + 1))
    read -r version page base scheme < <(server_info "http://$CHECK_HOST:$port") || true
    spec="http://$ADVERTISE_HOST:$port"
    if [[ $base == - ]]; then
        spec+=",kv=tcp://$ADVERTISE_HOST:$kv"
        echo "worker $i: SGLang $version, page size $page, no kv_events in /server_info: kv= given explicitly" >&2
    else
        echo "worker $i: SGLang $version, page size $page, KV endpoint discovered by mmroute (port $base)" >&2
    fi
    spec+=",replay=tcp://$ADVERTISE_HOST:$replay,name=$NAME_PREFIX-$i"
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
echo "All $N SGLang workers are healthy. Run the router with:" >&2
shquote "${serve[@]}"

if [[ $DETACH == 1 ]]; then
    KEEP=1
    echo "Workers left running (DETACH=1); stop them with: kill -TERM ${PIDS[*]}" >&2
    exit 0
fi
echo "Workers running; Ctrl-C stops them all." >&2
while true; do
    for ((i = 0; i < N; i++)); do
        if ! kill -0 "${PIDS[i]}" 2>/dev/null; then
            rc=0
            wait "${PIDS[i]}" || rc=$?
            fail "worker $i (port $((BASE_PORT + i))) exited with status $rc; see ${LOGS[i]}"
        fi
    done
    sleep 5 &
    wait $! || true
done
