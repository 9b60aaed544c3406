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

# Lint (ruff, import contracts, mypy) and the migrations check run beside the tests: mostly one core
# while pytest's workers start and collect (~25 s of a CI run). Either failing fails the run; `make
# lint` alone answers in ~40 s.
lint_log="$(mktemp)"
{ bash scripts/lint.sh && .venv/bin/python manage.py makemigrations --check --dry-run >/dev/null; } >"$lint_log" 2>&1 &
lint_pid=$!
# Three pytest-xdist workers on two cores: most of the suite waits on processes it started (clusters,
# hops, browsers), so a third worker fills the idle core time; a test file stays on one worker (its
# module fixtures start one cluster). Each worker has its own Redis database (tests/conftest.py) and
# each cluster its own PostgreSQL database; a test that restarts a server starts one of its own
# (test_failover_restarts.py), so every test can run beside the others.
# PYTEST_WORKERS=0 runs everything in one process.
workers=${PYTEST_WORKERS:-3}
# The slowest test takes ~140 s on a loaded 2-core CI machine; a hung one fails after 420 s, not 900.
common=(-q -p no:cacheprovider --timeout=420 --durations=25)
parallel=()
[ "$workers" != 0 ] && parallel=(-n "$workers" --dist loadfile)
rc=0
.venv/bin/python -m pytest "${common[@]}" "${parallel[@]}" "$@" || rc=$?
lint_rc=0
wait "$lint_pid" || lint_rc=$?
cat "$lint_log"
rm -f "$lint_log"
if [ "$lint_rc" != 0 ]; then
  echo "scripts/test.sh: lint or the migrations check failed (above)" >&2
  exit "$lint_rc"
fi
exit "$rc"
