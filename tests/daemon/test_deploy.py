"""``deploy/``: every manifest parses, every ``ftd ...`` command it runs is accepted by the CLI parser, and the
pieces agree with each other (socket path, host IPC, /dev/shm, shared TMPDIR)."""

from __future__ import annotations

import configparser
import shlex
from pathlib import Path

import pytest
import yaml

from flextensor.daemon.cli import build_parser
from flextensor.daemon.config import load_settings

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
YAML_FILES = sorted(p for p in DEPLOY.rglob("*") if p.suffix in (".yaml", ".yml"))


def _documents(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def _walk_commands(node, out: list[list[str]]) -> None:
    """Collect argv lists under keys that hold commands (k8s command/args/exec, compose command/healthcheck)."""
    if isinstance(node, dict):
        command = node.get("command")
        if isinstance(command, list) and all(isinstance(c, str) for c in command):
            args = node.get("args") if isinstance(node.get("args"), list) else []
            out.append([*command, *args])
        elif isinstance(command, str):
            out.append(shlex.split(command))
        test = node.get("test")
        if isinstance(test, list) and test and test[0] in ("CMD", "CMD-SHELL"):
            out.append(test[1:] if test[0] == "CMD" else shlex.split(test[1]))
        for value in node.values():
            _walk_commands(value, out)
    elif isinstance(node, list):
        for value in node:
            _walk_commands(value, out)


def _unit(path: Path) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=False, interpolation=None, delimiters=("=",))
    parser.optionxform = str  # systemd keys are case-sensitive
    parser.read_string(path.read_text())
    return parser


def _all_commands() -> list[tuple[str, list[str]]]:
    found: list[tuple[str, list[str]]] = []
    for path in YAML_FILES:
        commands: list[list[str]] = []
        for doc in _documents(path):
            _walk_commands(doc, commands)
        found += [(path.name, c) for c in commands]
    for path in DEPLOY.rglob("*.service"):
        unit = _unit(path)
        for key in ("ExecStart", "ExecStartPre", "ExecStartPost", "ExecReload", "ExecStop"):
            if unit.has_option("Service", key):
                found.append((path.name, shlex.split(unit.get("Service", key).lstrip("-+!@:"))))
    return found


def test_manifests_exist_and_parse():
    names = {p.name for p in DEPLOY.rglob("*") if p.is_file()}
    assert {"ftd.service", "ftd-tmpfiles.conf", "ftd-daemonset.yaml", "worker-pod.yaml", "docker-compose.yaml",
            "ftd.yaml"} <= names
    for path in YAML_FILES:
        assert _documents(path), path
    unit = _unit(DEPLOY / "systemd" / "ftd.service")
    assert unit.get("Service", "Restart") == "on-failure"
    assert unit.get("Service", "PrivateTmp") == "no"  # must see the workers' lock directories
    assert "/dev/shm" in unit.get("Service", "ReadWritePaths").split()
    entries = {}
    for line in (DEPLOY / "systemd" / "ftd-tmpfiles.conf").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            kind, path, mode, user, group, age = line.split()
            assert kind == "d" and age == "-", line
            entries[path] = (int(mode, 8), user, group)
    # The socket directory: root plus the socket group (ftd.yaml's socket_group), nothing for others, so only
    # that group can reach the socket; the shared TMPDIR is /tmp-like (world-writable only with the sticky bit,
    # so no user can remove another user's flextensor-<uid> lock directory); its parent is read-only to others.
    settings = load_settings({}, config_file=str(DEPLOY / "ftd.yaml"), environ={})
    assert entries == {
        "/run/flextensor": (0o750, "root", str(settings.socket_group)),
        "/var/lib/flextensor": (0o755, "root", "root"),
        "/var/lib/flextensor/tmp": (0o1777, "root", "root"),
    }
    assert str(Path(settings.socket).parent) == "/run/flextensor"
    for path, (mode, _user, _group) in entries.items():
        world_writable = bool(mode & 0o002)
        assert not world_writable or mode & 0o1000, f"{path} is world-writable without the sticky bit"
    assert entries["/run/flextensor"][0] & 0o007 == 0  # not world-readable, -writable or -searchable
    assert entries["/var/lib/flextensor"][0] & 0o022 == 0  # not group- or world-writable


@pytest.mark.parametrize(("source", "argv"), _all_commands(), ids=lambda v: v if isinstance(v, str) else " ".join(v))
def test_every_ftd_command_exists_in_the_cli(source, argv):
    if Path(argv[0]).name != "ftd":
        return  # other programs (the worker's own server, busybox) are not ours to check
    args = build_parser().parse_args(argv[1:])  # SystemExit(2) on an unknown command or option
    assert args.command in ("serve", "status", "ls", "cleanup", "drain", "hold", "release")


def test_ftd_commands_are_found_and_configs_load(tmp_path):
    ftd = [argv for _, argv in _all_commands() if Path(argv[0]).name == "ftd"]
    assert any(a[1] == "serve" for a in ftd) and any(a[1] == "status" for a in ftd)
    load_settings({}, config_file=str(DEPLOY / "ftd.yaml"), environ={})
    (configmap,) = [d for d in _documents(DEPLOY / "kubernetes" / "ftd-daemonset.yaml") if d["kind"] == "ConfigMap"]
    embedded = tmp_path / "ftd.yaml"
    embedded.write_text(configmap["data"]["ftd.yaml"])
    settings = load_settings({}, config_file=str(embedded), environ={})
    assert settings.socket == "/run/flextensor/ftd.sock"


def test_daemonset_and_worker_share_ipc_shm_socket_and_tmpdir():
    docs = _documents(DEPLOY / "kubernetes" / "ftd-daemonset.yaml")
    (ds,) = [d for d in docs if d["kind"] == "DaemonSet"]
    spec = ds["spec"]["template"]["spec"]
    assert spec["hostIPC"] is True and spec["hostPID"] is True
    (container,) = spec["containers"]
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert {"/dev/shm", "/run/flextensor", "/var/lib/flextensor/tmp"} <= mounts
    assert container["livenessProbe"]["exec"]["command"][:2] == ["ftd", "status"]
    assert "limits" in container["resources"] and "requests" in container["resources"]
    (pod,) = _documents(DEPLOY / "kubernetes" / "worker-pod.yaml")
    assert pod["spec"]["hostIPC"] is True
    env = {e["name"]: e["value"] for e in pod["spec"]["containers"][0]["env"]}
    assert env["FT_DAEMON_SOCKET"] == "/run/flextensor/ftd.sock" and env["TMPDIR"] == "/var/lib/flextensor/tmp"
    assert 2000 in pod["spec"]["securityContext"]["supplementalGroups"]
    (compose,) = _documents(DEPLOY / "compose" / "docker-compose.yaml")
    assert compose["services"]["ftd"]["ipc"] == "host" and compose["services"]["worker"]["ipc"] == "host"
    assert compose["services"]["worker"]["environment"]["FT_DAEMON_SOCKET"] == "/run/flextensor/ftd.sock"


def test_hosts_without_the_daemon_sweep_dead_namespaces_as_the_workers_user():
    """The systemd timer and the Kubernetes CronJob run `ftd cleanup --dead` where the workers' files are: the
    host's /dev/shm and their TMPDIR, as their user, never two at once."""
    timer = _unit(DEPLOY / "systemd" / "ftd-cleanup-dead@.timer")
    assert timer.get("Timer", "Unit") == "ftd-cleanup-dead@%i.service"
    assert timer.get("Install", "WantedBy") == "timers.target"
    service = _unit(DEPLOY / "systemd" / "ftd-cleanup-dead@.service")
    assert shlex.split(service.get("Service", "ExecStart"))[1:] == ["cleanup", "--dead"]
    assert service.get("Service", "Type") == "oneshot" and service.get("Service", "User") == "%i"
    assert service.get("Service", "PrivateTmp") == "no"
    assert "/dev/shm" in service.get("Service", "ReadWritePaths").split()
    env = dict(e.split("=", 1) for e in service.get("Service", "Environment").split())
    assert env["TMPDIR"].lstrip("-") in [p.lstrip("-") for p in service.get("Service", "ReadWritePaths").split()]

    (cronjob,) = _documents(DEPLOY / "kubernetes" / "ftd-cleanup-dead-cronjob.yaml")
    assert cronjob["kind"] == "CronJob" and cronjob["spec"]["concurrencyPolicy"] == "Forbid"
    spec = cronjob["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    assert container["command"] == ["ftd", "cleanup", "--dead"]
    (worker,) = _documents(DEPLOY / "kubernetes" / "worker-pod.yaml")
    wspec = worker["spec"]
    assert spec["hostIPC"] is True and wspec["hostIPC"] is True
    assert spec["securityContext"]["runAsUser"] == wspec["securityContext"]["runAsUser"]  # the workers' user
    cron_env = {e["name"]: e["value"] for e in container["env"]}
    worker_env = {e["name"]: e["value"] for e in wspec["containers"][0]["env"]}
    assert cron_env["TMPDIR"] == worker_env["TMPDIR"]
    volumes = {v["name"]: v["hostPath"]["path"] for v in spec["volumes"]}
    mounts = {m["mountPath"]: volumes[m["name"]] for m in container["volumeMounts"]}
    assert mounts["/dev/shm"] == "/dev/shm" and mounts[cron_env["TMPDIR"]] == cron_env["TMPDIR"]
