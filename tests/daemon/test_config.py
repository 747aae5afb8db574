"""Daemon settings: flags > FT_DAEMON_* environment > YAML file > defaults; bad input is refused by name."""

from __future__ import annotations

import os

import pytest

from flextensor.daemon.config import DaemonSettings, default_lock_dir, load_settings


def test_precedence(tmp_path):
    config = tmp_path / "ftd.yaml"
    config.write_text("socket: /tmp/from-yaml.sock\nreap_interval: 5\nmetrics_port: 9100\nlock_dirs: /a/flextensor-0\n"
                      "log_level: warning\n")
    env = {"FT_DAEMON_REAP_INTERVAL": "2.5", "FT_DAEMON_LOCK_DIRS": f"/b/flextensor-0{os.pathsep}/c/flextensor-0"}
    s = load_settings({"reap_interval": None, "metrics_port": 9200}, config_file=str(config), environ=env)
    assert s.socket == "/tmp/from-yaml.sock"  # yaml over default
    assert s.reap_interval == 2.5  # env over yaml (the flag was not given)
    assert s.metrics_port == 9200  # flag over yaml
    assert s.lock_dirs == ["/b/flextensor-0", "/c/flextensor-0"]
    assert s.log_level == "WARNING"
    s = load_settings({}, environ={"FT_DAEMON_CONFIG": str(config)})
    assert s.lock_dirs == ["/a/flextensor-0"] and s.reap_interval == 5.0
    d = load_settings({}, environ={})
    assert d.metrics_port is None and d.reap_interval == 1.0 and d.effective_lock_dirs == [default_lock_dir()]


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("sockett: /x\n", "unknown key"),
        ("reap_interval: -1\n", "reap_interval"),
        ("metrics_port: 70000\n", "metrics_port"),
        ("log_level: LOUD\n", "log_level"),
        ("- a\n- b\n", "mapping"),
        ("socket: [\n", "not valid YAML"),
        (f"socket: /{'x' * 120}\n", "107 bytes"),
    ],
)
def test_bad_config_files_are_refused(tmp_path, text, match):
    config = tmp_path / "ftd.yaml"
    config.write_text(text)
    with pytest.raises(ValueError, match=match):
        load_settings({}, config_file=str(config), environ={})


def test_bad_environment_and_missing_file(tmp_path):
    with pytest.raises(ValueError, match="FT_DAEMON_METRICS_PORT"):
        load_settings({}, environ={"FT_DAEMON_METRICS_PORT": "many"})
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_settings({}, config_file=str(tmp_path / "nope.yaml"), environ={})
    with pytest.raises(ValueError, match="max_frame_bytes"):
        DaemonSettings(max_frame_bytes=10)
