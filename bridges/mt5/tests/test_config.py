"""The configuration file: the example parses, and mistakes are caught before anything runs."""

import subprocess
import sys
from pathlib import Path

import pytest

from conftest import _PYTHONPATH
from copier_mt5_bridge.config import ConfigError, load, parse

EXAMPLE = Path(__file__).resolve().parent.parent / "bridge.example.toml"


def test_the_example_configuration_parses():
    config = load(EXAMPLE)
    assert (config.host, config.port) == ("0.0.0.0", 7010)
    assert config.settings.poll_ms == 250
    assert [t.logins for t in config.terminals] == [("50112",), ("50113",)]
    assert config.terminal_of("50113").path.endswith("demo-2\\terminal64.exe")
    assert config.terminals[0].server == "Broker-Demo" and config.terminals[0].portable


@pytest.mark.parametrize("data,needle", [
    ({}, "[[terminal]]"),
    ({"terminal": [{"logins": [1]}]}, "path"),
    ({"terminal": [{"path": "a"}]}, "logins"),
    ({"terminal": [{"path": "a", "logins": ["abc"]}]}, "account number"),
    ({"terminal": [{"path": "a", "logins": [1]}, {"path": "b", "logins": [1]}]}, "both"),
    ({"listen": "7010", "terminal": [{"path": "a", "logins": [1]}]}, "host:port"),
    ({"poll_ms": 0, "terminal": [{"path": "a", "logins": [1]}]}, "poll_ms"),
])
def test_mistakes_are_named(data, needle):
    with pytest.raises(ConfigError) as caught:
        parse(data)
    assert needle in str(caught.value)


def test_the_command_refuses_a_bad_file(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("listen = \n")
    env_path = ":".join(_PYTHONPATH)
    done = subprocess.run([sys.executable, "-m", "copier_mt5_bridge", "--config", str(bad)],
                          capture_output=True, text=True, env={"PYTHONPATH": env_path},
                          timeout=30)
    assert done.returncode == 2 and "not valid TOML" in done.stderr
