#!/usr/bin/env bash
# Static checks (`make lint`; scripts/test.sh runs them before pytest, so CI does too): ruff lint and
# format, the import contracts in .importlinter, a reason on every `type: ignore`, then mypy
# (configured in pyproject.toml: strict on agent/, django-stubs on webapp/).
set -euo pipefail
cd "$(dirname "$0")/.."

.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/lint-imports --no-cache
# mypy (ignore-without-code) makes every ignore name its error code; the reason is ours to require.
bare=$(grep -rnE --include='*.py' '# type: ignore(\[[^]]*\])?[[:space:]]*$' agent webapp || true)
if [ -n "$bare" ]; then
  printf '%s\n' "$bare" >&2
  echo "lint: give each ignore above a reason: '# type: ignore[code]  # why'" >&2
  exit 1
fi
.venv/bin/mypy
