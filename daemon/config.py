"""Settings of ``ftd serve``: command-line flags > ``FT_DAEMON_*`` environment > YAML file > defaults.

YAML file (``--config FILE`` or ``$FT_DAEMON_CONFIG``), every key optional::

    socket: /run/flextensor/ftd.sock   # ipc socket path (its directory is created 0700 / 0750 with a group)
    socket_group: null                 # group allowed to connect (socket 0660, directory 0750); null: owner only
    metrics_port: null                 # Prometheus exposition port (0: any free port); null: no metrics server
    metrics_host: 127.0.0.1            # address the metrics server binds
    reap_interval: 1.0                 # seconds between journal scans (expired leases -> reclaim)
    lock_dirs: []                      # lock directories to scan; empty: this user's default lock directory
    log_level: INFO                    # DEBUG, INFO, WARNING, ERROR
    max_frame_bytes: 65536             # largest request answered (<= the protocol's MAX_FRAME_BYTES)
    keep_holds_on_exit: false          # true: SIGTERM/SIGINT leave holds to the next daemon instead of releasing
    shm_dir: null                      # the workers' directory of segments (null: $FT_SHM_DIR or /dev/shm)

Environment: ``FT_DAEMON_SOCKET``, ``FT_DAEMON_SOCKET_GROUP``, ``FT_DAEMON_METRICS_PORT``,
``FT_DAEMON_METRICS_HOST``, ``FT_DAEMON_REAP_INTERVAL``, ``FT_DAEMON_LOCK_DIRS`` (``os.pathsep``-separated),
``FT_DAEMON_LOG_LEVEL``, ``FT_DAEMON_MAX_FRAME_BYTES``, ``FT_DAEMON_KEEP_HOLDS_ON_EXIT`` (``1``/``true``/``yes``/``on``
or ``0``/``false``/``no``/``off``), ``FT_DAEMON_SHM_DIR``, ``FT_DAEMON_CONFIG``.

``shm_dir`` matters only where no journal says where a namespace's segments are (a journal records its
directory, ``flextensor.shm.segment_dir``): ``ftd cleanup --force`` and namespaces found without a journal.  ``FT_DAEMON_SOCKET`` is also what
workers read, so one variable points both sides at the same socket.

Unknown YAML keys and malformed values raise ``ValueError`` naming the key and where it came from: a typo in
a daemon's configuration must stop it at start, not silently run with a default.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from flextensor.shm.ftd_client import default_socket_path
from flextensor.shm.text_settings import parse_bool, yaml_mapping
from flextensor.shm.ftd_protocol import MAX_FRAME_BYTES

__all__ = ["DaemonSettings", "load_settings", "default_lock_dir", "ENV_PREFIX"]

ENV_PREFIX = "FT_DAEMON_"
_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def default_lock_dir() -> str:
    """This user's lock directory, as ``flextensor.shm.names.lock_directory()`` names it (not created)."""
    return str(Path(tempfile.gettempdir()) / f"flextensor-{os.getuid()}")


@dataclasses.dataclass
class DaemonSettings:
    socket: str = dataclasses.field(default_factory=default_socket_path)
    socket_group: str | None = None
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    reap_interval: float = 1.0
    lock_dirs: list[str] = dataclasses.field(default_factory=list)
    log_level: str = "INFO"
    max_frame_bytes: int = MAX_FRAME_BYTES
    keep_holds_on_exit: bool = False
    shm_dir: str | None = None

    def __post_init__(self) -> None:
        self.validate("settings")

    def validate(self, source: str) -> None:
        """``ValueError`` naming the field and ``source`` for any bad value; normalizes a few fields."""
        if not isinstance(self.socket, str) or not self.socket or "\x00" in self.socket:
            raise ValueError(f"{source}: socket must be a non-empty path, got {self.socket!r}")
        if len(os.fsencode(self.socket)) > 107:
            raise ValueError(f"{source}: socket path {self.socket!r} is longer than the 107 bytes an AF_UNIX "
                             "address can hold; choose a shorter path")
        if self.metrics_port is not None and (
            isinstance(self.metrics_port, bool) or not isinstance(self.metrics_port, int)
            or not 0 <= self.metrics_port <= 65535
        ):
            raise ValueError(f"{source}: metrics_port must be an int in 0..65535 or null, got {self.metrics_port!r}")
        if (isinstance(self.reap_interval, bool) or not isinstance(self.reap_interval, (int, float))
                or not 0.01 <= self.reap_interval <= 3600):
            raise ValueError(f"{source}: reap_interval must be seconds in [0.01, 3600], got {self.reap_interval!r}")
        self.reap_interval = float(self.reap_interval)
        if not isinstance(self.lock_dirs, list) or not all(isinstance(d, str) and d for d in self.lock_dirs):
            raise ValueError(f"{source}: lock_dirs must be a list of directory paths, got {self.lock_dirs!r}")
        if not isinstance(self.log_level, str) or self.log_level.upper() not in _LOG_LEVELS:
            raise ValueError(f"{source}: log_level must be one of {', '.join(_LOG_LEVELS)}, got {self.log_level!r}")
        self.log_level = self.log_level.upper()
        if (isinstance(self.max_frame_bytes, bool) or not isinstance(self.max_frame_bytes, int)
                or not 1024 <= self.max_frame_bytes <= MAX_FRAME_BYTES):
            raise ValueError(f"{source}: max_frame_bytes must be an int in [1024, {MAX_FRAME_BYTES}], got "
                             f"{self.max_frame_bytes!r}")
        if self.socket_group is not None and (not isinstance(self.socket_group, (str, int)) or self.socket_group == ""):
            raise ValueError(f"{source}: socket_group must be a group name or gid, got {self.socket_group!r}")
        if self.shm_dir is not None:
            from flextensor.shm.segment_dir import check_directory

            self.shm_dir = check_directory(self.shm_dir, f"{source}: shm_dir")
        if not isinstance(self.keep_holds_on_exit, bool):
            raise ValueError(f"{source}: keep_holds_on_exit must be true or false, got {self.keep_holds_on_exit!r}")

    @property
    def effective_lock_dirs(self) -> list[str]:
        """``lock_dirs`` or, when empty, this user's default lock directory."""
        return list(self.lock_dirs) or [default_lock_dir()]

    @property
    def log_level_number(self) -> int:
        return logging.getLevelName(self.log_level)


_FIELDS = {f.name for f in dataclasses.fields(DaemonSettings)}


def _from_text(name: str, text: str, source: str) -> Any:
    """Convert an environment / flag string to the field's type."""
    try:
        if name in ("metrics_port", "max_frame_bytes"):
            return None if text.lower() in ("", "none", "null", "off") and name == "metrics_port" else int(text)
        if name == "reap_interval":
            return float(text)
        if name == "lock_dirs":
            return [part for part in text.split(os.pathsep) if part]
        if name in ("socket_group", "shm_dir"):
            return text or None
        if name == "keep_holds_on_exit":
            return parse_bool(text)
    except ValueError:
        raise ValueError(f"{source}: {text!r} is not a valid value for {name}") from None
    return text


def _read_yaml(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise FileNotFoundError(f"ftd config file {path} does not exist; fix --config / FT_DAEMON_CONFIG") from None
    data = yaml_mapping(text, f"ftd config file {path}")
    unknown = sorted(set(data) - _FIELDS)
    if unknown:
        raise ValueError(f"ftd config file {path}: unknown key(s) {', '.join(map(str, unknown))}; known keys are "
                         f"{', '.join(sorted(_FIELDS))}")
    values = dict(data)
    if isinstance(values.get("lock_dirs"), str):
        values["lock_dirs"] = [values["lock_dirs"]]
    return values


def load_settings(
    flags: Mapping[str, Any] | None = None,
    *,
    config_file: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> DaemonSettings:
    """Merge defaults < YAML (``config_file`` or ``$FT_DAEMON_CONFIG``) < environment < ``flags``.

    ``flags`` maps field names to values given on the command line; ``None`` values mean "not given".
    """
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    config_file = config_file or environ.get(ENV_PREFIX + "CONFIG") or None
    if config_file:
        values.update(_read_yaml(config_file))
        DaemonSettings(**values).validate(f"config file {config_file}")
    for name in _FIELDS:
        text = environ.get(ENV_PREFIX + name.upper())
        if text is not None and text != "":
            values[name] = _from_text(name, text, f"environment {ENV_PREFIX}{name.upper()}")
    for name, value in (flags or {}).items():
        if name not in _FIELDS:
            raise ValueError(f"unknown daemon setting {name!r}")
        if value is not None:
            values[name] = value
    return DaemonSettings(**values)
