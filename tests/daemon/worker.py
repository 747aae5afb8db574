"""A real worker process for the daemon tests and benchmark: joins a namespace through ``ShmCoordinator``.

Run as ``python -m tests.daemon.worker BASE MANAGER [options]`` from the repository root.  It prints one
JSON object per line on stdout (``joined``, ``published``, ``ready``, ``error``, ``closed``) and then waits
until it is killed, or until stdin closes / SIGTERM arrives (then it closes its coordinator cleanly).

The creator publishes a weights segment (``kind`` "w") filled with a byte pattern, so a later follower can
check that it attached the very same bytes (``checksum``) without anybody calling a creator factory again.
Registration with ftd is exactly the call the session will make after joining:
``register_participant(coord.namespace, coord.lease_slot, coord.identity, lock_directory())``.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import os
import signal
import sys
import threading
import time


def emit(event: str, **fields) -> None:
    sys.stdout.write(json.dumps({"event": event, "t": time.time(), "pid": os.getpid(), **fields}) + "\n")
    sys.stdout.flush()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("base")
    parser.add_argument("manager")
    parser.add_argument("--lease", type=float, default=1.0)
    parser.add_argument("--size", type=int, default=1 << 20, help="bytes of the published weights segment")
    parser.add_argument("--no-register", action="store_true")
    parser.add_argument("--no-publish", action="store_true", help="creator stays INITIALIZING")
    parser.add_argument("--publish-delay", type=float, default=0.0)
    parser.add_argument("--exit-after-ready", action="store_true", help="close and exit once READY")
    parser.add_argument("--sleep", action="store_true", help="once READY, record that its model sleeps")
    parser.add_argument("--checkpoint", help="creator: load this file's bytes as the weights (size = file size)")
    parser.add_argument("--as-uid", type=int, help="drop to this uid/gid after the imports (tests of other users)")
    args = parser.parse_args()

    from flextensor.shm.coordinator import ShmCoordinator
    from flextensor.shm.errors import ShmCreatorDiedError, ShmCreatorFailedError
    from flextensor.shm.ftd_client import register_participant, unregister_participant
    from flextensor.shm.names import lock_directory, manager_namespace

    if args.as_uid is not None:
        # Everything imported lazily must be loaded first: the interpreter's files may be root-only here.
        for module in ("encodings.ascii", "zmq"):
            importlib.import_module(module)

        from flextensor.shm.identity import boot_id

        boot_id()

        os.setgroups([])
        os.setgid(args.as_uid)
        os.setuid(args.as_uid)

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *a: stop.set())
    ns = manager_namespace(args.base, args.manager)
    t0 = time.monotonic()
    coord = ShmCoordinator(ns, lease_seconds=args.lease, timeout=10.0, base=args.base, manager=args.manager)
    registered = False
    if not args.no_register:
        t_reg = time.monotonic()
        registered = register_participant(coord.namespace, coord.lease_slot, coord.identity, lock_directory(),
                                          base=args.base, manager=args.manager)
        reg_s = time.monotonic() - t_reg
    else:
        reg_s = 0.0
    emit("joined", namespace=ns, creator=coord.is_creator, generation=coord.generation, slot=coord.lease_slot,
         registered=registered, register_s=reg_s, join_s=time.monotonic() - t0)
    owner = coord.memory_owner
    try:
        if coord.is_creator:
            if args.no_publish:
                pass
            else:
                time.sleep(args.publish_delay)
                t_load = time.monotonic()
                if args.checkpoint:
                    size = os.path.getsize(args.checkpoint)
                    segment = owner.create_segment("w", size)
                    with open(args.checkpoint, "rb") as f:
                        f.readinto(segment.buffer[:size])
                else:
                    size = args.size
                    segment = owner.create_segment("w", size)
                    segment.buffer[:size] = bytes(range(256)) * (size // 256) + bytes(size % 256)
                coord.notify_ready()
                load_s = time.monotonic() - t_load
                checksum = hashlib.sha256(segment.buffer[:size]).hexdigest()
                segment.close()
                emit("published", checksum=checksum, load_s=load_s, start_s=time.monotonic() - t0)
        else:
            t_wait = time.monotonic()
            try:
                coord.wait_for_ready(timeout=60.0)
            except (ShmCreatorDiedError, ShmCreatorFailedError, TimeoutError) as exc:
                emit("error", type=type(exc).__name__, message=str(exc), wait_s=time.monotonic() - t_wait)
                coord.close()
                emit("closed")
                return 0
            segment = owner.open_segment("w")
            attach_s = time.monotonic() - t0
            checksum = hashlib.sha256(segment.buffer).hexdigest()
            segment.close()
            emit("ready", checksum=checksum, wait_s=time.monotonic() - t_wait, attach_s=attach_s)
        if args.sleep:
            coord.participation.sleep()
            emit("asleep")
        if not args.exit_after_ready:
            # Wait for SIGTERM or for stdin to close (the test dropped us); SIGKILL needs no cooperation.
            threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
            stop.wait()
    finally:
        if not coord.closed:
            slot = coord.lease_slot
            coord.close()
            unregistered = registered and unregister_participant(ns, slot, coord.identity)
            emit("closed", unregistered=unregistered)
    return 0


if __name__ == "__main__":
    sys.exit(main())
