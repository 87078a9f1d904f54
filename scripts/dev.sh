#!/usr/bin/env bash
# One entry point for a fresh machine with only Python 3.11:
#   bash scripts/dev.sh main    -> environment + the main job (tbp fit -c configs/ddpm_unet_tiny.yaml:
#                                  CPU DDPM run with the plan and memory reports, samples, export)
#   bash scripts/dev.sh test    -> environment + lint + type check + the whole test suite
#   bash scripts/dev.sh verify  -> environment + lint + tests + small-profile benchmarks checked against
#                                  benchmarks/verify.yaml; summary in outputs/verify/summary.json
#   bash scripts/dev.sh env     -> only create/refresh the environment (.venv)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null || PYTHON=python3
VENV=${VENV:-.venv}

ensure_env() {
  if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
  fi
  local stamp="$VENV/.installed" want
  want=$(cat pyproject.toml requirements-ci.txt | sha256sum | cut -d' ' -f1)
  if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    "$VENV/bin/python" -m pip install -q --upgrade pip
    # torch first, pinned: the CPU build of the tested version
    "$VENV/bin/python" -m pip install -q "$(grep '^torch==' requirements-ci.txt)"
    "$VENV/bin/python" -m pip install -q -c requirements-ci.txt -e ".[dev,lowbit]"
    echo "$want" > "$stamp"
  fi
}

cmd=${1:-}
shift || true
case "$cmd" in
  env)
    ensure_env ;;
  main)
    ensure_env
    "$VENV/bin/tbp" fit -c configs/ddpm_unet_tiny.yaml "$@" ;;
  test)
    ensure_env
    "$VENV/bin/ruff" check .
    "$VENV/bin/mypy"
    # one worker per core, each on one thread (tests/conftest.py); TEST_WORKERS=0 runs in this process
    "$VENV/bin/python" -m pytest -n "${TEST_WORKERS:-auto}" --dist worksteal "$@" ;;
  verify)
    ensure_env
    "$VENV/bin/python" benchmarks/verify.py "$@" ;;
  *)
    echo "usage: bash scripts/dev.sh {main|test|verify|env} [args...]" >&2
    exit 2 ;;
esac
