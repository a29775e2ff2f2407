# shellcheck shell=bash
# What bin/launch-vllm-workers.sh and bin/launch-sglang-workers.sh share (sourced, never run):
# argument checks, one process group per worker, waiting for /health, the serve line, and
# stopping every worker when the launcher exits.
#
# The launcher sets ENGINE (the engine's name in messages) and its environment defaults;
# parse_launch_args sets N, MODEL and EXTRA, resolve_hosts CHECK_HOST and ADVERTISE_HOST,
# launch_workers fills PIDS and LOGS (index i = worker i).

PIDS=()
LOGS=()
KEEP=0  # 1: leave the workers running on exit (DETACH=1)
USE_SETSID=0
if command -v setsid >/dev/null 2>&1; then USE_SETSID=1; fi

usage() {
    sed -n '2,4p' "$0" | sed 's/^# \{0,1\}//' >&2
    echo "See the header of $0 for the environment overrides." >&2
    exit 2
}

fail() {
    echo "error: $*" >&2
    exit 1
}

parse_launch_args() {  # N MODEL [extra engine args...] -> N, MODEL, EXTRA (exit 2 on misuse)
    [[ $# -ge 2 ]] || usage
    N=$1
    # shellcheck disable=SC2034  # MODEL is the launcher's to use
    MODEL=$2
    shift 2
    EXTRA=("$@")
    [[ $N =~ ^[1-9][0-9]*$ ]] || { echo "error: N must be a positive integer, got '$N'" >&2; exit 2; }
}

require_uints() {  # exit 2 unless every named variable holds a non-negative integer
    local v
    for v in "$@"; do
        [[ ${!v} =~ ^[0-9]+$ ]] || { echo "error: $v must be a non-negative integer, got '${!v}'" >&2; exit 2; }
    done
}

resolve_hosts() {  # HOST -> CHECK_HOST (where this script polls), ADVERTISE_HOST (what the router dials)
    case $HOST in
        0.0.0.0 | :: | "[::]" | 127.0.0.1 | localhost) CHECK_HOST=127.0.0.1 ;;
        *) CHECK_HOST=$HOST ;;
    esac
    ADVERTISE_HOST=${ADVERTISE_HOST:-$CHECK_HOST}
}

stop_all() {
    # Each worker leads its own process group (setsid): TERM the group so the engine's
    # helper processes go too, then KILL what is left after a grace period.
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
        echo "stopping ${#PIDS[@]} $ENGINE worker(s)..." >&2
        stop_all
    fi
    exit "$rc"
}

install_stop_traps() {  # any exit (error, Ctrl-C = 130, SIGTERM = 143) stops the workers
    trap on_exit EXIT
    trap 'exit 130' INT
    trap 'exit 143' TERM
}

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

# Worker i's ports: HTTP BASE_PORT+i, KV events KV_BASE+2i, replay KV_BASE+2i+1.
http_port() { echo $((BASE_PORT + $1)); }
kv_port() { echo $((KV_BASE + 2 * $1)); }
replay_port() { echo $((KV_BASE + 2 * $1 + 1)); }

launch_workers() {  # launch_workers EXE BUILD: start N workers as `EXE ARGS... EXTRA...`
    # BUILD PORT KV REPLAY sets the array ARGS to worker i's engine arguments.
    local exe=$1 build=$2 i port kv replay first g gpus log envs
    for ((i = 0; i < N; i++)); do
        port=$(http_port "$i")
        kv=$(kv_port "$i")
        replay=$(replay_port "$i")
        first=$((GPU_OFFSET + i * GPUS_PER_WORKER))
        gpus=""
        for ((g = 0; g < GPUS_PER_WORKER; g++)); do gpus+="${gpus:+,}$((first + g))"; done
        "$build" "$port" "$kv" "$replay"
        ARGS+=(${EXTRA[@]+"${EXTRA[@]}"})  # extra args last, so they win (bash < 4.4 treats an empty array as unset)
        log="$LOG_DIR/worker-$i.log"
        LOGS+=("$log")
        printf '%q ' "CUDA_VISIBLE_DEVICES=${gpus:-(inherited)}" "$exe" "${ARGS[@]}" >"$log"
        echo >>"$log"
        # GPUS_PER_WORKER=0: no pinning, the worker inherits CUDA_VISIBLE_DEVICES.
        envs=(env)
        if [[ -n $gpus ]]; then envs+=("CUDA_VISIBLE_DEVICES=$gpus"); fi
        if [[ $USE_SETSID == 1 ]]; then
            setsid "${envs[@]}" "$exe" "${ARGS[@]}" >>"$log" 2>&1 </dev/null &
        else
            "${envs[@]}" "$exe" "${ARGS[@]}" >>"$log" 2>&1 </dev/null &
        fi
        PIDS+=("$!")
        echo "worker $i: pid ${PIDS[i]}, GPUs ${gpus:-inherited}, http://$CHECK_HOST:$port, KV tcp://*:$kv (replay $replay), log $log" >&2
    done
}

fail_if_exited() {  # fail_if_exited I WHEN: fail, naming worker I, when its process has exited
    local i=$1 rc=0
    kill -0 "${PIDS[i]}" 2>/dev/null && return 0
    wait "${PIDS[i]}" || rc=$?
    if [[ -n $2 ]]; then
        echo "--- last lines of ${LOGS[i]} ---" >&2
        tail -n 30 "${LOGS[i]}" >&2 || true
    fi
    fail "worker $i (port $(http_port "$i")) exited with status $rc$2; see ${LOGS[i]}"
}

wait_healthy() {  # until every worker's /health answers 200; fail on an exit or after TIMEOUT
    local ready=() left=$N start=$SECONDS i
    echo "waiting up to ${TIMEOUT}s for $N worker(s) to answer /health..." >&2
    for ((i = 0; i < N; i++)); do ready+=(0); done
    while ((left > 0)); do
        for ((i = 0; i < N; i++)); do
            [[ ${ready[i]} == 1 ]] && continue
            fail_if_exited "$i" " before becoming healthy"
            if [[ $(http_status "http://$CHECK_HOST:$(http_port "$i")/health") == 200 ]]; then
                ready[i]=1
                left=$((left - 1))
                echo "worker $i healthy after $((SECONDS - start))s" >&2
            fi
        done
        ((left == 0)) && break
        if ((SECONDS - start >= TIMEOUT)); then
            for ((i = 0; i < N; i++)); do
                [[ ${ready[i]} == 1 ]] && continue
                echo "--- last lines of ${LOGS[i]} ---" >&2
                tail -n 30 "${LOGS[i]}" >&2 || true
                echo "error: worker $i (http://$CHECK_HOST:$(http_port "$i")/health, log ${LOGS[i]}) not healthy after ${TIMEOUT}s" >&2
            done
            exit 1
        fi
        sleep 2
    done
}

print_serve_line() {  # print_serve_line WORD...: announce the healthy fleet, then the router command
    echo "All $N $ENGINE workers are healthy. Run the router with:" >&2
    shquote "$@"
}

supervise() {  # DETACH=1: exit leaving the workers up; else run until one exits or we are stopped
    local i
    if [[ $DETACH == 1 ]]; then
        KEEP=1
        echo "Workers left running (DETACH=1); stop them with: kill -TERM ${PIDS[*]}" >&2
        exit 0
    fi
    echo "Workers running; Ctrl-C stops them all." >&2
    while true; do
        for ((i = 0; i < N; i++)); do fail_if_exited "$i" ""; done
        sleep 5 &
        wait $! || true
    done
}
