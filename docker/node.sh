#!/bin/sh
# netdist-node: the command of every container in docker-compose.yml.
#
# Works out this container's rank and the job's size from its role and the shape of the
# cluster, then runs `netdist worker` with the training flags taken from the environment.
# Configuration is environment only:
#
#   NETDIST_ROLE            worker | server          (set per service)
#   NETDIST_INDEX           index among the workers (service worker-I) or the servers
#                           (service ps-server-I)
#   NETDIST_WORKERS         number of worker containers started (default 4)
#   NETDIST_PS_SERVERS      number of parameter-server containers (default 0; 2 when
#                           COMPOSE_PROFILES contains "ps"). Servers are ranks 0..S-1
#                           (ps-server-0 hosts the coordinator); worker-I is rank S+I.
#                           Service names say role and index, never a rank: this
#                           script logs the rank each container got.
#                           With servers the aggregator is ps-sharded (or ps-async, bounded
#                           by NETDIST_PS_MAX_STALENESS); the demo's servers also train.
#   NETDIST_RANK, NETDIST_WORLD_SIZE, NETDIST_COORDINATOR
#                           derived from the above unless set explicitly
#   NETDIST_AGGREGATOR      ring | topk | fp16 | ps (default ring); ps-sharded | ps-async
#                           with servers (default ps-sharded)
#   NETDIST_EPOCHS, NETDIST_SEED, NETDIST_BATCH_SIZE, NETDIST_LR
#                           training flags (defaults: 8 epochs, seed 0, the demo's batch/lr)
#   NETDIST_CHECKPOINT_DIR  default /checkpoints/$NETDIST_JOB_ID (the shared volume);
#                           "none" disables checkpointing
#   NETDIST_CHECKPOINT_EVERY  save every K steps (default 12); the job always resumes
#                           from the latest complete checkpoint there (--resume); a job
#                           whose checkpoint already completes NETDIST_EPOCHS trains
#                           nothing and says so
#   NETDIST_WORKER_ARGS     extra `netdist worker` flags, split on spaces
#
# Arguments given to this script are appended to the `netdist worker` command line.
set -eu

die() { echo "netdist-node: $*" >&2; exit 2; }
is_uint() { case "$1" in ''|*[!0-9]*) return 1 ;; *) return 0 ;; esac; }

role=${NETDIST_ROLE:-worker}
index=${NETDIST_INDEX:-0}
workers=${NETDIST_WORKERS:-4}
servers=${NETDIST_PS_SERVERS:-}
if [ -z "$servers" ]; then
    case ",${NETDIST_COMPOSE_PROFILES:-}," in
        *,ps,*) servers=2 ;;
        *) servers=0 ;;
    esac
fi
is_uint "$index" || die "NETDIST_INDEX must be a number, got '$index'"
is_uint "$workers" && [ "$workers" -ge 1 ] || die "NETDIST_WORKERS must be >= 1, got '$workers'"
is_uint "$servers" || die "NETDIST_PS_SERVERS must be a number, got '$servers'"

case "$role" in
    worker)
        [ "$index" -lt "$workers" ] \
            || die "worker $index is not part of a job with NETDIST_WORKERS=$workers workers"
        rank=$((servers + index)) ;;
    server)
        [ "$servers" -ge 1 ] || die "this is a parameter-server container but the workers do" \
            "not count servers: start the ps profile with COMPOSE_PROFILES=ps, or set" \
            "NETDIST_PS_SERVERS=2 together with --profile ps"
        [ "$index" -lt "$servers" ] \
            || die "server $index is not part of a job with NETDIST_PS_SERVERS=$servers"
        rank=$index ;;
    *) die "NETDIST_ROLE must be worker or server, got '$role'" ;;
esac

if [ "$servers" -ge 1 ]; then
    coordinator_host=ps-server-0
    aggregator=${NETDIST_AGGREGATOR:-ps-sharded}
    case "$aggregator" in
        ps-sharded|ps-async) ;;
        *) die "NETDIST_AGGREGATOR=$aggregator does not use parameter servers;" \
               "with servers use ps-sharded or ps-async" ;;
    esac
else
    coordinator_host=worker-0
    aggregator=${NETDIST_AGGREGATOR:-ring}
fi

export NETDIST_RANK="${NETDIST_RANK:-$rank}"
export NETDIST_WORLD_SIZE="${NETDIST_WORLD_SIZE:-$((servers + workers))}"
export NETDIST_COORDINATOR="${NETDIST_COORDINATOR:-$coordinator_host:29400}"
export NETDIST_JOB_ID="${NETDIST_JOB_ID:-compose}"

set -- --aggregator "$aggregator" --epochs "${NETDIST_EPOCHS:-8}" \
    --seed "${NETDIST_SEED:-0}" "$@"
[ -n "${NETDIST_BATCH_SIZE:-}" ] && set -- --batch-size "$NETDIST_BATCH_SIZE" "$@"
[ -n "${NETDIST_LR:-}" ] && set -- --lr "$NETDIST_LR" "$@"
if [ "$servers" -ge 1 ]; then
    export NETDIST_PS_SERVERS="$servers"  # read by `netdist worker` in the ps modes
else
    unset NETDIST_PS_SERVERS
fi

checkpoint_dir=${NETDIST_CHECKPOINT_DIR:-/checkpoints/$NETDIST_JOB_ID}
if [ "$servers" -eq 0 ] && [ "$checkpoint_dir" != none ]; then
    # the dedicated-server modes keep the parameters on the servers: no checkpoints there
    set -- --checkpoint-dir "$checkpoint_dir" \
        --checkpoint-every "${NETDIST_CHECKPOINT_EVERY:-12}" --resume "$@"
fi

echo "netdist-node: $(hostname) is rank $NETDIST_RANK of $NETDIST_WORLD_SIZE" \
     "($role $index), coordinator $NETDIST_COORDINATOR, job $NETDIST_JOB_ID" >&2
# shellcheck disable=SC2086 # NETDIST_WORKER_ARGS is a list of flags
exec netdist worker "$@" ${NETDIST_WORKER_ARGS:-}
