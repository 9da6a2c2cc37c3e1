# pagedserve: one image for the scheduler and the workers.
#   docker build -t pagedserve .                          CPU torch (default target `cpu`)
#   docker build -t pagedserve:gpu --target gpu .         CUDA torch + CuPy, for `--device cuda` workers
# With no network in the build, put every wheel in docker/wheels/ first (as tests/compose/run.sh does): then pip
# installs from that folder alone. Build args: BASE_IMAGE (the final image's base), BUILD_IMAGE (the build
# stages'; same Python at the same path), TORCH_INDEX (where the CPU torch build comes from).
# NOTE: needs BuildKit (Docker's default builder since 23.0; DOCKER_BUILDKIT=1 on 20.10) for RUN --mount.
ARG BASE_IMAGE=python:3.11-slim-bookworm
ARG BUILD_IMAGE=${BASE_IMAGE}

# ---- build stages: a virtual environment in /opt/venv, copied whole into the final image ----------------------
FROM ${BUILD_IMAGE} AS build-env
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 PIP_ROOT_USER_ACTION=ignore PATH=/opt/venv/bin:$PATH
# g++ compiles the CPU attention kernel for portable targets here, so the final image needs no compiler.
RUN command -v g++ >/dev/null || { apt-get update && apt-get install -y --no-install-recommends g++ \
        && rm -rf /var/lib/apt/lists/*; }
RUN python3 -m venv /opt/venv
WORKDIR /src
COPY docker/*.py docker/*.sh /usr/local/lib/pagedserve-build/
# NOTE: only pyproject.toml before the dependency layers: editing the source never reinstalls torch.
COPY pyproject.toml ./

FROM build-env AS deps-cpu
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
RUN --mount=type=bind,source=docker/wheels,target=/wheels \
    cd /usr/local/lib/pagedserve-build \
    && ./pip-install.sh --index-url "$TORCH_INDEX" $(python3 requirements.py /src/pyproject.toml --only torch) \
    && ./pip-install.sh $(python3 requirements.py /src/pyproject.toml --without torch)

FROM build-env AS deps-gpu
# PyPI's Linux torch wheels are the CUDA builds; CuPy comes from the `gpu` extra.
RUN --mount=type=bind,source=docker/wheels,target=/wheels \
    cd /usr/local/lib/pagedserve-build \
    && ./pip-install.sh $(python3 requirements.py /src/pyproject.toml --extra gpu)

FROM build-env AS source
# What the package is made of (pyproject.toml's package-dir and packages): tests/deploy/test_container.py
# checks the list.
COPY README.md ./
COPY protos ./protos
COPY pagedserve_cli ./pagedserve_cli
COPY pagedserve_common ./pagedserve_common
COPY scheduler_svc ./scheduler_svc
COPY worker_svc ./worker_svc
COPY cuda ./cuda

FROM deps-cpu AS app-cpu
COPY --from=source /src /src
RUN --mount=type=bind,source=docker/wheels,target=/wheels /usr/local/lib/pagedserve-build/install-app.sh

FROM deps-gpu AS app-gpu
COPY --from=source /src /src
RUN --mount=type=bind,source=docker/wheels,target=/wheels /usr/local/lib/pagedserve-build/install-app.sh

# ---- final images ------------------------------------------------------------------------------------------
FROM ${BASE_IMAGE} AS runtime
# libgomp: the prebuilt CPU kernel's OpenMP runtime (the build base images of CI bring it already).
RUN ldconfig -p | grep -q 'libgomp\.so\.1' || { apt-get update \
        && apt-get install -y --no-install-recommends libgomp1 && rm -rf /var/lib/apt/lists/*; } \
    && useradd --create-home --uid 1000 --shell /usr/sbin/nologin pagedserve \
    && mkdir -p /cache /credentials && chown pagedserve:pagedserve /cache /credentials \
    && chmod 700 /credentials
# NOTE: inside a container the client API, metrics and HTTP front listen on every interface of its own network
# namespace; what reaches the host is what is published (compose.yaml: 127.0.0.1 only). The worker port stays on
# loopback (the default): `docker run` runs `up`, whose workers are in the same container. compose.yaml opens it
# to its network, with a worker token from the /credentials volume. The model cache is /cache (a volume in compose).
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 \
    PAGEDSERVE_CACHE=/cache \
    PAGEDSERVE_CUDA_DIR=/opt/venv/share/pagedserve/cuda \
    PAGEDSERVE_LISTEN=0.0.0.0:50051 \
    PAGEDSERVE_METRICS=0.0.0.0:9464 \
    PAGEDSERVE_HTTP=0.0.0.0:8000
USER pagedserve
WORKDIR /home/pagedserve
EXPOSE 50051 9464 8000
ENTRYPOINT ["pagedserve"]
CMD ["up"]

FROM runtime AS gpu
COPY --from=app-gpu /opt/venv /opt/venv

# NOTE: last, so that a plain `docker build .` gives the CPU image.
FROM runtime AS cpu
COPY --from=app-cpu /opt/venv /opt/venv
