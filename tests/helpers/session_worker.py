"""One worker process of a SharedOffloadSession, for the multi-process session tests.

Run as ``python -m tests.helpers.session_worker --ns NS --profile DIR [--mode MODE] ...``. Prints one JSON line:
``{"role": ..., "generation": ..., "out": <hex of the output bytes>}`` on success, or
``{"error": <exception class>, "message": ...}`` (exit status 3) on failure. Modes shape the creator factory
(``fail`` raises, ``hang`` blocks forever, ``slow`` takes a second, or until ``--go`` exists) or the follower model (``mismatch``).
With ``--hold`` the worker keeps its session open until a line arrives on stdin.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import threading
import time
from pathlib import Path

import torch

import flextensor as ft
from tests.helpers.models import TinyTransformer, tiny_transformer, token_ids


def _frame_lines(frame, depth: int) -> list[str]:
    """The innermost ``depth`` frames as file:line function, read from the frames alone (no source lookup,
    which takes import locks that the sampled threads may hold)."""
    lines = []
    while frame is not None and len(lines) < depth:
        lines.append(f"  {frame.f_code.co_filename}:{frame.f_lineno} {frame.f_code.co_name}")
        frame = frame.f_back
    return lines


def _sample_stacks(path: str, every: float = 0.2) -> None:
    """Append every thread's Python stack to ``path`` each ``every`` seconds, with the ms since start.

    A Python thread (not faulthandler's watchdog, which reads other threads' frames without the GIL and can
    crash the process): a gap between two samples longer than ``every`` shows that some thread held the GIL."""
    start = time.monotonic()

    def run() -> None:
        try:
            _loop()
        except BaseException as exc:  # noqa: BLE001 - written down, never raised in the worker
            with open(path, "a") as out:
                out.write(f"sampler stopped: {exc!r}\n")

    def _loop() -> None:
        with open(path, "a") as out:
            while True:
                names = {t.ident: t.name for t in threading.enumerate()}
                lines = [f"--- {1000 * (time.monotonic() - start):.0f} ms"]
                for ident, frame in sys._current_frames().items():
                    if ident == threading.get_ident():
                        continue
                    lines.append(f"thread {names.get(ident, ident)}:")
                    lines.extend(_frame_lines(frame, depth=8))
                out.write("\n".join(lines) + "\n")
                out.flush()
                time.sleep(every)

    threading.Thread(target=run, name="stack-sampler", daemon=True).start()


def _touch(path: str | None) -> None:
    if path:
        Path(path).write_text("started")


def shm_ranges() -> list[tuple[int, int]]:
    """The address ranges of this process's mappings of segments (in /dev/shm, or the FT_SHM_DIR given)."""
    from flextensor.shm.segment_dir import default_directory

    where = default_directory().rstrip("/") + "/"
    ranges = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            if where in line:
                start, end = (int(x, 16) for x in line.split()[0].split("-"))
                ranges.append((start, end))
    return ranges


def _in_shared_memory(tensor: torch.Tensor, ranges: list[tuple[int, int]]) -> bool:
    return tensor.device.type == "cpu" and any(start <= tensor.data_ptr() < end for start, end in ranges)


def _views_shared_memory(model: torch.nn.Module) -> bool:
    """Whether any parameter or buffer still points into a /dev/shm mapping of this process."""
    ranges = shm_ranges()
    return any(_in_shared_memory(t, ranges) for t in [*model.parameters(), *model.buffers()])


def _where_tensors_live(model: torch.nn.Module, manager: ft.OffloadManager) -> dict:
    """How many offloaded and resident tensors view /dev/shm, and whether the engine has a block loader."""
    ranges = shm_ranges()
    offloaded = {n for names in manager.offloaded_tensors.values() for n in names}
    tensors = dict([*model.named_parameters(), *model.named_buffers()])
    in_shm = {n for n, t in tensors.items() if _in_shared_memory(t, ranges)}
    return {"offloaded": len(offloaded), "offloaded_in_shm": len(offloaded & in_shm),
            "resident_in_shm": len(in_shm - offloaded), "resident": len(set(tensors) - offloaded),
            "loader": manager.loader is not None}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ns", required=True)
    parser.add_argument("--profile", required=True)
    parser.add_argument("--name", default="model")
    parser.add_argument("--mode", default="normal", choices=["normal", "fail", "hang", "slow", "mismatch"])
    parser.add_argument("--lease", type=float, default=1.0)
    parser.add_argument("--wait-timeout", type=float, default=60.0)
    parser.add_argument("--marker")
    parser.add_argument("--hold", action="store_true")
    parser.add_argument("--go", help="mode fail: raise only once this file exists; mode slow: return once it does")
    parser.add_argument("--preserve", action="store_true",
                        help="close(preserve_models=True), then run the model again and report whether it still views SHM")
    parser.add_argument("--log", action="store_true", help="log INFO lines to stderr (tests wait on them)")
    parser.add_argument("--checkpoint", help="the creator reads this safetensors checkpoint (no creator factory)")
    parser.add_argument("--slow-seconds", type=float, default=1.0,
                        help="how long mode slow's factory sleeps (at most, with --go)")
    parser.add_argument("--factory-marker", help="the follower factory touches this file when it starts")
    parser.add_argument("--built-marker", help="the follower factory touches this file when it returns")
    parser.add_argument("--follower-sleep", type=float, default=0.0,
                        help="the follower factory sleeps this long (at most, with --follower-go)")
    parser.add_argument("--follower-go", help="the follower factory returns once this file exists")
    parser.add_argument("--follower-fails", action="store_true", help="the follower factory raises")
    parser.add_argument("--stacks-file",
                        help="append every thread's stack to this file 5 times a second (where a slow test waited)")
    parser.add_argument("--arena-part-bytes", type=int,
                        help="cut the host-block arena into parts of this many bytes (as a large model's is)")
    args = parser.parse_args()
    if args.stacks_file:
        _sample_stacks(args.stacks_file)
    if args.arena_part_bytes:  # every participant must lay the arena out alike: each worker gets the option
        from flextensor.shm import blocks

        blocks.ARENA_PART_MIN_BYTES = args.arena_part_bytes
    if args.log:
        # ms since the worker started beside each line: a test's failure message then shows where time went
        logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                            format="%(relativeCreated)d ms %(levelname)s:%(name)s:%(message)s")

    def creator_factory() -> torch.nn.Module:
        _touch(args.marker)
        if args.mode == "fail":
            while args.go and not Path(args.go).exists():  # fail only once the followers are waiting
                time.sleep(0.02)
            raise RuntimeError("checkpoint exploded: shard 3 is truncated")
        if args.mode == "hang":
            time.sleep(3600)
        if args.mode == "slow":
            deadline = time.monotonic() + args.slow_seconds
            while time.monotonic() < deadline and not (args.go and Path(args.go).exists()):
                time.sleep(0.02)
        return tiny_transformer(seed=0)

    def follower_factory() -> torch.nn.Module:
        _touch(args.factory_marker)
        deadline = time.monotonic() + args.follower_sleep
        while time.monotonic() < deadline and not (args.follower_go and Path(args.follower_go).exists()):
            time.sleep(0.02)
        if args.follower_fails:
            raise RuntimeError("the follower's factory failed: config.json is missing")
        if args.checkpoint:  # the creator builds with this factory too: buffers stay real, parameters go meta
            with ft.init_empty_weights():
                model = TinyTransformer()
        else:
            with torch.device("meta"):
                model = TinyTransformer(d=48) if args.mode == "mismatch" else TinyTransformer()
        _touch(args.built_marker)
        return model

    config = ft.OffloadConfig(pinned_memory=torch.cuda.is_available(), num_blocks=2, min_blocks=2)
    session = ft.SharedOffloadSession(args.ns, wait_timeout=args.wait_timeout, lease_seconds=args.lease)
    try:
        model = session.offload_from_profile(
            args.profile, config=config, name=args.name,
            creator_model_factory=None if args.checkpoint else creator_factory,
            follower_model_factory=follower_factory, checkpoint=args.checkpoint,
        )
        with torch.no_grad():
            out = model(token_ids().to(ft.get_offload_manager(args.name).device)).cpu()
        report = session.report()[0]
        print(json.dumps({"role": report["role"], "generation": report["generation"],
                          "registered": report.get("registered"), "out": out.numpy().tobytes().hex(),
                          "tensors": _where_tensors_live(model, ft.get_offload_manager(args.name))}), flush=True)
        if args.hold:
            sys.stdin.readline()
        if args.preserve:
            session.close(preserve_models=True)
            device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
            model.to(device)
            with torch.no_grad():
                again = model(token_ids().to(device)).cpu()
            print(json.dumps({"out_after_close": again.numpy().tobytes().hex(),
                              "views_shared_memory": _views_shared_memory(model)}), flush=True)
            return 0
        session.close()
        return 0
    except Exception as exc:  # noqa: BLE001 - the test reads the class and message
        print(json.dumps({"error": type(exc).__name__, "message": str(exc)}), flush=True)
        session.close()
        return 3


if __name__ == "__main__":
    sys.exit(main())
