"""Running test code as another user, from a checkout that user may not be able to read.

A clone in a private folder (``mktemp -d`` and home directories are 0700), and the venv inside it, are out of
reach of any other uid: an interpreter started as uid 65534 there cannot even import flextensor. So the child
starts as this (root) test's user, imports every module of ``flextensor.shm`` (plus the ones the caller names)
while everything is readable, then drops to the uid (groups cleared, gid, then uid) and only then runs the
caller's code, which must import nothing new but standard modules already loaded (``json``, ``os``, ``sys``...).
"""

from __future__ import annotations

import os
import subprocess
import textwrap
from collections.abc import Iterable
from pathlib import Path

from tests.helpers.forkserver import BARE, ForkedProcess, run_code, spawn_code

__all__ = ["run_as_user", "start_as_user"]

_PRELUDE = """\
import importlib, json, os, pkgutil, sys, time, traceback
import encodings.ascii, encodings.idna
import flextensor.shm
for _info in pkgutil.iter_modules(flextensor.shm.__path__, "flextensor.shm."):
    importlib.import_module(_info.name)
for _name in {extra!r}:
    importlib.import_module(_name)
from flextensor.shm.identity import boot_id, pid_namespace
boot_id(), pid_namespace()  # cached now: /proc/self/ns may turn unreadable once the process changed its uid
{prepare}
os.setgroups([])
os.setgid({uid})
os.setuid({uid})
assert os.getuid() == os.geteuid() == {uid} and os.getgid() == {uid}
"""


def run_as_user(uid: int, code: str, *, tmpdir: str, timeout: float = 60.0, extra_modules: Iterable[str] = (),
                prepare: str = "") -> subprocess.CompletedProcess[str]:
    """Run ``code`` (dedented) in a process of its own as uid/gid ``uid`` with ``TMPDIR=tmpdir``; see the module
    docstring. ``prepare`` runs before the switch, still as root (whatever imports lazily: ``argparse`` loads
    ``gettext`` when it builds a parser). Needs root. Returns the finished process (stdout and stderr as text).
    The process is forked from a server that imported nothing (``forkserver.BARE``): it imports what it needs
    itself, as a fresh ``python -c`` would."""
    script = (_PRELUDE.format(uid=int(uid), extra=tuple(extra_modules), prepare=textwrap.dedent(prepare))
              + textwrap.dedent(code))
    env = {**os.environ, "TMPDIR": tmpdir}
    return run_code(script, timeout=timeout, env=env, cwd=Path("/"), preload=BARE)


def start_as_user(uid: int, code: str, *, tmpdir: str, extra_modules: Iterable[str] = (),
                  prepare: str = "") -> subprocess.Popen[str] | ForkedProcess:
    """As :func:`run_as_user`, but started in the background (stdin, stdout and stderr are pipes, as text): for a
    job of that uid that must still run, or be SIGKILLed, while the test acts."""
    script = (_PRELUDE.format(uid=int(uid), extra=tuple(extra_modules), prepare=textwrap.dedent(prepare))
              + textwrap.dedent(code))
    return spawn_code(script, env={**os.environ, "TMPDIR": tmpdir}, cwd=Path("/"), preload=BARE)
