# The node agent image for NVIDIA GPU hosts: llama-cpp-python's ggml built with CUDA, so the native
# library (which picks ggml's first GPU device) runs shards on the GPU; NVML telemetry included.
#   docker build -f docker/agent-cuda.Dockerfile -t gguf-swarm-agent:cuda .
#   docker run --gpus all ... (or, in compose: see docs/agent-install.md, "GPU hosts")
# Not built in CI (no GPU, no CUDA toolkit there); the CPU image is the default.

ARG CUDA_VERSION=12.6.3
FROM nvidia/cuda:${CUDA_VERSION}-devel-ubuntu24.04 AS build
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev build-essential cmake \
    && rm -rf /var/lib/apt/lists/*
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
# CMAKE_ARGS reach llama.cpp's CMake: GGML_CUDA builds libggml-cuda.so beside the CPU backend.
RUN python3 -m venv /opt/agent \
    && CMAKE_ARGS="-DGGML_CUDA=on" /opt/agent/bin/pip install llama-cpp-python==0.3.36 setuptools
COPY pyproject.toml README.md ./
COPY agent agent
COPY native native
COPY scripts/build_agent_wheel.py scripts/
# GGSWARM_GGML=shared: the native library links that CUDA-enabled ggml (its own static ggml is CPU-only)
RUN GGSWARM_GGML=shared PYTHON=/opt/agent/bin/python bash native/build.sh \
    && /opt/agent/bin/python scripts/build_agent_wheel.py --out /wheels
COPY requirements.txt ./
RUN /opt/agent/bin/pip install -c requirements.txt "$(ls /wheels/*.whl)[llamacpp,torrent,gpu]"

FROM nvidia/cuda:${CUDA_VERSION}-runtime-ubuntu24.04
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 libgomp1 curl \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build /opt/agent /opt/agent
COPY docker/agent-entrypoint.sh /usr/local/bin/agent-entrypoint
RUN useradd --system --uid 10001 --home-dir /data --shell /usr/sbin/nologin swarm \
    && mkdir -p /data /config && chown swarm:swarm /data /config && chmod 0700 /config
USER swarm
# CUDA ordinals in PCI order = NVML indices, so telemetry and placement name the same GPU.
ENV PATH=/opt/agent/bin:$PATH PYTHONUNBUFFERED=1 GGUF_SWARM_CONFIG=/config/node.json GGUF_SWARM_DATA=/data \
    CUDA_DEVICE_ORDER=PCI_BUS_ID NVIDIA_DRIVER_CAPABILITIES=compute,utility
VOLUME ["/data", "/config"]
EXPOSE 9000 6881
HEALTHCHECK --interval=10s --timeout=5s --start-period=60s --retries=5 \
    CMD curl -fsS http://127.0.0.1:${AGENT_PORT:-9000}/v1/health || exit 1
ENTRYPOINT ["agent-entrypoint"]
CMD ["run", "--host", "0.0.0.0", "--port", "9000"]
