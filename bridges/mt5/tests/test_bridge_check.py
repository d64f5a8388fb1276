"""The node's conformance kit (`copier-node bridge-check`, the same command an operator runs
against any bridge) against this bridge over a fake terminal: every check passes, pending orders
included. The kit is the node's binary: `COPIER_NODE_BIN`, or the repository's debug build."""

import json
import os
import subprocess
from pathlib import Path

import pytest

from conftest import LOGIN, PASSWORD

REPOSITORY = Path(__file__).resolve().parents[3]


def copier_node() -> str:
    path = os.environ.get("COPIER_NODE_BIN") or str(REPOSITORY / "target" / "debug" / "copier-node")
    if not Path(path).is_file():
        pytest.fail(f"bridge-check is the node's command: build it (cargo build) or set "
                    f"COPIER_NODE_BIN (not found: {path})")
    return path


def test_the_bridge_passes_every_check_of_bridge_check(bridge):
    host, port = bridge.address
    out = subprocess.run(
        [copier_node(), "bridge-check", "--server", f"{host}:{port}", "--login", LOGIN,
         "--password-stdin", "--symbol", "EURUSD", "--json"],
        input=PASSWORD + "\n", capture_output=True, text=True, timeout=300)
    assert out.stdout, out.stderr
    report = json.loads(out.stdout)
    not_passed = [c for c in report["checks"] if c["result"] != "passed"]
    assert not not_passed, json.dumps(not_passed, indent=2)
    assert report["passed"] is True and out.returncode == 0, out.stderr
    # The password went in on standard input and never came back out.
    assert PASSWORD not in out.stdout + out.stderr
