#!/usr/bin/env bash
# The MT5 bridge's checks, from a clean clone with only python3 (3.11+) and python3-venv:
# a virtual environment (bridges/mt5/.venv, or the path given as $1), the package installed
# into it with its test extra from PyPI, and its pytest suite against the fake MetaTrader5
# module, which includes the node's `copier-node bridge-check` against the bridge (the binary:
# $COPIER_NODE_BIN, or target/debug/copier-node). Exits non-zero on any failure.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
venv="${1:-$here/.venv}"
python="${PYTHON:-python3}"

if [ ! -x "$venv/bin/python" ]; then
    "$python" -m venv "$venv"
fi
# Installed, not editable: the tests run the package as it ships (pip reinstalls a local
# project on every run, so a re-run tests the current source). The build happens in a
# temporary copy so that the source tree stays clean.
build="$(mktemp -d)"
trap 'rm -rf "$build"' EXIT
cp -r "$here/pyproject.toml" "$here/README.md" "$here/src" "$build/"
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-input "$build[test]"
cd "$here"
"$venv/bin/python" -m pytest -q -p no:cacheprovider tests
