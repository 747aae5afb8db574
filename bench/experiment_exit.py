"""What a CUDA worker's exit costs, by what it still holds: the floor under "the exit after close()".

Why: a supervisor restarting a job waits for its workers to exit, and a worker that streamed from shared memory
had the shared blocks registered with CUDA (page-locked) in its own mapping. ``close()`` hands that mapping to a
release thread; whatever is still registered when the process ends is released by the driver and the kernel as
the process dies. This measures, in fresh processes, the time from a worker's last line to its exit (as the
parent's ``waitpid`` sees it), for:

- ``context``: a CUDA context and nothing else (the floor of any CUDA process);
- ``mapped``: plus ``--gib`` of a ``/dev/shm`` file mapped and touched (not registered);
- ``registered``: plus that mapping registered with CUDA in ``--range-mib`` ranges, left registered at exit;
- ``unregistered``: registered, then unregistered before the last line (the unregistering is timed, not the exit);
- ``os_exit``: registered, then ``os._exit(0)`` (no interpreter teardown: what the driver and kernel cost alone);
- ``zapped``: registered; at the word to end, the mapping's page tables are dropped first (``MADV_DONTNEED`` of
  ``--range-mib`` ranges from :data:`ZAP_THREADS` threads; the registration keeps its pages), then a normal
  exit: whether tearing the page tables down in parallel beats the kernel doing it alone as the process dies;
- ``unregistered_parallel``: registered; at the word to end, the ranges are unregistered from :data:`ZAP_THREADS`
  threads, then a normal exit: whether the driver's unregistering runs in parallel at all;
- ``registered_parallel``: as ``registered``, the ranges registered from :data:`ZAP_THREADS` threads (the
  register column tells whether the driver's registering runs in parallel).

``--together N`` runs N such processes at once (each its own mapping of the same file, as the workers of a host
have) and tells them to end together, as workers closing at once do: the exit of each is timed from that word,
and the row gives the slowest. ``--modes context --together 4`` is the floor under "4 workers closing together".

Usage: ``python bench/experiment_exit.py [--gib 6 24] [--range-mib 256] [--repeat 2] [--together 1]
[--modes ...]`` (needs CUDA).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import statistics
import subprocess
import sys
import time
import uuid

MODES = ("context", "mapped", "registered", "unregistered", "os_exit", "zapped", "unregistered_parallel",
         "registered_parallel")
#: Threads that drop the page tables (``zapped``) or unregister (``unregistered_parallel``) at the word to end.
ZAP_THREADS = 8
_MADV_DONTNEED = 4


def in_threads(call, base: int, nbytes: int, step: int) -> None:
    """``call(address, length)`` over ``[base, base + nbytes)`` in ``step`` ranges from :data:`ZAP_THREADS`
    threads (each call must release the GIL to run beside the others)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(ZAP_THREADS) as pool:
        list(pool.map(lambda offset: call(base + offset, min(step, nbytes - offset)), range(0, nbytes, step)))


def zap(address: int, length: int) -> None:
    """``MADV_DONTNEED`` of one range (the GIL is released around the call)."""
    from flextensor.shm.prefault import madvise

    errno = madvise(address, length, _MADV_DONTNEED)
    if errno:
        raise OSError(errno, "madvise(MADV_DONTNEED) failed")


def register(address: int, length: int) -> None:
    """``cudaHostRegister`` of one range (default flags)."""
    import torch

    rc = torch.cuda.cudart().cudaHostRegister(address, length, 0)
    if int(rc) != 0:
        raise RuntimeError(f"cudaHostRegister failed: {rc}")


def unregister(address: int, length: int) -> None:
    """``cudaHostUnregister`` of one range registered as a whole."""
    import torch

    rc = torch.cuda.cudart().cudaHostUnregister(address)
    if int(rc) != 0:
        raise RuntimeError(f"cudaHostUnregister failed: {rc}")


def child(mode: str, gib: float, range_mib: int, path: str) -> None:
    import torch

    torch.ones(1, device="cuda").sum().item()
    info: dict = {"mode": mode}
    if mode != "context":
        nbytes = int(gib * 2**30)
        fd = os.open(path, os.O_RDWR)
        mapping = mmap.mmap(fd, nbytes)
        os.close(fd)
        view = torch.frombuffer(mapping, dtype=torch.uint8)
        view.fill_(1)  # every page in this process's page tables, as a follower's streaming leaves them
        base = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
        if mode != "mapped":
            step = range_mib << 20
            begin = time.perf_counter()
            if mode == "registered_parallel":
                in_threads(register, base, nbytes, step)
            else:
                for offset in range(0, nbytes, step):
                    register(base + offset, min(step, nbytes - offset))
            info["register_s"] = time.perf_counter() - begin
            if mode == "unregistered":
                begin = time.perf_counter()
                for offset in range(0, nbytes, step):
                    unregister(base + offset, min(step, nbytes - offset))
                info["unregister_s"] = time.perf_counter() - begin
    print(json.dumps(info), flush=True)
    sys.stdin.readline()  # the parent's word to end (at once for every process of a --together run)
    if mode == "zapped":
        in_threads(zap, base, nbytes, range_mib << 20)
    if mode == "unregistered_parallel":
        in_threads(unregister, base, nbytes, range_mib << 20)
    if mode == "os_exit":
        os._exit(0)


def together(mode: str, gib: float, range_mib: int, path: str, count: int) -> dict:
    """``count`` processes of ``mode``; once every one has reported, all are told to end at once: each one's
    report, with ``exit_s`` from that word to its exit as ``waitpid`` sees it."""
    procs = [subprocess.Popen([sys.executable, __file__, "--child", mode, str(gib), str(range_mib), path],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for _ in range(count)]
    lines = [proc.stdout.readline() for proc in procs]
    last = time.monotonic()
    for proc in procs:
        try:
            proc.stdin.write("end\n")
            proc.stdin.flush()
        except BrokenPipeError:  # it died before reporting: its row says so
            pass
    exits: dict[int, float] = {}
    deadline = last + 300
    while len(exits) < count and time.monotonic() < deadline:
        for index, proc in enumerate(procs):
            if index not in exits and proc.poll() is not None:
                exits[index] = time.monotonic() - last
        time.sleep(0.002)
    infos = []
    for index, (proc, line) in enumerate(zip(procs, lines)):
        if index not in exits:
            proc.kill()
            proc.wait()
        info = json.loads(line) if line.startswith("{") else {"error": f"no report (rc={proc.returncode})"}
        info["exit_s"] = exits.get(index, float("inf"))
        infos.append(info)
    errors = [i["error"] for i in infos if "error" in i]
    if errors:
        return {"error": errors[0]}
    return {"exit_s": max(i["exit_s"] for i in infos),
            "register_s": max(i.get("register_s", 0.0) for i in infos),
            "unregister_s": max(i.get("unregister_s", 0.0) for i in infos)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=float, nargs="+", default=[6, 24])
    p.add_argument("--range-mib", type=int, default=256)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--together", type=int, default=1, help="processes ending at once (the slowest is reported)")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    args = p.parse_args()
    print(f"{args.together} process(es) at a time; exit: the slowest of them, median of {args.repeat} runs")
    print("| GiB | what the process holds at exit | exit (median) | register | unregister |")
    print("|---|---|---|---|---|")
    for gib in args.gib:
        path = f"/dev/shm/ft-exit-{uuid.uuid4().hex[:8]}"
        with open(path, "wb") as f:
            f.truncate(int(gib * 2**30))
        try:
            for mode in args.modes:
                runs = [together(mode, gib, args.range_mib, path, args.together) for _ in range(args.repeat)]
                failed = next((r["error"] for r in runs if "error" in r), None)
                if failed:
                    print(f"| {gib:g} | {mode} | {failed} | - | - |", flush=True)
                    continue
                exits = statistics.median(r["exit_s"] for r in runs)
                reg = statistics.median(r.get("register_s", 0.0) for r in runs)
                unreg = statistics.median(r.get("unregister_s", 0.0) for r in runs)
                print(f"| {gib:g} | {mode} | {exits:.3f} s | {reg:.2f} s | {unreg:.2f} s |", flush=True)
        finally:
            os.unlink(path)


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "--child":
        child(sys.argv[2], float(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
    else:
        main()
