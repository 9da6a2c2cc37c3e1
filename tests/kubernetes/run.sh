#!/usr/bin/env bash
# The Kubernetes manifests' pods on a real container engine. No API server, scheduler or kubelet can be installed
# from the package registries these machines reach, so tests/kubernetes/pods.py plays the kubelet on Docker: it
# parses `kubectl kustomize deploy/kubernetes/overlays/cpu` and runs each Deployment's pods with exactly their image,
# command, args, env (envFrom, $(VAR) expansion), volumes, users and capabilities, init containers first, the
# Services' names as network aliases, and the probes as the kubelet runs them. Then: greedy generation through the
# published client port equals `pagedserve up`'s; two workers are both listed and both serve; a worker scaled away
# and the scheduler deleted with streams in flight drain them (the scheduler alive but not ready meanwhile), within
# terminationGracePeriodSeconds.
# Called by .ci/run after tests/compose/run.sh, with the same PAGEDSERVE_COMPOSE_WORK (base images and the image
# build are reused) and PAGEDSERVE_K8S_REFERENCE (the compose run's reference tokens); needs root.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT"
# NOTE: a folder of our own is removed at the end; one given is kept, so that a rerun reuses its base images.
WORK=${PAGEDSERVE_COMPOSE_WORK:-}
[ -n "$WORK" ] || { WORK=$(mktemp -d /tmp/pagedserve-kubernetes.XXXXXX); OWN_WORK=1; }
# shellcheck source=tests/compose/engine.sh
source "$ROOT/tests/compose/engine.sh"
K8S="$WORK/kubernetes"
rm -rf "$K8S"
mkdir -p "$K8S"
PODS=(python "$ROOT/tests/kubernetes/pods.py" --manifests "$K8S/offline.yaml" --state "$K8S")

started=$(date +%s)
step() { echo "=== [$(($(date +%s) - started)) s] $*"; }

cleanup() {
    local rc=$?
    stop_up
    if [ -n "${DOCKERD_PID:-}" ]; then
        if [ $rc -ne 0 ]; then
            echo "=== FAILED (exit $rc); the engine's view:" >&2
            "$DOCKER" ps --all --filter label=k8srun >&2 2>&1 || true
            for c in $("$DOCKER" ps --all --quiet --filter label=k8srun 2>/dev/null); do
                echo "--- $("$DOCKER" inspect -f '{{.Name}}' "$c")" >&2
                "$DOCKER" logs --tail 40 "$c" >&2 2>&1 || true
            done
            tail -20 "$WORK/dockerd.log" >&2 2>/dev/null || true
        fi
        "${PODS[@]}" down >/dev/null 2>&1 || true
        stop_engine
    fi
    [ -n "${OWN_WORK:-}" ] && ! mount | grep -q " $WORK/" && rm -rf "$WORK"
    exit $rc
}
trap cleanup EXIT

step "render the cpu overlay (and CI's offline overlay for model pull)"
kubectl kustomize deploy/kubernetes/overlays/cpu >"$K8S/cpu.yaml"
kubectl kustomize tests/kubernetes/offline >"$K8S/offline.yaml"
"${PODS[@]}" check-offline "$K8S/cpu.yaml"

step "reference: the same requests served without containers (pagedserve up)"
if [ -n "${PAGEDSERVE_K8S_REFERENCE:-}" ] && [ -s "$PAGEDSERVE_K8S_REFERENCE" ]; then
    cp "$PAGEDSERVE_K8S_REFERENCE" "$K8S/reference.json"
    echo "the compose run's: $PAGEDSERVE_K8S_REFERENCE"
else
    serve_reference "$K8S/reference.json"
fi

step "dockerd, base images and the image"
ensure_packages
start_engine
"$DOCKER" version --format 'engine {{.Server.Version}}'
bootstrap_base_images
build_image
# NOTE: nothing is pulled here: the built image is tagged as each image the manifests name.
for image in $("${PODS[@]}" images); do
    "$DOCKER" tag "$PAGEDSERVE_IMAGE" "$image"
    echo "tagged $PAGEDSERVE_IMAGE as $image"
done

step "the worker-token Secret, made out of band (pagedserve worker-token)"
token_dir=$(mktemp -d)
pagedserve worker-token "$token_dir/worker-token"
"${PODS[@]}" create-secret pagedserve-worker-token --from-file "worker-token=$token_dir/worker-token"
rm -rf "$token_dir"

step "the Deployments' pods: init containers, containers, startup/readiness/liveness probes"
"${PODS[@]}" up --pv "pagedserve-model-wheels=$PAGEDSERVE_MODEL_WHEELS"
grpc=$("${PODS[@]}" port pagedserve grpc)
http=$("${PODS[@]}" port pagedserve http)
metrics=$("${PODS[@]}" port pagedserve-metrics metrics)
echo "Service pagedserve: grpc $grpc, http $http; pagedserve-metrics: $metrics"

step "greedy generation through the published client port"
python tests/compose/check.py single --server "$grpc" --http "http://$http" --reference "$K8S/reference.json"

step "scale deployment/pagedserve-worker to 2"
"${PODS[@]}" scale pagedserve-worker 2
python tests/compose/check.py scale --workers 2 --server "$grpc" --metrics "http://$metrics"
"${PODS[@]}" probes

step "scale deployment/pagedserve-worker to 1 with streams in flight"
python tests/compose/check.py drain --server "$grpc" --workers 1 --command "${PODS[*]} scale pagedserve-worker 1"

step "delete the scheduler's pod with streams in flight: it drains within its grace period"
# NOTE: streams of ~8 s of decoding: long enough for the probes, well within the 30 s drain timeout
python tests/compose/check.py drain --server "$grpc" --drain-seconds 8 \
    --command "${PODS[*]} stop pagedserve-scheduler --drain-probes"

step "delete the worker's pod"
"${PODS[@]}" stop pagedserve-worker
"${PODS[@]}" down
left=$("$DOCKER" ps --all --quiet --filter label=k8srun)
volumes=$("$DOCKER" volume ls --quiet --filter label=k8srun)
[ -z "$left$volumes" ] || { echo "containers or volumes left behind: $left $volumes" >&2; exit 1; }
step "passed"
