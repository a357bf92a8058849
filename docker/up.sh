#!/usr/bin/env bash
# docker/up.sh: run the docker-compose netdist job and exit with its status.
#
#   docker/up.sh [UP-OPTION...] [SERVICE...]      e.g. docker/up.sh --no-build
#
# `docker-compose up` (v1) exits 0 even when every container exits 64, 1 or 137, and
# `--abort-on-container-exit` / `--exit-code-from` stop the whole job as soon as any one
# container exits, successfully or not (a rank that finishes first would cut short rank 0
# reporting the accuracy). This wrapper does what the job needs with either Compose:
#
#   1. `compose up -d UP-OPTION... SERVICE...` (all default services when none are named;
#      COMPOSE_PROFILES=ps adds the parameter servers), from the repository root;
#   2. streams every started container's output, prefixed with its service name;
#   3. waits until every one of them has stopped for good (a container that its restart
#      policy, NETDIST_RESTART, brings back is waited for again, and its last run's
#      output is printed when it ends);
#   4. prints how each container ended and exits 0 only when all of them exited 0.
#      Otherwise it names the failed containers in the order they failed and exits with
#      the exit code of the first one (64: network shaping refused, 1: a netdist error,
#      2: a configuration error, 137: killed, ...).
#
# Ctrl-C stops the job's containers (`docker stop`), like an attached `compose up`,
# reports how they ended and exits 130. Compose: `docker compose` (v2) when installed, else
# `docker-compose` (1.29); NETDIST_COMPOSE overrides, e.g. NETDIST_COMPOSE="docker-compose
# -p myjob". Every variable of docker-compose.yml (COMPOSE_PROJECT_NAME, NETDIST_*)
# applies as with plain compose.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
me="netdist up"
say() { printf '%s: %s\n' "$me" "$*" >&2; }
die() { say "$*"; exit 2; }

for arg in "$@"; do
    case "$arg" in
        -d|--detach) die "$arg is what this wrapper is not for: use 'compose up -d' directly" ;;
    esac
done

if [ -n "${NETDIST_COMPOSE:-}" ]; then
    read -r -a compose <<<"$NETDIST_COMPOSE"
elif docker compose version >/dev/null 2>&1; then
    compose=(docker compose)
elif command -v docker-compose >/dev/null 2>&1; then
    compose=(docker-compose)
else
    die "neither 'docker compose' (v2) nor 'docker-compose' is installed"
fi
cd "$repo"

# "ID STARTED-AT" for every container of the project (stopped ones and one-off `run`
# containers included; one-offs are filtered out below).
snapshot() {
    local ids
    ids=$("${compose[@]}" ps -a -q 2>/dev/null) || true
    [ -n "$ids" ] || return 0
    # shellcheck disable=SC2086 # one id per word
    docker inspect -f '{{.Id}} {{.State.StartedAt}}' $ids 2>/dev/null || true
}

# A docker timestamp (RFC 3339 with 0-9 fraction digits, UTC) in a fixed-width,
# sortable form.
sortable_time() {
    local t=${1%Z} whole frac
    whole=${t%%.*}
    frac=""
    [ "$whole" != "$t" ] && frac=${t#*.}
    frac="${frac}000000000"
    printf '%s.%s' "$whole" "${frac:0:9}"
}

before=$(snapshot)
"${compose[@]}" up -d "$@"

# The containers this `up` started: new ones, and old ones that started again.
run_ids=()
while read -r id started; do
    [ -n "$id" ] || continue
    if grep -qxF "$id $started" <<<"$before"; then
        continue
    fi
    if [ "$(docker inspect -f '{{index .Config.Labels "com.docker.compose.oneoff"}}' "$id")" = True ]; then
        continue
    fi
    run_ids+=("$id")
done <<<"$(snapshot)"
if [ "${#run_ids[@]}" -eq 0 ]; then
    say "compose started no container (is the job already running? see '${compose[*]} ps')"
    exit 1
fi

service_of() { docker inspect -f '{{index .Config.Labels "com.docker.compose.service"}}' "$1"; }
width=0
for id in "${run_ids[@]}"; do
    svc=$(service_of "$id")
    [ "${#svc}" -gt "$width" ] && width=${#svc}
done

# Prefix every line of stdin with the service name, like compose does.
prefixed() {
    local line
    while IFS= read -r line || [ -n "$line" ]; do
        printf '%-*s | %s\n' "$width" "$1" "$line"
    done
}

followers=()
for id in "${run_ids[@]}"; do
    read -r svc started < <(docker inspect -f \
        '{{index .Config.Labels "com.docker.compose.service"}} {{.State.StartedAt}}' "$id")
    # this run's output only (a container started again keeps its earlier runs' logs);
    # ends when the container stops (a restart is printed at the end, below)
    (docker logs --follow --since "$started" "$id" 2>&1 | prefixed "$svc") &
    followers+=("$!")
done

stopping=0
# shellcheck disable=SC2317 # invoked by the trap below
stop_job() {
    [ "$stopping" = 1 ] && return
    stopping=1
    say "interrupted: stopping the job's containers"
    docker stop -t 10 "${run_ids[@]}" >/dev/null 2>&1 || true
}
trap stop_job INT TERM

# Wait until no container of the run is running or restarting.
while :; do
    running=()
    for id in "${run_ids[@]}"; do
        if [ "$(docker inspect -f '{{.State.Running}}' "$id")" = true ]; then
            running+=("$id")
        fi
    done
    [ "${#running[@]}" -eq 0 ] && break
    docker wait "${running[@]}" >/dev/null 2>&1 &
    wait "$!" || true   # returns early on Ctrl-C: the trap stops the containers
done
trap - INT TERM

# The followers end with their containers; bound the wait all the same.
for pid in "${followers[@]}"; do
    for _ in $(seq 1 100); do
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.1
    done
    kill "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
done

# How each container ended, in service order (which is rank order: ps-server-* before
# worker-*); failures sorted by when they happened.
report=()
failures=()
for id in "${run_ids[@]}"; do
    read -r svc code oom restarts started finished < <(docker inspect -f \
        '{{index .Config.Labels "com.docker.compose.service"}} {{.State.ExitCode}} {{.State.OOMKilled}} {{.RestartCount}} {{.State.StartedAt}} {{.State.FinishedAt}}' "$id")
    if [ "$restarts" -gt 0 ]; then
        say "$svc was restarted $restarts time(s) by its restart policy; its last run:"
        docker logs --since "$started" "$id" 2>&1 | prefixed "$svc"
    fi
    note=""
    [ "$restarts" -gt 0 ] && note=" after $restarts restart(s)"
    case "$code" in
        0) ;;
        137) note="$note (SIGKILL: docker kill, docker stop's timeout, or out of memory)" ;;
        143) note="$note (SIGTERM: stopped)" ;;
        64) note="$note (network shaping could not be applied)" ;;
    esac
    [ "$oom" = true ] && note="$note (OOM-killed)"
    report+=("$svc exited $code$note")
    if [ "$code" != 0 ]; then
        failures+=("$(sortable_time "$finished") $code $svc exited $code$note")
    fi
done

printf '%s\n' "${report[@]}" | sort | while IFS= read -r line; do say "$line"; done
if [ "$stopping" = 1 ]; then
    say "job interrupted: its containers were stopped (run again to resume from the latest checkpoint)"
    exit 130
fi
if [ "${#failures[@]}" -eq 0 ]; then
    say "job finished: all ${#run_ids[@]} containers exited 0"
    exit 0
fi
sorted=$(printf '%s\n' "${failures[@]}" | sort)
first_code=$(head -n 1 <<<"$sorted" | cut -d' ' -f2)
order=$(cut -d' ' -f3- <<<"$sorted" | paste -sd ';' - | sed 's/;/; then /g')
say "job FAILED: $order"
exit "$first_code"
