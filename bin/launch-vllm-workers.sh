#!/usr/bin/env bash
# Launch N vLLM workers on this host, ready for mmroute, and wait until all are healthy.
#
#   bin/launch-vllm-workers.sh N MODEL [extra `vllm serve` args...]
#
# Worker i (0-based) runs `vllm serve MODEL` with:
#   CUDA_VISIBLE_DEVICES  GPUs i*G .. i*G+G-1 (G = GPUS_PER_WORKER; G > 1 adds --tensor-parallel-size G)
#   --port                BASE_PORT+i
#   --kv-events-config    ZMQ publisher bound on tcp://*:KV_BASE+2i, replay ROUTER on
#                         tcp://*:KV_BASE+2i+1, topic "kv-events" (docs/vllm.md)
#   --enable-prefix-caching --enable-prompt-tokens-details (cached_tokens in usage)
# Extra args go last, so they win over the defaults above. Do not pass
# --data-parallel-size: rank r would publish on port+r, which is the next worker's.
#
# It waits until every worker's /health answers 200, then prints the exact
# `mmroute serve` line for the fleet and keeps running: Ctrl-C (or SIGTERM) stops all
# workers. A worker that exits or stays unhealthy past TIMEOUT fails the launch
# (named, with the tail of its log), and the others are stopped.
#
# Environment overrides (defaults in brackets):
#   BASE_PORT [8000]        HTTP port of worker i = BASE_PORT+i
#   KV_BASE [5557]          KV events port of worker i = KV_BASE+2i, replay = KV_BASE+2i+1
#   HOST [0.0.0.0]          address the HTTP servers listen on
#   ADVERTISE_HOST []       address the router should dial; default 127.0.0.1 when HOST is
#                           0.0.0.0/::/127.0.0.1, else HOST (set it when the router runs elsewhere)
#   LOG_DIR [./mmroute-logs/vllm]  worker-I.log per worker
#   GPUS_PER_WORKER [1]     GPUs per worker (tensor parallel size); 0 = do not set
#                           CUDA_VISIBLE_DEVICES (CPU builds, or GPUs chosen by the caller)
#   GPU_OFFSET [0]          first GPU index to use
#   TIMEOUT [900]           seconds to wait for all workers to be healthy
#   NAME_PREFIX [vllm]      worker names in the serve line: NAME_PREFIX-i (unique across hosts!)
#   VLLM [vllm]             the vllm executable
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

BASE_PORT=${BASE_PORT:-8000}
KV_BASE=${KV_BASE:-5557}
HOST=${HOST:-0.0.0.0}
LOG_DIR=${LOG_DIR:-./mmroute-logs/vllm}
GPUS_PER_WORKER=${GPUS_PER_WORKER:-1}
GPU_OFFSET=${GPU_OFFSET:-0}
TIMEOUT=${TIMEOUT:-900}
NAME_PREFIX=${NAME_PREFIX:-vllm}
VLLM=${VLLM:-vllm}
DETACH=${DETACH:-0}
for v in BASE_PORT KV_BASE GPUS_PER_WORKER GPU_OFFSET TIMEOUT; do
    [[ ${!v} =~ ^[0-9]+$ ]] || { echo "error: $v must be a non-negative integer, got '${!v}'" >&2; exit 2; }
done
case $HOST in
    0.0.0.0 | :: | "[::]" | 127.0.0.1 | localhost) CHECK_HOST=127.0.0.1 ;;
    *) CHECK_HOST=$HOST ;;
esac
ADVERTISE_HOST=${ADVERTISE_HOST:-$CHECK_HOST}
command -v "$VLLM" >/dev/null 2>&1 || { echo "error: '$VLLM' not found (install vLLM or set VLLM=/path/to/vllm)" >&2; exit 2; }
mkdir -p "$LOG_DIR"

PIDS=()
KEEP=0
USE_SETSID=0
command -v setsid >/dev/null 2>&1 && USE_SETSID=1

stop_all() {
    # Each worker leads its own process group (setsid): TERM the group so vLLM's engine
    # processes go too, then KILL what is left after a grace period.
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
        echo "stopping ${#PIDS[@]} vLLM worker(s)..." >&2
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

# Router flags that must match the workers' model names.
SERVED=()
LORAS=()
for ((a = 0; a < ${#EXTRA[@]}; a++)); do
    case ${EXTRA[a]} in
        --served-model-name=*) SERVED+=("${EXTRA[a]#*=}") ;;
        --served-model-name)
            while ((a + 1 < ${#EXTRA[@]})) && [[ ${EXTRA[a + 1]} != -* ]]; do a=$((a + 1)); SERVED+=("${EXTRA[a]}"); done ;;
        --lora-modules=*) LORAS+=("${EXTRA[a]#*=}") ;;
        --lora-modules)
            while ((a + 1 < ${#EXTRA[@]})) && [[ ${EXTRA[a + 1]} != -* ]]; do a=$((a + 1)); LORAS+=("${EXTRA[a]}"); done ;;
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
    args=(serve "$MODEL" --host "$HOST" --port "$port"
        --enable-prefix-caching --enable-prompt-tokens-details
        --kv-events-config "{\"enable_kv_cache_events\":true,\"publisher\":\"zmq\",\"endpoint\":\"tcp://*:$kv\",\"replay_endpoint\":\"tcp://*:$replay\",\"topic\":\"kv-events\"}")
    if ((GPUS_PER_WORKER > 1)); then args+=(--tensor-parallel-size "$GPUS_PER_WORKER"); fi
    args+=(${EXTRA[@]+"${EXTRA[@]}"})  # (bash < 4.4 treats an empty array as unset)
    log="$LOG_DIR/worker-$i.log"
    LOGS+=("$log")
    printf '%q ' "CUDA_VISIBLE_DEVICES=${gpus:-(inherited)}" "$VLLM" "${args[@]}" >"$log"
    echo >>"$log"
    # GPUS_PER_WORKER=0: no pinning, the worker inherits CUDA_VISIBLE_DEVICES.
    envs=(env)
    [[ -n $gpus ]] && envs+=("CUDA_VISIBLE_DEVICES=$gpus")
    if [[ $USE_SETSID == 1 ]]; then
        setsid "${envs[@]}" "$VLLM" "${args[@]}" >>"$log" 2>&1 </dev/null &
    else
        "${envs[@]}" "$VLLM" "${args[@]}" >>"$log" 2>&1 </dev/null &
    fi
    PIDS+=("$!")
    SPECS+=("http://$ADVERTISE_HOST:$port,kv=tcp://$ADVERTISE_HOST:$kv,replay=tcp://$ADVERTISE_HOST:$replay,name=$NAME_PREFIX-$i")
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

serve=(mmroute serve --model "$MODEL")
if ((${#SERVED[@]})); then serve+=(--served-model-name "${SERVED[@]}"); fi
if ((${#LORAS[@]})); then
    names=()
    for l in "${LORAS[@]}"; do
        if [[ $l == \{* ]]; then echo "note: give the router --lora-modules NAME... for the JSON LoRA spec '$l'" >&2
        else names+=("${l%%=*}"); fi
    done
    if ((${#names[@]})); then serve+=(--lora-modules "${names[@]}"); fi
fi
serve+=(--workers "${SPECS[@]}")
echo "All $N vLLM workers are healthy. Run the router with:" >&2
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
