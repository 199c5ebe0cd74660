# trainingd container image: one daemon per pod (see deploy/kubernetes/).
#
#   docker build -t trainingd:0.1.0 .                        # torch from PyPI (CUDA build on x86_64)
#   docker build -t trainingd:0.1.0-cpu \
#     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu .   # CPU-only, much smaller
#
# Two stages: the venv is built in the first and copied into a slim runtime image that runs as
# an unprivileged user (uid 10001, as the Kubernetes securityContext expects) with nothing to
# download at run time; the `etcd` extra is in, for `rdzv_backend = "etcd-v2"`. Writable paths
# at run time are volumes: the run directory (TRAININGD_RUN_DIR), /tmp (HOME) and /dev/shm; the
# checkpoint root is S3 or a mounted volume.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
# Kept in step with the Makefile's TORCH_PIN (a test checks it).
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=
WORKDIR /opt/trainingd
# A C compiler for the staging copy's helper (ckpt_manager/_save/_streaming_copy.c); only this
# stage has it, the runtime image gets the built module.
RUN apt-get update -qq \
 && apt-get install -y -qq --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
COPY pyproject.toml README.md ./
COPY sharding ./sharding
COPY ckpt_manager ./ckpt_manager
COPY daemon ./daemon
RUN python -m venv /opt/trainingd/.venv \
 && /opt/trainingd/.venv/bin/pip install --no-cache-dir --disable-pip-version-check \
      ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "torch==${TORCH_VERSION}" \
 && /opt/trainingd/.venv/bin/pip install --no-cache-dir --disable-pip-version-check '.[etcd]' \
 && /opt/trainingd/.venv/bin/trainingd --version

FROM ${PYTHON_IMAGE}
RUN groupadd --gid 10001 trainingd \
 && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin trainingd \
 && mkdir -p /run/trainingd /var/lib/trainingd \
 && chown trainingd:trainingd /run/trainingd /var/lib/trainingd
COPY --from=build /opt/trainingd/.venv /opt/trainingd/.venv
ENV PATH=/opt/trainingd/.venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp \
    TRAININGD_RUN_DIR=/run/trainingd
WORKDIR /var/lib/trainingd
USER 10001:10001
# 9464: /metrics /healthz /readyz; 29400: the c10d rendezvous store (node 0).
EXPOSE 9464 29400
# Exec form: the daemon is PID 1 and receives SIGTERM itself (it drives the final checkpoint).
ENTRYPOINT ["trainingd"]
CMD ["run", "--config", "/etc/trainingd/trainingd.toml"]
