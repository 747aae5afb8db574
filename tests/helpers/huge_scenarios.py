"""Scenarios run inside a private mount namespace beside a file system of huge pages (``huge_mount.py``).

``python -m tests.helpers.huge_scenarios SCENARIO DIR [ARGS]``, where ``DIR`` is a tmpfs mounted ``huge=always``
or a hugetlbfs. Each prints one JSON line of what it saw (the test asserts on it) and exits 0 unless the
scenario itself broke:

- ``segment DIR TOKEN``: segments made, mapped, read, reserved and removed there;
- ``pin DIR TOKEN``: (CUDA) a fresh mapping's blocks registered one by one, as a follower's pinner does, and
  copied to the device;
- ``session DIR TOKEN PROFILE``: a creator and a follower (``session_worker``) with ``FT_SHM_DIR=DIR`` and an
  ``ftd`` beside them, what ``ftd ls`` and the journal say, then a clean close;
- ``crash DIR TOKEN PROFILE``: the same workers SIGKILLed, then ``ftd cleanup --dead`` run with no ``FT_SHM_DIR``;
- ``mismatch DIR TOKEN PROFILE``: a worker configured for ``/dev/shm`` while a job serves the namespace from DIR.

Everything left afterwards, in DIR, ``/dev/shm`` and the lock directory, is listed in the report.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from tests.helpers.forkserver import ForkedProcess, spawn_module

REPO = Path(__file__).resolve().parents[2]
PY = sys.executable


def _left(directory: str, token: str) -> dict[str, list[str]]:
    lock_dir = Path(os.environ["TMPDIR"]) / f"flextensor-{os.getuid()}"
    return {"dir": sorted(os.listdir(directory)),
            "dev_shm": sorted(n for n in os.listdir("/dev/shm") if token in n),
            "lock_dir": sorted(os.listdir(lock_dir)) if lock_dir.is_dir() else []}


def segment(directory: str, token: str) -> dict:
    import torch

    from flextensor.shm import segment_dir
    from flextensor.shm.errors import ShmSpaceError
    from flextensor.shm.segment import SharedSegment

    segment_dir.set_default_directory(directory)
    info = segment_dir.page_info(directory)
    name, lazy, big = f"/ft{token}.g1.sd", f"/ft{token}.g1.h", f"/ft{token}.g1.h1"
    asked = 3 * 2**20 + 12345
    seg = SharedSegment.create(name, asked)
    view = seg.tensor(torch.uint8, (asked,))
    view.copy_(torch.arange(asked, dtype=torch.int64).remainder(251).to(torch.uint8))
    huge = segment_dir.huge_mapped_bytes(directory + name)
    reader = subprocess.run(  # the bytes through the mapping another process opens by name (no torch needed)
        [PY, "-c", "import sys; from flextensor.shm.segment import SharedSegment; "
                   "from flextensor.shm import segment_dir; segment_dir.set_default_directory(sys.argv[2]); "
                   "s = SharedSegment.open(sys.argv[1]); print(sum(s.buffer[:s.size]))",
         name, directory], cwd=REPO, capture_output=True, text=True, check=True)
    fd = seg.open_file()
    try:
        pread_ok = os.pread(fd, 4096, 4096) == bytes(view[4096:8192].tolist())
    finally:
        os.close(fd)
    expected_sum = int(view.to(torch.int64).sum())
    del view
    mode = SharedSegment.mode_of(name)
    seg.close()
    # Reserved range by range: whole pages of the mount are allocated around the range asked for.
    part = SharedSegment.create(lazy, 8 * 2**20, reserve=False)
    part.reserve_range(2**20 + 3, 5 * 2**20)
    lazy_allocated = os.stat(directory + lazy).st_blocks * 512
    part.tensor(torch.uint8, (part.size,))[2**20 + 3:6 * 2**20 + 3].fill_(7)  # the writer the range was reserved for
    lazy_huge = segment_dir.huge_mapped_bytes(directory + lazy)
    part.close()
    # A range whose pages no longer fit (the rest of the mount taken since the segment was made): a named error
    # from the reservation, before anything writes there (never a SIGBUS in the copy). A hugetlbfs reserves a
    # shared mapping's pages when it is mapped, so there the one that takes the rest is refused instead.
    page = info.size
    late_name, filler_name = f"/ft{token}.g1.h2", f"/ft{token}.g1.h3"
    room = segment_dir.free_bytes(directory)
    late = SharedSegment.create(late_name, room, reserve=False)
    late_error = None
    try:
        filler = SharedSegment.create(filler_name, room - 2 * page)
        filler.close()
        late.reserve_range(0, page)
        late.reserve_range(page, 2 * page)
    except ShmSpaceError as exc:
        late_error = ("reserve" if os.path.exists(directory + filler_name) else "filler", str(exc))
    late.close()
    late_removed = [SharedSegment.unlink_name(n) for n in (late_name, filler_name)]  # the filler: False if refused
    written = None
    if info.fs == "tmpfs":  # written through its file, as a creator's copy pool does on a tmpfs of huge pages
        target_name = f"/ft{token}.g1.h4"
        room = segment_dir.free_bytes(directory)
        target = SharedSegment.create(target_name, room, reserve=False)
        data = torch.arange(page + 5, dtype=torch.int64).remainder(253).to(torch.uint8)
        fd = target.open_file(write=True)
        try:
            target.write_from(fd, 3, data.data_ptr(), data.numel())
            allocated = os.stat(directory + target_name).st_blocks * 512  # the write allocated whole pages
            same = bool(torch.equal(target.tensor(torch.uint8, (data.numel(),), offset=3), data))
            filler = SharedSegment.create(filler_name, room - 4 * page)
            filler.close()
            more = torch.ones(3 * page, dtype=torch.uint8)
            try:
                target.write_from(fd, 2 * page, more.data_ptr(), more.numel())
                full_error = None
            except ShmSpaceError as exc:
                full_error = str(exc)
            try:
                target.write_from(fd, target.size - 1, more.data_ptr(), 2)
                outside_error = None
            except ValueError as exc:
                outside_error = str(exc)
        finally:
            os.close(fd)
        size_after = os.stat(directory + target_name).st_size
        target.close()
        written = {"allocated": allocated, "same": same, "full_error": full_error, "outside_error": outside_error,
                   "size_kept": size_after == target.size,
                   "removed": [SharedSegment.unlink_name(n) for n in (target_name, filler_name)]}
    try:
        SharedSegment.create(big, 1 << 40)
        space_error = None
    except ShmSpaceError as exc:
        space_error = str(exc)
    removed = [SharedSegment.unlink_name(n) for n in (name, lazy)]
    return {"page_size": info.size, "fs": info.fs, "source": info.source, "describe": info.describe(),
            "asked": asked, "size": seg.size, "segment_page_size": seg.page_size, "huge_mapped": huge,
            "reader_sum": int(reader.stdout.strip()), "expected_sum": expected_sum, "pread_ok": pread_ok,
            "mode": mode, "lazy_allocated": lazy_allocated, "space_error": space_error, "late_error": late_error,
            "late_removed": late_removed, "lazy_huge": lazy_huge, "written": written,
            "big_left": os.path.exists(directory + big), "removed": removed, "left": _left(directory, token)}


def pin(directory: str, token: str) -> dict:
    import torch

    from flextensor.shm import segment_dir
    from flextensor.shm.blocks import arena_layout
    from flextensor.shm.segment import SharedSegment

    segment_dir.set_default_directory(directory)
    name = f"/ft{token}.g1.h"
    layout = arena_layout([3 * 2**20 + 100, 5000, 2**20], align=segment_dir.block_alignment(directory))
    writer = SharedSegment.create(name, layout.part_sizes[0])
    data = torch.randint(0, 255, (writer.size,), dtype=torch.uint8)
    writer.tensor(torch.uint8, (writer.size,)).copy_(data)
    reader = SharedSegment.open(name)  # a follower's fresh mapping of pages another handle wrote
    equal = []
    for offset, size in zip(layout.offsets, layout.sizes):
        reader.pin(read_only=True, prefault=True, offset=offset, nbytes=size)
        on_device = reader.tensor(torch.uint8, (size,), offset=offset).to("cuda", non_blocking=True)
        torch.cuda.synchronize()
        equal.append(bool(torch.equal(on_device.cpu(), data[offset:offset + size])))
    pinned = reader.pinned
    reader.close()
    writer.close()
    SharedSegment.unlink_name(name)
    return {"offsets": list(layout.offsets), "equal": equal, "pinned": pinned, "left": _left(directory, token)}


def _worker(ns: str, profile: str, shm_dir: str | None, *extra: str) -> subprocess.Popen | ForkedProcess:
    """A session worker in this mount namespace, forked (with torch imported) from a fork server this process
    starts, so in this namespace too; a fresh interpreter where the test process found forking off (CUDA)."""
    env = dict(os.environ)
    env.pop("FT_SHM_DIR", None)
    if shm_dir is not None:
        env["FT_SHM_DIR"] = shm_dir
    return spawn_module("tests.helpers.session_worker", ["--ns", ns, "--profile", profile, "--lease", "5", *extra],
                        cwd=REPO, env=env)


def _first_line(proc: subprocess.Popen | ForkedProcess) -> dict:
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError(f"worker {proc.pid} printed nothing; stderr:\n{proc.stderr.read()}")
    return json.loads(line)


def _journal_dirs() -> list[str]:
    from flextensor.shm.journal import list_journals, read_journal

    return [read_journal(ns).header.shm_dir for ns in list_journals()]


def session(directory: str, token: str, profile: str) -> dict:
    sys.path.insert(0, str(REPO))
    from tests.daemon.helpers import Daemon, run_cli

    ns = f"t-{token}"
    socket = Path(os.environ["TMPDIR"]) / "ftd" / "ftd.sock"
    socket.parent.mkdir(mode=0o700)
    lock_dir = Path(os.environ["TMPDIR"]) / f"flextensor-{os.getuid()}"
    os.environ["FT_DAEMON_SOCKET"] = str(socket)
    daemon = Daemon(socket, lock_dir).start()
    try:
        creator = _worker(ns, profile, directory, "--hold", "--log")
        first = _first_line(creator)
        follower = _worker(ns, profile, directory, "--hold")
        second = _first_line(follower)
        held = _left(directory, token)
        journals = _journal_dirs()
        _, rows, _ = run_cli("ls", "--socket", str(socket), "--json")
        ours = [r for r in rows if r["base"] == ns]
        for proc in (creator, follower):
            proc.stdin.close()
        codes = [proc.wait(30) for proc in (creator, follower)]
        creator_log = creator.stderr.read()
    finally:
        daemon.stop()
    return {"roles": sorted([first.get("role"), second.get("role")]), "same_output": first.get("out") ==
            second.get("out"), "errors": [r.get("message") for r in (first, second) if "error" in r],
            "tensors": second.get("tensors"), "held": held, "journal_dirs": journals, "ls": ours, "codes": codes,
            "creator_log": creator_log,
            "left": _left(directory, token)}


def crash(directory: str, token: str, profile: str) -> dict:
    ns = f"t-{token}"
    creator = _worker(ns, profile, directory, "--hold")
    first = _first_line(creator)
    follower = _worker(ns, profile, directory, "--hold")
    second = _first_line(follower)
    held = _left(directory, token)
    for proc in (creator, follower):
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    after_kill = _left(directory, token)
    env = dict(os.environ)
    env.pop("FT_SHM_DIR", None)  # the journal alone must say where the segments are
    cleanup = subprocess.run([PY, "-m", "flextensor.daemon.cli", "cleanup", "--dead", "--json"], cwd=REPO, env=env,
                             capture_output=True, text=True)
    return {"roles": sorted([first.get("role"), second.get("role")]), "held": held, "after_kill": after_kill,
            "cleanup_code": cleanup.returncode, "cleanup": json.loads(cleanup.stdout or "null"),
            "cleanup_stderr": cleanup.stderr, "left": _left(directory, token)}


def mismatch(directory: str, token: str, profile: str) -> dict:
    ns = f"t-{token}"
    creator = _worker(ns, profile, directory, "--hold")
    first = _first_line(creator)
    other = _worker(ns, profile, None)
    refused = _first_line(other)
    other.wait(30)
    creator.stdin.close()
    code = creator.wait(30)
    return {"creator": first.get("role"), "refused": refused, "creator_code": code, "left": _left(directory, token)}


def main() -> int:
    scenario, directory, *args = sys.argv[1:]
    scenarios = {"segment": segment, "pin": pin, "session": session, "crash": crash, "mismatch": mismatch}
    report = scenarios[scenario](directory, *args)
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
