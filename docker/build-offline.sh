#!/usr/bin/env bash
# Build the netdist image with no container registry:
#   1. a Debian base image made with debootstrap (mirror read from this machine's apt
#      sources at run time) and `docker import`, cached by tag;
#   2. a wheelhouse (./wheelhouse: netdist's wheel, its dependencies' wheels in deps/)
#      built on the host with pip, cached by a fingerprint of the dependency list and of the netdist sources;
#   3. the compose build with BASE_IMAGE and WHEELHOUSE as build arguments (docker build
#      cache: editing netdist rebuilds only the image's last layer).
# A second run with nothing changed takes seconds. Users with a registry do not need
# this: `docker compose up` builds on python:3.11-slim.
#
# Environment: NETDIST_BASE_IMAGE (default netdist-base:local), NETDIST_IMAGE (default
# netdist:local), NETDIST_REBUILD_BASE=1 to rebuild the base image.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/.." && pwd)
base_tag=${NETDIST_BASE_IMAGE:-netdist-base:local}
# Bump when the base's package list changes: a cached base with another version is rebuilt.
base_version=2
base_packages=python3,python3-venv,iproute2,iptables,procps,ca-certificates
image_tag=${NETDIST_IMAGE:-netdist:local}
wheelhouse="$repo/wheelhouse"
log() { printf 'build-offline: %s\n' "$*" >&2; }
die() { log "$*"; exit 1; }

need() { command -v "$1" >/dev/null 2>&1 || die "missing $1 ($2)"; }
need docker "install Docker Engine"
need python3 "install Python 3.11+"
docker info >/dev/null 2>&1 || die "cannot reach the Docker engine (is dockerd running?)"

codename() { (. /etc/os-release && printf '%s' "${VERSION_CODENAME:-bookworm}"); }

# The Debian mirror this machine already uses: first deb822 URI of a non-security
# suite, else the first classic `deb URI SUITE` line. Nothing is hard-coded.
debian_mirror() {
    local uri="" files=()
    shopt -s nullglob
    files=(/etc/apt/sources.list.d/*.sources)
    shopt -u nullglob
    if [ "${#files[@]}" -gt 0 ]; then
        uri=$(awk '
            /^[[:space:]]*$/ { uris = "" }
            /^URIs:/ { uris = $2 }
            /^Suites:/ { for (i = 2; i <= NF; i++) if ($i !~ /security/ && uris != "") { print uris; exit } }
        ' "${files[@]}" 2>/dev/null | head -n 1 || true)
    fi
    if [ -z "$uri" ]; then
        uri=$(cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null \
            | awk '$1 == "deb" { for (i = 2; i <= NF; i++) if ($i ~ /^(https?|file):/) { if ($(i + 1) !~ /security/) print $i; break } }' \
            | head -n 1 || true)
    fi
    [ -n "$uri" ] || die "no Debian mirror found in /etc/apt/sources.list{,.d}"
    printf '%s' "$uri"
}

build_base() {
    local cached
    cached=$(docker image inspect -f '{{index .Config.Labels "org.netdist.base-version"}}' \
        "$base_tag" 2>/dev/null || true)
    if [ "${NETDIST_REBUILD_BASE:-0}" != 1 ] && [ "$cached" = "$base_version" ]; then
        log "base image $base_tag cached"
        return
    fi
    if ! command -v debootstrap >/dev/null 2>&1; then
        [ "$(id -u)" = 0 ] || die "debootstrap is missing and installing it needs root"
        log "installing debootstrap"
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null
    fi
    [ "$(id -u)" = 0 ] || die "debootstrap needs root"
    local mirror suite rootfs
    mirror=$(debian_mirror)
    suite=$(codename)
    rootfs=$(mktemp -d /tmp/netdist-rootfs.XXXXXX)
    # shellcheck disable=SC2064 # expand now: the trap runs after $rootfs is out of scope
    trap "rm -rf '$rootfs'" EXIT
    log "debootstrap $suite from the machine's mirror into $rootfs (about a minute, once)"
    debootstrap --variant=minbase \
        --include="$base_packages" \
        "$suite" "$rootfs" "$mirror" >/tmp/netdist-debootstrap.log 2>&1 \
        || { tail -n 20 /tmp/netdist-debootstrap.log >&2; die "debootstrap failed; see /tmp/netdist-debootstrap.log"; }
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
    log "docker import -> $base_tag"
    tar -C "$rootfs" -c . | docker import \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'ENV LANG=C.UTF-8' \
        --change "LABEL org.netdist.base-version=$base_version" \
        --change 'CMD ["/bin/bash"]' - "$base_tag" >/dev/null
    rm -rf "$rootfs"
    trap - EXIT
}

# What the image needs from the wheelhouse: the [project] dependencies plus the demo
# extra, exactly as the Dockerfile computes them.
requirements() {
    python3 -c 'import sys, tomllib
p = tomllib.load(open(sys.argv[1], "rb"))["project"]
print("\n".join([*p["dependencies"], *p["optional-dependencies"]["demo"]]))' "$repo/pyproject.toml"
}

# A fingerprint of netdist's sources (what goes into its wheel).
source_fingerprint() {
    python3 - "$repo" <<'EOF'
import hashlib, pathlib, sys
root = pathlib.Path(sys.argv[1])
h = hashlib.sha256()
files = [root / "pyproject.toml", root / "README.md"]
files += sorted(p for p in (root / "netdist").rglob("*")
                if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc")
for p in files:
    h.update(str(p.relative_to(root)).encode() + b"\0" + p.read_bytes() + b"\0")
print(h.hexdigest())
EOF
}

# Python version and machine of the base image, cached per base image id.
base_platform() {
    local id cache="$wheelhouse/.base-platform"
    id=$(docker image inspect -f '{{.Id}}' "$base_tag")
    if [ -f "$cache" ] && [ "$(head -n 1 "$cache")" = "$id" ]; then
        sed -n 2p "$cache"
        return
    fi
    local platform
    platform=$(docker run --rm --network none "$base_tag" python3 -c \
        'import platform, sys; print(f"{sys.version_info[0]}.{sys.version_info[1]} {platform.machine()}")')
    printf '%s\n%s\n' "$id" "$platform" >"$cache"
    printf '%s\n' "$platform"
}

build_wheelhouse() {
    mkdir -p "$wheelhouse"
    local platform pyver machine reqs stamp
    platform=$(base_platform)
    pyver=${platform% *}
    machine=${platform#* }
    reqs=$(requirements)

    # 1. dependency wheels (in deps/) for the image's interpreter, whatever Python runs
    #    this script
    stamp=$(printf '%s\n%s\n' "$platform" "$reqs" | sha256sum | cut -d' ' -f1)
    if [ -f "$wheelhouse/deps/.stamp" ] && [ "$(cat "$wheelhouse/deps/.stamp")" = "$stamp" ]; then
        log "dependency wheels cached (Python $pyver, $machine)"
    else
        log "downloading dependency wheels for Python $pyver on $machine"
        rm -rf "$wheelhouse/deps"
        mkdir -p "$wheelhouse/deps"
        printf '%s\n' "$reqs" >"$wheelhouse/deps/requirements.txt"
        python3 -m pip download --quiet --dest "$wheelhouse/deps" --only-binary=:all: \
            --python-version "$pyver" --implementation cp \
            --platform "manylinux2014_$machine" --platform "manylinux_2_17_$machine" \
            --platform "manylinux_2_28_$machine" \
            -r "$wheelhouse/deps/requirements.txt" \
            || die "pip download failed (is a package index reachable?)"
        printf '%s\n' "$stamp" >"$wheelhouse/deps/.stamp"
    fi

    # 2. netdist's own wheel, built from a clean copy of the sources (an in-tree build
    #    could pick up modules deleted since the last build)
    stamp=$(source_fingerprint)
    if [ -f "$wheelhouse/.netdist-stamp" ] && [ "$(cat "$wheelhouse/.netdist-stamp")" = "$stamp" ] \
            && ls "$wheelhouse"/netdist-*.whl >/dev/null 2>&1; then
        log "netdist wheel up to date"
        return
    fi
    log "building the netdist wheel"
    local src isolation=()
    src=$(mktemp -d /tmp/netdist-src.XXXXXX)
    cp -r "$repo/netdist" "$repo/pyproject.toml" "$repo/README.md" "$src/"
    find "$src" -name __pycache__ -prune -exec rm -rf {} +
    # the host's setuptools is enough when recent; else let pip fetch one
    if python3 -c 'import setuptools, sys; sys.exit(int(setuptools.__version__.split(".")[0]) < 68)' 2>/dev/null; then
        isolation=(--no-build-isolation)
    fi
    rm -f "$wheelhouse"/netdist-*.whl
    python3 -m pip wheel --quiet --no-deps "${isolation[@]}" --wheel-dir "$wheelhouse" "$src" \
        || { rm -rf "$src"; die "building the netdist wheel failed"; }
    rm -rf "$src"
    ls "$wheelhouse"/netdist-*.whl >/dev/null
    printf '%s\n' "$stamp" >"$wheelhouse/.netdist-stamp"
}

compose() {
    if docker compose version >/dev/null 2>&1; then
        docker compose "$@"
    elif command -v docker-compose >/dev/null 2>&1; then
        docker-compose "$@"
    else
        return 127
    fi
}

build_image() {
    log "building $image_tag on $base_tag with the wheelhouse"
    local status=0 buildlog=/tmp/netdist-image-build.log
    # The compose build: the file's build section, with the base and the wheelhouse as
    # build arguments. Plain `docker build` when no compose is installed.
    (cd "$repo" && NETDIST_BASE_IMAGE="$base_tag" NETDIST_WHEELHOUSE=wheelhouse \
        NETDIST_IMAGE="$image_tag" NETDIST_TOKEN="${NETDIST_TOKEN:-build}" \
        compose -f docker-compose.yml -p netdist-build build worker-0) >"$buildlog" 2>&1 || status=$?
    if [ "$status" = 127 ]; then
        (cd "$repo" && docker build --build-arg BASE_IMAGE="$base_tag" \
            --build-arg WHEELHOUSE=wheelhouse -f docker/Dockerfile -t "$image_tag" .) \
            >"$buildlog" 2>&1 || status=$?
    fi
    if [ "$status" != 0 ]; then
        tail -n 30 "$buildlog" >&2
        die "image build failed (exit $status); full log in $buildlog"
    fi
    docker image inspect "$image_tag" >/dev/null 2>&1 || die "the build did not produce $image_tag"
    # earlier builds of the image, untagged by this one (shared layers stay)
    docker image prune -f --filter label=org.netdist.image=node >/dev/null 2>&1 || true
    log "done: $image_tag"
}

build_base
build_wheelhouse
build_image
