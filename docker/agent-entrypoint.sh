#!/bin/sh
# Agent container entrypoint: enroll once (GGUF_SWARM_SERVER + GGUF_SWARM_ENROLL_TOKEN, a one-time
# token from the fleet page) when no node config exists yet, then exec `python -m agent "$@"`.
# The config (a secret, 0600) lives on the /config volume, so a restarted container does not enroll
# again. docs/agent-install.md ("docker compose").
set -eu
config="${GGUF_SWARM_CONFIG:?GGUF_SWARM_CONFIG must name the node config file}"
if [ ! -f "$config" ]; then
    if [ -z "${GGUF_SWARM_ENROLL_TOKEN:-}" ] || [ -z "${GGUF_SWARM_SERVER:-}" ]; then
        echo "agent-entrypoint: $config does not exist: set GGUF_SWARM_SERVER and GGUF_SWARM_ENROLL_TOKEN" \
             "(create a token on the fleet page) to enroll this node" >&2
        exit 2
    fi
    python -m agent enroll --server "$GGUF_SWARM_SERVER" --token "$GGUF_SWARM_ENROLL_TOKEN" \
        --name "${GGUF_SWARM_NODE_NAME:-$(hostname)}" --config "$config"
fi
exec python -m agent "$@"
