"""``ftd``: the daemon's command line (console script ``ftd = flextensor.daemon.cli:main``).

Commands (each takes ``--socket PATH`` and ``--json``; ``ftd --version`` prints the version)::

    ftd serve   [--config FILE] [--metrics-port N] [--metrics-host ADDR] [--reap-interval S] [--lock-dir DIR ...]
                [--socket-group G] [--log-level LEVEL] [--keep-holds]
    ftd status                       daemon up?  version, uptime, counts       (exit 1 when no daemon answers)
    ftd ls                           one row per generation
    ftd cleanup NS [--manager NAME ...] [--timeout S] [--local] [--lock-dir DIR] [--force]
    ftd cleanup --dead [--lock-dir DIR]
    ftd drain   NS [--manager NAME ...] [--undo]
    ftd hold    NS [--manager NAME]
    ftd release NS [--manager NAME]

``NS`` is the *base* namespace given to the session (``--manager`` defaults to ``default``, the library's
default manager), or a per-manager namespace ``flextensor.shm.names.manager_namespace(NS, NAME)`` as ``ftd ls``
shows it in its ID column (then without ``--manager``).  ``cleanup`` exits 1 when the name matches nothing.
``cleanup`` goes through the daemon when one answers (it then also updates its view and metrics) and runs locally
otherwise (or with ``--local``): it needs the workers' ``TMPDIR`` (lock directory) either way.
``hold``/``release``/``drain``/``status``/``ls`` need the daemon.  A namespace kept by ``ftd hold`` is refused at
once by ``cleanup`` (the message names the hold and ``ftd release``), whatever ``--timeout`` says.

``cleanup --dead`` takes no name: it reclaims every namespace of the calling user, journaled in the lock directory,
whose participants are all gone (``flextensor.shm.dead_sweep``), always locally (no daemon needed: it is what a
systemd timer or a Kubernetes CronJob runs on hosts without ``ftd``, ``deploy/``).  Live, held and other users'
namespaces are never touched; it exits 1 when it could not sweep the lock directory completely (unreadable, not
this user's, corrupt metadata), 0 otherwise, even with nothing to do.  A dead namespace of this user journaled in
another lock directory (its workers had another ``TMPDIR``) is named on stderr, with the ``--lock-dir`` to use.
``--json`` prints ``{"lock_dir", "reclaimed": [...], "skipped": [...], "elapsed_s"}``.

Exit status: 0 success, 1 error (message on stderr; with ``--json`` also ``{"error", "message"}`` on stdout),
2 usage error.  ``ls --json`` prints a list of objects with exactly the keys of ``GenerationRow``
(``flextensor.shm.ftd_protocol``): ``namespace``, ``manager``, ``generation``, ``state``, ``participants``,
``bytes``, ``age`` and the others listed in docs/daemon.md, ``members`` among them: each live participant's
pid, slot, state (serving, sleeping, updating, held) and weights version.
"""

from __future__ import annotations

import argparse
import json
import re
import logging
import sys
import time
from typing import Any

import msgspec

from flextensor.shm import ftd_protocol as proto
from flextensor.shm.ftd_client import DaemonUnavailableError, daemon_available, daemon_socket_path, request

__all__ = ["main", "build_parser", "COMMANDS"]

COMMANDS = ("serve", "status", "ls", "cleanup", "drain", "hold", "release")
#: The library's default manager name (``SharedOffloadSession.load(..., name="default")``).
DEFAULT_MANAGER = "default"
_PER_MANAGER_RE = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,7}[A-Za-z0-9_-]{0,12}-[0-9a-f]{16}")
_REQUEST_TIMEOUT_S = 10.0


class CommandError(Exception):
    """An error reported with exit status 1 (``code`` is the daemon's error code, if any)."""

    def __init__(self, message: str, code: str = "error") -> None:
        super().__init__(message)
        self.code = code


# ------------------------------------------------------------------------------------------------ parsing


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    from flextensor.shm.ftd_client import default_socket_path

    common.add_argument("--socket", metavar="PATH", default=None,
                        help="daemon socket (default: $FT_DAEMON_SOCKET, else %s)" % default_socket_path())
    common.add_argument("--json", action="store_true", help="machine-readable output")
    parser = argparse.ArgumentParser(prog="ftd", description="flextensor per-host namespace daemon and its control "
                                     "commands")
    from flextensor.shm._version import __version__

    parser.add_argument("--version", action="version", version=f"ftd (flextensor) {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    serve = sub.add_parser("serve", parents=[common], help="run the daemon in the foreground (logs to stderr)")
    serve.add_argument("--config", metavar="FILE", help="YAML settings file (also $FT_DAEMON_CONFIG)")
    serve.add_argument("--metrics-port", type=int, metavar="N", help="Prometheus port (0: any free port)")
    serve.add_argument("--metrics-host", metavar="ADDR", help="address of the metrics server (default 127.0.0.1)")
    serve.add_argument("--reap-interval", type=float, metavar="S", help="seconds between journal scans (default 1)")
    serve.add_argument("--lock-dir", action="append", metavar="DIR",
                       help="lock directory to watch (repeatable; default: this user's $TMPDIR/flextensor-<uid>)")
    serve.add_argument("--socket-group", metavar="GROUP", help="group allowed to connect (socket 0660)")
    serve.add_argument("--log-level", metavar="LEVEL", help="DEBUG, INFO, WARNING, ERROR (default INFO)")
    serve.add_argument("--keep-holds", action="store_true", default=None,
                       help="on SIGTERM/SIGINT keep holds for the next daemon on this socket instead of releasing "
                            "them (setting keep_holds_on_exit; a killed daemon always leaves them to the next one)")

    sub.add_parser("status", parents=[common], help="is the daemon up; version, uptime, counts")
    sub.add_parser("ls", parents=[common], help="one row per generation")

    def namespaced(name: str, help_text: str, manager_default: bool, multiple: bool,
                   optional: bool = False) -> argparse.ArgumentParser:
        p = sub.add_parser(name, parents=[common], help=help_text)
        p.add_argument("namespace", metavar="NAMESPACE", nargs="?" if optional else None,
                       help="base namespace (as given to the session), or a per-manager namespace as `ftd ls` shows "
                            "it in its ID column (then without --manager)")
        default = f" (default: {DEFAULT_MANAGER})" if manager_default else " (default: every known manager)"
        p.add_argument("--manager", action="append" if multiple else "store", default=None,
                       metavar="NAME", help="manager name" + (" (repeatable)" if multiple else "") + default)
        return p

    cleanup = namespaced("cleanup", "reclaim a namespace's managers after their workers are gone", True, True,
                         optional=True)
    cleanup.add_argument("--dead", action="store_true",
                         help="no NAMESPACE: reclaim every namespace of this user in the lock directory whose "
                              "participants are all gone (killed on this host, or leases expired); live, held and "
                              "other users' namespaces are never touched. Runs locally, needs no daemon")
    cleanup.add_argument("--timeout", type=float, default=0.0, metavar="S",
                         help="wait up to S seconds in all for leases to expire (default 0: check once)")
    cleanup.add_argument("--local", action="store_true", help="do not go through the daemon")
    cleanup.add_argument("--force", action="store_true",
                         help="every worker is stopped and the namespace's metadata is corrupt or lost: remove "
                              "everything derivable from its name, without reading header, journal or leases (runs "
                              "locally, as the namespace's owner)")
    cleanup.add_argument("--lock-dir", metavar="DIR", help="the workers' lock directory (default: from $TMPDIR)")
    drain = namespaced("drain", "refuse new registrations; reclaim when the last participant leaves", False, True)
    drain.add_argument("--undo", action="store_true", help="stop draining")
    drain.add_argument("--lock-dir", metavar="DIR", help=argparse.SUPPRESS)
    hold = namespaced("hold", "keep a READY generation alive across worker restarts", True, False)
    hold.add_argument("--lock-dir", metavar="DIR", help="the workers' lock directory (default: from $TMPDIR)")
    namespaced("release", "drop a hold (reclaims the generation if nobody else is in it)", True, False)
    return parser


# ------------------------------------------------------------------------------------------------ helpers


def _lock_dir(args: argparse.Namespace) -> str:
    """``--lock-dir``, else this user's lock directory from ``$TMPDIR`` as the workers derive it (not created)."""
    from flextensor.shm.names import lock_directory_path

    return getattr(args, "lock_dir", None) or str(lock_directory_path())


def _ask(args: argparse.Namespace, message: msgspec.Struct, timeout: float = _REQUEST_TIMEOUT_S):
    try:
        reply = request(message, timeout, path=args.socket)
    except DaemonUnavailableError as exc:
        raise CommandError(str(exc), "unavailable") from None
    except ValueError as exc:
        raise CommandError(f"malformed reply from the daemon: {exc}", "protocol") from None
    if isinstance(reply, proto.ErrorReply):
        raise CommandError(reply.message, reply.code)
    return reply


def _print_json(value: Any) -> None:
    print(json.dumps(value, indent=2, sort_keys=False))


def _is_per_manager(name: str, lock_dir: str | None) -> bool:
    """NAMESPACE names an existing per-manager namespace (``ftd ls``'s ID column): it has the shape of one and
    its coordinator segment or journal exists.  (A base namespace made by ``compute_shm_namespace`` has the same
    shape, so the shape alone does not decide.)"""
    if not _PER_MANAGER_RE.fullmatch(name):
        return False
    import os

    from flextensor.shm.segment_dir import segment_path

    if os.path.exists(segment_path(f"/{name}.c")):
        return True
    return lock_dir is not None and os.path.exists(os.path.join(lock_dir, f"{name}.journal"))


def _namespaces(parser: argparse.ArgumentParser, base: str, managers: list[str] | None,
                lock_dir: str | None = None) -> list[str]:
    """Per-manager namespaces from NAMESPACE and --manager: an existing per-manager namespace given without
    --manager (as `ftd ls` shows it) is used as it is; otherwise NAMESPACE is the base and --manager defaults
    to ``default``."""
    from flextensor.shm.names import manager_namespace, validate_namespace

    if managers is None and _is_per_manager(base, lock_dir):
        try:
            return [validate_namespace(base)]
        except ValueError as exc:
            parser.error(str(exc))
    try:
        return [manager_namespace(base, m) for m in (managers or [DEFAULT_MANAGER])]
    except ValueError as exc:
        parser.error(str(exc))
        raise  # pragma: no cover


def _labels(args: argparse.Namespace, namespaces: list[str]) -> tuple[str | None, list[str]]:
    """(base, managers) to send along, when NAMESPACE was a base namespace."""
    from flextensor.shm.names import manager_namespace

    managers = args.manager if isinstance(args.manager, list) else [args.manager or DEFAULT_MANAGER]
    try:
        if [manager_namespace(args.namespace, m) for m in managers] == namespaces:
            return args.namespace, managers
    except ValueError:
        pass
    return None, []


# ------------------------------------------------------------------------------------------------ commands


def _cmd_serve(args: argparse.Namespace) -> int:
    from flextensor.daemon.config import load_settings
    from flextensor.daemon.server import StartupError, run

    flags = {
        "socket": args.socket,
        "metrics_port": args.metrics_port,
        "metrics_host": args.metrics_host,
        "reap_interval": args.reap_interval,
        "lock_dirs": args.lock_dir,
        "socket_group": args.socket_group,
        "log_level": args.log_level,
        "keep_holds_on_exit": args.keep_holds,
    }
    try:
        settings = load_settings(flags, config_file=args.config)
    except (ValueError, FileNotFoundError) as exc:
        raise CommandError(str(exc), "config") from None
    logging.basicConfig(stream=sys.stderr, level=settings.log_level_number,
                        format="%(asctime)s ftd[%(process)d] %(levelname)s %(name)s: %(message)s")
    if settings.shm_dir is not None:
        from flextensor.shm.segment_dir import set_default_directory

        set_default_directory(settings.shm_dir)
    try:
        return run(settings)
    except StartupError as exc:
        raise CommandError(str(exc), "startup") from None


def _cmd_status(args: argparse.Namespace) -> int:
    path = args.socket or daemon_socket_path()
    try:
        reply = _ask(args, proto.StatusRequest(), timeout=5.0)
    except CommandError as exc:
        if args.json:
            _print_json({"up": False, "socket": path, "error": exc.code, "message": str(exc)})
            print(f"ftd: {exc}", file=sys.stderr)
            return 1
        raise
    data = {"up": True, **msgspec.structs.asdict(reply)}
    data.pop("v", None)
    if args.json:
        _print_json(data)
    else:
        print(f"ftd {reply.version} up {reply.uptime_s:.0f} s (pid {reply.pid}, protocol {reply.protocol}) on "
              f"{reply.socket}")
        print(f"namespaces {reply.namespaces}, generations {reply.generations}, live participants "
              f"{reply.participants}, watched processes {reply.registered}")
        print(f"held: {', '.join(reply.held) or '-'}; draining: {', '.join(reply.draining) or '-'}")
        print(f"lock dirs: {', '.join(reply.lock_dirs) or '-'}; metrics port: {reply.metrics_port or '-'}")
    return 0


def _cmd_ls(args: argparse.Namespace) -> int:
    reply = _ask(args, proto.ListRequest())
    rows = msgspec.to_builtins(reply.rows)  # nested rows (members) too
    if args.json:
        _print_json(rows)
        return 0
    from flextensor.shm.sizes import format_bytes
    from flextensor.shm.text_table import format_columns

    print("\n".join(format_columns(
        ["NAMESPACE", "MANAGER", "ID", "GENERATION", "STATE", "PARTICIPANTS", "SLEEPING", "WEIGHTS", "BYTES", "PAGES",
         "SHM_DIR", "AGE"],
        [[r["base"] or "?", r["manager"] or "?", r["namespace"], str(r["generation"] or "-"), r["state"],
          str(r["participants"]), str(r["sleeping"]), f"v{r['weights_version']}", format_bytes(r["bytes"]),
          format_bytes(r["page_size"], digits=0), r["shm_dir"], f"{r['age']:.0f}s"] for r in rows],
    )))
    return 0


def _cmd_cleanup(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if args.dead:
        if args.namespace is not None or args.manager or args.force or args.timeout:
            parser.error("cleanup --dead finds the dead namespaces itself: it takes no NAMESPACE, --manager, --force "
                         "or --timeout (only --lock-dir, --json)")
        return _cmd_cleanup_dead(args)
    if args.namespace is None:
        parser.error("cleanup needs a NAMESPACE (the base namespace, or an ID from `ftd ls`), or --dead for every "
                     "dead namespace of this user")
    if not (args.timeout >= 0):
        parser.error(f"--timeout must be >= 0 seconds, got {args.timeout}")
    lock_dir = _lock_dir(args)
    namespaces = _namespaces(parser, args.namespace, args.manager, lock_dir)
    base, managers = _labels(args, namespaces)
    for ns in namespaces:  # a hold lasts until `ftd release`: say so now, whatever --timeout says
        _refuse_if_held(ns, lock_dir)
    if args.force:
        reports = _local_cleanup(namespaces, args.timeout, lock_dir, force=True)
        where = "local, forced"
    elif not args.local and daemon_available(args.socket):
        message = proto.CleanupRequest(namespaces=namespaces, lock_dir=lock_dir, timeout=args.timeout,
                                       base=base, managers=managers)
        reply = _ask(args, message, timeout=args.timeout + _REQUEST_TIMEOUT_S)
        reports = [msgspec.structs.asdict(r) for r in reply.reports]
        where = "daemon"
    else:
        reports = _local_cleanup(namespaces, args.timeout, lock_dir)
        where = "local"
    matched = any(r["generation"] is not None or r["removed"] for r in reports)
    if args.json:
        _print_json(reports)
    else:
        names = [f"{base} / {m} ({ns})" for m, ns in zip(managers, namespaces)] if base else namespaces
        for name, report in zip(names, reports):
            if report["generation"] is None and not report["removed"]:
                print(f"{name}: nothing to clean up ({where})")
            else:
                print(f"{name}: generation {report['generation']} removed, {len(report['removed'])} resources "
                      f"({len(report['already_absent'])} already absent, waited {report['waited_s']:.2f} s, "
                      f"{where})")
                if args.force:
                    for path in report["removed"]:
                        print(f"  removed {path}")
    if not matched:
        print(f"ftd cleanup: {args.namespace!r} matches nothing in {lock_dir} or the shared-memory directory (looked for "
              f"{', '.join(namespaces)}): check the name and --manager (`ftd ls` lists namespaces), and pass the "
              "workers' lock directory with --lock-dir", file=sys.stderr)
        return 1
    return 0


def _refuse_if_held(namespace: str, lock_dir: str) -> None:
    """``CommandError`` (code ``held``) when a live ``ftd hold`` keeps ``namespace`` (a lock-free look at its
    lease table; what this user cannot read is left to the cleanup itself, which checks again under the lock)."""
    from flextensor.shm.cleanup import check_not_held
    from flextensor.shm.errors import ShmNamespaceHeldError

    try:
        check_not_held(namespace, lock_dir)
    except ShmNamespaceHeldError as exc:
        raise CommandError(str(exc), "held") from None


def _cmd_cleanup_dead(args: argparse.Namespace) -> int:
    from flextensor.shm.dead_sweep import sweep_dead_namespaces
    from flextensor.shm.sizes import format_bytes
    from flextensor.shm.segment_dir import namespace_directory

    sweep = sweep_dead_namespaces(args.lock_dir, look_in_shm=True)
    if args.json:
        _print_json({
            "lock_dir": sweep.lock_dir,
            "reclaimed": [{**msgspec.structs.asdict(r.report), "base": r.base, "manager": r.manager,
                           "shm_bytes": r.shm_bytes} for r in sweep.reclaimed],
            "skipped": [msgspec.structs.asdict(s) for s in sweep.skipped],
            "elapsed_s": round(sweep.elapsed_s, 6),
        })
    else:
        for r in sweep.reclaimed:
            name = f"{r.base} / {r.manager} ({r.report.namespace})" if r.base else r.report.namespace
            print(f"{name}: generation {r.report.generation} removed, {len(r.report.removed)} resources, "
                  f"{format_bytes(r.shm_bytes)} of {namespace_directory(r.report.namespace)} (dead)")
        counts = {reason: sum(1 for s in sweep.skipped if s.reason == reason) for reason in ("live", "held", "busy")}
        kept = ", ".join(f"{n} {reason}" for reason, n in counts.items() if n)
        freed = format_bytes(sum(r.shm_bytes for r in sweep.reclaimed))
        print(f"{sweep.lock_dir}: {len(sweep.reclaimed)} dead namespace(s) reclaimed ({freed})"
              + (f"; left alone: {kept}" if kept else ""))
    for skipped in sweep.skipped:
        if skipped in sweep.problems or skipped.reason == "elsewhere":
            print(f"ftd cleanup --dead: not touched: {skipped.namespace} ({skipped.reason}): {skipped.detail}",
                  file=sys.stderr)
    return 1 if sweep.problems else 0


def _local_cleanup(namespaces: list[str], timeout: float, lock_dir: str, *, force: bool = False) -> list[dict]:
    """Cleanup in this process (no daemon): the lock directory must be this user's (flextensor-<uid>, or its
    fallback flextensor-<uid>.<n> when another user took that name)."""
    import os
    from pathlib import Path

    from flextensor.daemon.lockdirs import inspect_lock_dir, lock_dir_name_uid, segment_owner_uid
    from flextensor.shm.cleanup import cleanup_manager_namespace
    from flextensor.shm.errors import ShmNamespaceHeldError, ShmProtocolError
    from flextensor.shm.segment_dir import namespace_directory

    if lock_dir_name_uid(Path(lock_dir).name) != os.getuid():
        raise CommandError(f"local cleanup can only use this user's lock directory (flextensor-{os.getuid()}), not "
                           f"{lock_dir}; run it as the workers' user, or through the daemon")
    try:
        checked = inspect_lock_dir(lock_dir).path
    except FileNotFoundError:  # no worker ever ran with this TMPDIR: nothing is journaled there
        for ns in namespaces:
            owner = segment_owner_uid(ns)
            if owner is not None and owner != os.getuid():
                where = namespace_directory(ns)
                raise CommandError(f"coordinator segment {where}/{ns}.c belongs to uid {owner}, not to this user "
                                   f"(uid {os.getuid()}): another user runs a job on the same namespace. Nothing was "
                                   f"removed; that user or root must remove its files (`rm {where}/{ns}.c` and its "
                                   f"{where}/{ns}.g*), or use another base namespace or manager name",
                                   "conflict") from None
            if owner is not None:
                raise CommandError(f"coordinator segment of {ns} exists but the lock directory {lock_dir} (its "
                                   "journal) does not: run cleanup with the workers' TMPDIR", "conflict") from None
        return [{"namespace": ns, "generation": None, "removed": [], "already_absent": [], "waited_s": 0.0}
                for ns in namespaces]
    except PermissionError as exc:
        raise CommandError(str(exc), "forbidden") from None
    deadline = time.monotonic() + timeout
    reports: list[dict[str, Any]] = []
    for ns in namespaces:
        try:
            report = cleanup_manager_namespace(ns, timeout=max(0.0, deadline - time.monotonic()), lock_dir=checked,
                                               force=force)
        except (TimeoutError, ShmProtocolError, PermissionError) as exc:
            done = ", ".join(r["namespace"] for r in reports)
            code = ("held" if isinstance(exc, ShmNamespaceHeldError) else
                    "timeout" if isinstance(exc, TimeoutError) else "conflict")
            raise CommandError(f"{exc}" + (f" (already cleaned: {done})" if done else ""), code) from None
        reports.append(msgspec.structs.asdict(report))
    return reports


def _cmd_drain(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    managers = args.manager or []
    if not managers and _is_per_manager(args.namespace, _lock_dir(args)):
        reply = _ask(args, proto.DrainRequest(namespaces=[args.namespace], base=None, managers=[],
                                              lock_dir=_lock_dir(args), undo=args.undo))
        return _ok(args, reply)
    namespaces = _namespaces(parser, args.namespace, managers) if managers else []
    if not managers:
        from flextensor.shm.names import validate_base_namespace

        try:
            validate_base_namespace(args.namespace)
        except ValueError as exc:
            parser.error(str(exc))
    reply = _ask(args, proto.DrainRequest(namespaces=namespaces, base=args.namespace, managers=list(managers),
                                          lock_dir=_lock_dir(args), undo=args.undo))
    return _ok(args, reply)


def _cmd_hold(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    (ns,) = _namespaces(parser, args.namespace, None if args.manager is None else [args.manager], _lock_dir(args))
    base, managers = _labels(args, [ns])
    reply = _ask(args, proto.HoldRequest(namespace=ns, lock_dir=_lock_dir(args), base=base,
                                         manager=managers[0] if managers else None))
    return _ok(args, reply)


def _cmd_release(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    (ns,) = _namespaces(parser, args.namespace, None if args.manager is None else [args.manager], _lock_dir(args))
    return _ok(args, _ask(args, proto.ReleaseRequest(namespace=ns)))


def _ok(args: argparse.Namespace, reply: proto.OkReply) -> int:
    if args.json:
        _print_json({"ok": True, "message": reply.message})
    else:
        print(reply.message)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)  # exits 2 on usage errors
    try:
        if args.command == "serve":
            return _cmd_serve(args)
        if args.command == "status":
            return _cmd_status(args)
        if args.command == "ls":
            return _cmd_ls(args)
        handler = {"cleanup": _cmd_cleanup, "drain": _cmd_drain, "hold": _cmd_hold, "release": _cmd_release}
        return handler[args.command](args, parser)
    except CommandError as exc:
        if args.json:
            _print_json({"error": exc.code, "message": str(exc)})
        print(f"ftd {args.command}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 1


if __name__ == "__main__":
    sys.exit(main())
