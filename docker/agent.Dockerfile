# The node agent image (CPU): the agent wheel with the native ggml library, llama-cpp-python, libtorrent.
#   docker build -f docker/agent.Dockerfile -t gguf-swarm-agent .
# The CUDA variant is docker/agent-cuda.Dockerfile (docs/agent-install.md, "GPU hosts").

FROM python:3.11-slim-bookworm AS build
RUN apt-get update \
    && apt-get install -y --no-install-recommends build-essential cmake \
    && rm -rf /var/lib/apt/lists/*
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
# llama-cpp-python compiles once here; native/build.sh builds its own static ggml from the matching
# sdist (cmake), so the library needs no libggml*.so or libgomp at run time.
RUN python -m venv /opt/agent && /opt/agent/bin/pip install llama-cpp-python==0.3.36 setuptools
COPY pyproject.toml README.md ./
COPY agent agent
COPY native native
COPY scripts/build_agent_wheel.py scripts/
RUN PYTHON=/opt/agent/bin/python bash native/build.sh \
    && /opt/agent/bin/python scripts/build_agent_wheel.py --out /wheels
COPY requirements.txt requirements-torrent.txt ./
RUN /opt/agent/bin/pip install -c requirements.txt "$(ls /wheels/*.whl)[llamacpp,torrent]"

FROM python:3.11-slim-bookworm
RUN apt-get update \
    && apt-get install -y --no-install-recommends libgomp1 curl \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build /opt/agent /opt/agent
COPY docker/agent-entrypoint.sh /usr/local/bin/agent-entrypoint
RUN useradd --system --uid 10001 --home-dir /data --shell /usr/sbin/nologin swarm \
    && mkdir -p /data /config && chown swarm:swarm /data /config && chmod 0700 /config
USER swarm
ENV PATH=/opt/agent/bin:$PATH PYTHONUNBUFFERED=1 GGUF_SWARM_CONFIG=/config/node.json GGUF_SWARM_DATA=/data
VOLUME ["/data", "/config"]
EXPOSE 9000 6881
HEALTHCHECK --interval=10s --timeout=5s --start-period=60s --retries=5 \
    CMD curl -fsS http://127.0.0.1:${AGENT_PORT:-9000}/v1/health || exit 1
ENTRYPOINT ["agent-entrypoint"]
CMD ["run", "--host", "0.0.0.0", "--port", "9000"]
