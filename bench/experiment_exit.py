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
- ``os_exit``: registered, then ``os._exit(0)`` (no interpreter teardown: what the driver and kernel cost alone).

Usage: ``python bench/experiment_exit.py [--gib 6 24] [--range-mib 256] [--repeat 2]`` (needs CUDA).
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

MODES = ("context", "mapped", "registered", "unregistered", "os_exit")


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
            cudart = torch.cuda.cudart()
            step = range_mib << 20
            begin = time.perf_counter()
            for offset in range(0, nbytes, step):
                rc = cudart.cudaHostRegister(base + offset, min(step, nbytes - offset), 0)
                if int(rc) != 0:
                    raise RuntimeError(f"cudaHostRegister failed: {rc}")
            info["register_s"] = time.perf_counter() - begin
            if mode == "unregistered":
                begin = time.perf_counter()
                for offset in range(0, nbytes, step):
                    cudart.cudaHostUnregister(base + offset)
                info["unregister_s"] = time.perf_counter() - begin
    print(json.dumps(info), flush=True)
    if mode == "os_exit":
        os._exit(0)


def one(mode: str, gib: float, range_mib: int, path: str) -> dict:
    proc = subprocess.Popen([sys.executable, __file__, "--child", mode, str(gib), str(range_mib), path],
                            stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    last = time.monotonic()
    proc.wait(timeout=300)
    info = json.loads(line) if line.startswith("{") else {"error": f"no report (rc={proc.returncode})"}
    info["exit_s"] = time.monotonic() - last
    return info


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=float, nargs="+", default=[6, 24])
    p.add_argument("--range-mib", type=int, default=256)
    p.add_argument("--repeat", type=int, default=2)
    args = p.parse_args()
    print("| GiB | what the process holds at exit | exit (median) | register | unregister |")
    print("|---|---|---|---|---|")
    for gib in args.gib:
        path = f"/dev/shm/ft-exit-{uuid.uuid4().hex[:8]}"
        with open(path, "wb") as f:
            f.truncate(int(gib * 2**30))
        try:
            for mode in MODES:
                runs = [one(mode, gib, args.range_mib, path) for _ in range(args.repeat)]
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
