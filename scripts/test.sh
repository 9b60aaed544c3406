#!/usr/bin/env bash
# The test command (README, CI): start the services the tests need if they are down, lint (ruff,
# import contracts, mypy: scripts/lint.sh), check migrations, run pytest.
set -euo pipefail
cd "$(dirname "$0")/.."

if command -v redis-cli >/dev/null && ! redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1; then
  redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no
fi
if command -v pg_isready >/dev/null && ! pg_isready -h 127.0.0.1 -p 5432 -q; then
  pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -1)" main start || true
fi
export DATABASE_URL=${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/postgres}
export REDIS_URL=${REDIS_URL:-redis://127.0.0.1:6379/0}

bash scripts/lint.sh
.venv/bin/python manage.py makemigrations --check --dry-run >/dev/null
exec .venv/bin/python -m pytest -q -p no:cacheprovider --timeout=900 --durations=25 "$@"
