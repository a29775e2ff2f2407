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
# shellcheck source=lib/workers.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib/workers.sh"
ENGINE=vLLM

parse_launch_args "$@"
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
require_uints BASE_PORT KV_BASE GPUS_PER_WORKER GPU_OFFSET TIMEOUT
resolve_hosts
command -v "$VLLM" >/dev/null 2>&1 || { echo "error: '$VLLM' not found (install vLLM or set VLLM=/path/to/vllm)" >&2; exit 2; }
mkdir -p "$LOG_DIR"
install_stop_traps

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

vllm_args() {  # vllm_args PORT KV REPLAY -> ARGS (`vllm serve` arguments of one worker)
    ARGS=(serve "$MODEL" --host "$HOST" --port "$1"
        --enable-prefix-caching --enable-prompt-tokens-details
        --kv-events-config "{\"enable_kv_cache_events\":true,\"publisher\":\"zmq\",\"endpoint\":\"tcp://*:$2\",\"replay_endpoint\":\"tcp://*:$3\",\"topic\":\"kv-events\"}")
    if ((GPUS_PER_WORKER > 1)); then ARGS+=(--tensor-parallel-size "$GPUS_PER_WORKER"); fi
}
launch_workers "$VLLM" vllm_args
wait_healthy

SPECS=()
for ((i = 0; i < N; i++)); do
    SPECS+=("http://$ADVERTISE_HOST:$(http_port "$i"),kv=tcp://$ADVERTISE_HOST:$(kv_port "$i"),replay=tcp://$ADVERTISE_HOST:$(replay_port "$i"),name=$NAME_PREFIX-$i")
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
print_serve_line "${serve[@]}"
supervise
