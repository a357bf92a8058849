#!/usr/bin/env bash
# Prepare a CI machine for the `docker`-marked tests (tests/docker), called by .ci/run
# before the test suite. Needs: root, Debian, a running Docker engine, docker-compose
# 1.29 or the Compose v2 plugin. No registry: every image is built locally.
#
#   docker/ci-setup.sh        check the engine and compose, then docker/build-offline.sh
#                             (debootstrap installed with apt-get when missing; the base
#                             image, the wheelhouse and the image are cached, so a second
#                             run takes seconds)
#
# Exits non-zero with the reason when anything is missing: in CI the docker tests must
# run, never skip.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
log() { printf 'ci-setup: %s\n' "$*" >&2; }
die() { log "$*"; exit 1; }

start=$(date +%s)
command -v docker >/dev/null 2>&1 || die "the docker CLI is not installed"
server=$(timeout 60 docker info --format '{{.ServerVersion}}' 2>/dev/null || true)
[ -n "$server" ] || die "no Docker engine reachable (is dockerd running? DOCKER_HOST=${DOCKER_HOST:-unset})"
if timeout 60 docker compose version >/dev/null 2>&1; then
    compose="docker compose ($(docker compose version --short 2>/dev/null || echo v2))"
elif command -v docker-compose >/dev/null 2>&1; then
    compose="docker-compose ($(docker-compose version --short 2>/dev/null || echo '?'))"
else
    die "neither the Compose v2 plugin nor docker-compose is installed"
fi
log "Docker engine $server, $compose"

"$here/build-offline.sh"

log "ready in $(( $(date +%s) - start )) s: $(docker image ls --format '{{.Repository}}:{{.Tag}} {{.Size}}' \
    | grep -E '^netdist(-base)?:' | tr '\n' ' ')"
