"""Request handling of ``ftd``: who may ask what, and the answer (one reply per request).

Authorization
-------------
The requester is identified by the kernel, never by the payload: libzmq reports the ipc peer's
``SO_PEERCRED`` (uid, gid, pid) in the ``Peer-Address`` property of each message (:func:`peer_of`).  A
request whose credentials are missing is refused for anything that changes state.

* ``status`` and ``ls`` are read-only and open to anyone who can connect (the socket's mode decides that).
* ``register``/``unregister``: the lock directory must belong to the requester, and the namespace's
  coordinator segment to the lock directory's owner; the slot must really hold the identity sent.
* ``drain``, ``hold``, ``release``, ``cleanup``: the requester must be root or the namespace's owner (the uid
  owning ``/dev/shm/{ns}.c``, else the uid owning its lock directory).  A foreign user gets ``forbidden``.

Root requesters may act on any namespace (they could delete the files by hand anyway).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Any, Callable

from flextensor.shm import ftd_protocol as proto
from flextensor.shm import segment_dir
from flextensor.shm.errors import ShmProtocolError
from flextensor.shm.names import manager_namespace, validate_namespace

from flextensor.daemon.holds import HoldRefused, drop_hold, take_hold
from flextensor.daemon.reaper import PendingCleanup, Reaper
from flextensor.daemon.lockdirs import LockDir, inspect_lock_dir, segment_owner_uid
from flextensor.daemon.registry import Registry

__all__ = ["Handler", "Peer", "peer_of", "RequestHandler"]

logger = logging.getLogger(__name__)

#: Bounds on the work one user can queue (a cleanup waiting for leases is retried at every poll).
MAX_PENDING_CLEANUPS_PER_UID = 8
MAX_CLEANUP_NAMESPACES = 64


@dataclasses.dataclass(frozen=True)
class Peer:
    """Kernel-reported credentials of the requesting process (pid as seen from the daemon)."""

    uid: int
    gid: int
    pid: int


#: A request's handler: (request, the requester's credentials, the reply's routing frames) -> the reply, or None
#: when it is sent later (a cleanup waiting for leases).
Handler = Callable[[Any, Peer | None, list[bytes]], proto.Reply | None]


def peer_of(frame) -> Peer | None:
    """Credentials from a received ``zmq.Frame``'s ``Peer-Address`` ("<addr>:<uid>:<gid>:<pid>")."""
    try:
        address = frame.get("Peer-Address")
    except Exception:  # noqa: BLE001 - libzmq without the property, or not an ipc connection
        return None
    parts = str(address).rsplit(":", 3)
    if len(parts) != 4:
        return None
    try:
        uid, gid, pid = (int(p) for p in parts[1:])
    except ValueError:
        return None
    return Peer(uid, gid, pid)


class _Refused(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def _error(code: str, message: str) -> proto.ErrorReply:
    return proto.ErrorReply(code=code, message=message)


class RequestHandler:
    """Dispatches decoded requests; replies, or None for a deferred reply (cleanup waiting for leases)."""

    def __init__(self, registry: Registry, reaper: Reaper, info: dict) -> None:
        self.registry = registry
        self.reaper = reaper
        self.info = info  # version, socket, started (monotonic), metrics (DaemonMetrics), send, save_state
        #: Request type -> its handler: one entry per member of ``proto.Request``.
        self.handlers: dict[type, Handler] = {
            proto.StatusRequest: self._on_status,
            proto.ListRequest: self._on_ls,
            proto.RegisterRequest: self._on_register,
            proto.UnregisterRequest: self._on_unregister,
            proto.DrainRequest: self._on_drain,
            proto.HoldRequest: self._on_hold,
            proto.ReleaseRequest: self._on_release,
            proto.CleanupRequest: self._on_cleanup,
        }

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def _need_peer(peer: Peer | None, what: str) -> Peer:
        if peer is None:
            raise _Refused("forbidden", f"{what}: the daemon cannot identify the requester (no peer credentials on "
                                        "this connection); use the ipc socket on this host")
        return peer

    @staticmethod
    def _valid_ns(ns: str) -> str:
        try:
            return validate_namespace(ns)
        except ValueError as exc:
            raise _Refused("bad_request", str(exc)) from None

    def _lock_dir(self, path: str, peer: Peer, what: str) -> LockDir:
        try:
            lock_dir = inspect_lock_dir(path)
        except FileNotFoundError:
            raise _Refused("not_found", f"{what}: lock directory {path} does not exist") from None
        except (PermissionError, OSError) as exc:
            raise _Refused("forbidden", f"{what}: {exc}") from None
        if peer.uid != 0 and lock_dir.uid != peer.uid:
            raise _Refused("forbidden", f"{what}: lock directory {path} belongs to uid {lock_dir.uid}, the requester "
                                        f"is uid {peer.uid}")
        return lock_dir

    def _owner_uid(self, ns: str, fallback: int | None) -> int | None:
        owner = segment_owner_uid(ns)
        if owner is not None:
            return owner
        view = self.registry.views.get(ns)
        if view is not None:
            return view.lock_dir.uid
        return fallback

    def _authorize(self, ns: str, peer: Peer, what: str, fallback_owner: int | None = None) -> int | None:
        owner = self._owner_uid(ns, fallback_owner)
        if peer.uid != 0 and owner is not None and owner != peer.uid:
            raise _Refused("forbidden", f"{what} refused: namespace {ns} belongs to uid {owner}, the requester is "
                                        f"uid {peer.uid} (only its owner or root may {what} it)")
        return owner

    def _labels(self, ns: str, base: str | None, manager: str | None) -> None:
        """Remember (base, manager) for ``ns`` when they really name it (never trust labels blindly)."""
        if base is None or manager is None:
            return
        try:
            if manager_namespace(base, manager) != ns:
                return
        except ValueError:
            return
        self.registry.labels[ns] = (base, manager)
        view = self.registry.views.get(ns)
        if view is not None:
            view.base, view.manager = base, manager

    # ------------------------------------------------------------------ dispatch
    def handle(self, request, peer: Peer | None, reply_to: list[bytes]):
        kind = type(request).__struct_config__.tag
        self.info["metrics"].requests.labels(type=kind).inc()
        try:
            return self.handlers[type(request)](request, peer, reply_to)
        except _Refused as exc:
            if kind == "register":
                self.info["metrics"].refusals.labels(reason=exc.code).inc()
            return _error(exc.code, str(exc))
        except HoldRefused as exc:
            return _error(exc.code, str(exc))
        except ShmProtocolError as exc:
            return _error("conflict", f"{kind}: the namespace's shared metadata cannot be trusted: {exc}")
        except TimeoutError as exc:
            return _error("busy", f"{kind}: {exc}")
        except PermissionError as exc:
            return _error("forbidden", f"{kind}: {exc}")

    def _on_status(self, request, peer, reply_to):
        reg = self.registry
        return proto.StatusReply(
            version=self.info["version"],
            protocol=proto.PROTOCOL_VERSION,
            pid=os.getpid(),
            uptime_s=round(time.monotonic() - self.info["started"], 3),
            socket=self.info["socket"],
            lock_dirs=[d.path for d in reg.lock_dirs()],
            namespaces=len(reg.views),
            generations=sum(1 for v in reg.views.values() if v.generation is not None),
            participants=sum(v.live for v in reg.views.values()),
            registered=len(reg.participants),
            held=sorted(reg.holds),
            draining=sorted(reg.draining) + sorted(f"base:{b}" for b in reg.draining_bases),
            metrics_port=self.info["metrics"].port,
        )

    def _on_ls(self, request, peer, reply_to):
        self.registry.scan()
        now = time.time()
        rows = []
        for view in sorted(self.registry.views.values(), key=lambda v: v.namespace):
            pages = segment_dir.page_info(view.shm_dir)
            rows.append(proto.GenerationRow(
                namespace=view.namespace,
                manager=view.manager,
                generation=view.generation or 0,
                state=self.registry.row_state(view),
                participants=view.live,
                bytes=view.bytes,
                age=round(max(0.0, now - view.created_at), 3) if view.created_at else 0.0,
                base=view.base,
                shm_dir=view.shm_dir,
                page_size=pages.size,
                pages=pages.describe(),
                sleeping=sum(1 for member in view.members if member[2] == "sleeping"),
                weights_version=view.weights_version,
                members=[proto.MemberRow(pid=pid, slot=slot, state=state, weights_version=version)
                         for pid, slot, state, version in view.members],
            ))
        return proto.ListReply(rows=rows)

    def _on_register(self, request: proto.RegisterRequest, peer, reply_to):
        peer = self._need_peer(peer, "register")
        ns = self._valid_ns(request.namespace)
        lock_dir = self._lock_dir(request.lock_dir, peer, "register")
        self._labels(ns, request.base, request.manager)
        base = request.base or self.registry.labels.get(ns, (None, None))[0]
        if self.registry.is_draining(ns, base, lock_dir.uid):
            raise _Refused("draining", f"namespace {ns} is draining (ftd drain): the daemon accepts no new "
                                       "participants for it; undo with `ftd drain --undo`")
        owner = segment_owner_uid(ns)
        if owner is not None and owner != lock_dir.uid:
            raise _Refused("forbidden", f"namespace {ns} belongs to uid {owner}, not to the owner of {lock_dir.path}")
        view = self.registry.views.get(ns)
        if view is not None and view.lock_dir.path != lock_dir.path:
            raise _Refused("conflict", f"namespace {ns} is journaled in {view.lock_dir.path}, not in {lock_dir.path}: "
                                       "workers of one namespace must share TMPDIR")
        self.registry.learn_lock_dir(lock_dir)
        view = self.registry.view_for(ns, lock_dir)  # read-only: no need to act as the owner
        try:
            self.registry.register(view, request.slot_index, request.identity, peer.pid, peer.uid)
        except LookupError as exc:
            raise _Refused("not_found", str(exc)) from None
        except IndexError as exc:
            raise _Refused("bad_request", str(exc)) from None
        except RuntimeError as exc:
            raise _Refused("conflict", str(exc)) from None
        self.info["metrics"].registrations.inc()
        self.registry.update_gauges()
        return proto.OkReply(message=f"watching {request.identity.describe()} in {ns}")

    def _on_unregister(self, request: proto.UnregisterRequest, peer, reply_to):
        peer = self._need_peer(peer, "unregister")
        ns = self._valid_ns(request.namespace)
        participant = self.registry.participants.get((ns, request.identity.token))
        if participant is None or participant.identity != request.identity:
            raise _Refused("not_found", f"{request.identity.describe()} is not registered in {ns}")
        if peer.uid != 0 and participant.uid is not None and participant.uid != peer.uid:
            raise _Refused("forbidden", f"unregister refused: {request.identity.describe()} was registered by uid "
                                        f"{participant.uid}")
        self.registry.unwatch(ns, request.identity.token)
        return proto.OkReply(message=f"stopped watching {request.identity.describe()} in {ns}")

    def _on_drain(self, request: proto.DrainRequest, peer, reply_to):
        peer = self._need_peer(peer, "drain")
        reg = self.registry
        namespaces = [self._valid_ns(ns) for ns in request.namespaces]
        for ns, manager in zip(namespaces, request.managers):
            self._labels(ns, request.base, manager)
        whole_base = request.base if not namespaces else None  # no namespaces: every one labelled with the base
        if not namespaces and whole_base is None:
            raise _Refused("bad_request", "drain needs namespaces or a base namespace")
        fallback = peer.uid
        if request.lock_dir:
            try:
                fallback = inspect_lock_dir(request.lock_dir).uid
            except OSError:
                pass
        targets = list(namespaces)
        if whole_base is not None:
            # Every user's drain of a base is its own (registry.is_draining): another user's drain of the same
            # name neither blocks this one nor is undone by it. Only the requester's own namespaces are targets.
            targets = [v.namespace for v in reg.views.values() if v.base == whole_base
                       and (peer.uid == 0 or self._owner_uid(v.namespace, v.lock_dir.uid) == peer.uid)]
        for ns in targets:
            self._authorize(ns, peer, "drain", fallback_owner=fallback)
        released = []
        if request.undo:
            for ns in targets:
                reg.undrain(ns, peer.uid)
            if whole_base is not None:
                reg.undrain_base(whole_base, peer.uid)
            what = ", ".join(targets) or f"base {request.base}"
            return proto.OkReply(message=f"no longer draining {what}")
        for ns in targets:
            reg.draining.setdefault(ns, set()).add(peer.uid)
            hold = reg.holds.pop(ns, None)
            if hold is not None:
                try:
                    self._release(hold)
                except TimeoutError:
                    reg.holds[ns] = hold  # still held and heartbeating: keep it known (and releasable)
                    raise
                released.append(ns)
        if whole_base is not None:
            reg.draining_bases.setdefault(whole_base, set()).add(peer.uid)
        what = ", ".join(targets) if targets else "no known namespace yet"
        base = f" (base {request.base!r}: future registrations refused too)" if not namespaces else ""
        extra = f"; released the hold on {', '.join(released)}" if released else ""
        return proto.OkReply(message=f"draining {what}{base}{extra}; each generation is reclaimed as soon as its last "
                                     "participant leaves")

    def _release(self, hold) -> str:
        # The caller removed the hold from the registry: record that first, so a daemon killed right after
        # leaving the slot never finds the hold in <socket>.state and re-takes what the user released.
        self.info.get("save_state", lambda: None)()
        remaining = drop_hold(hold)
        if remaining:
            return f"released {hold.namespace}; {remaining} participant(s) remain"
        view = self.registry.views.get(hold.namespace)
        if view is None:
            view = self.registry.view_for(hold.namespace, hold.lock_dir)
        self.registry.refresh(view)
        report = self.reaper.reclaim(view, "release")
        if report is None:
            return f"released {hold.namespace}; it will be reclaimed at the next scan"
        return f"released {hold.namespace}; it was the last participant: generation {report.generation} reclaimed"

    def _on_hold(self, request: proto.HoldRequest, peer, reply_to):
        peer = self._need_peer(peer, "hold")
        ns = self._valid_ns(request.namespace)
        self._labels(ns, request.base, request.manager)
        lock_dir = self._lock_dir(request.lock_dir, peer, "hold")
        owner = self._authorize(ns, peer, "hold", fallback_owner=lock_dir.uid)
        if owner is not None and owner != lock_dir.uid:
            raise _Refused("forbidden", f"hold refused: namespace {ns} belongs to uid {owner}, not to the owner of "
                                        f"{lock_dir.path}")
        base = request.base or self.registry.labels.get(ns, (None, None))[0]
        if self.registry.is_draining(ns, base, owner if owner is not None else lock_dir.uid):
            raise _Refused("draining", f"hold refused: namespace {ns} is draining")
        if ns in self.registry.holds:
            return proto.OkReply(message=f"already holding {ns} generation {self.registry.holds[ns].generation}")
        hold = take_hold(ns, lock_dir, owner if owner is not None else lock_dir.uid)
        self.registry.holds[ns] = hold
        self.registry.learn_lock_dir(lock_dir)
        view = self.registry.view_for(ns, lock_dir)
        self.registry.refresh(view)
        return proto.OkReply(message=f"holding {ns} generation {hold.generation}")

    def _on_release(self, request: proto.ReleaseRequest, peer, reply_to):
        peer = self._need_peer(peer, "release")
        ns = self._valid_ns(request.namespace)
        hold = self.registry.holds.get(ns)
        if hold is None:
            raise _Refused("not_found", f"the daemon holds no generation of {ns}")
        if peer.uid not in (0, hold.owner_uid):
            raise _Refused("forbidden", f"release refused: namespace {ns} belongs to uid {hold.owner_uid}, the "
                                        f"requester is uid {peer.uid}")
        try:
            del self.registry.holds[ns]
            return proto.OkReply(message=self._release(hold))
        except TimeoutError as exc:
            self.registry.holds[ns] = hold
            raise _Refused("busy", str(exc)) from None

    def _on_cleanup(self, request: proto.CleanupRequest, peer, reply_to):
        peer = self._need_peer(peer, "cleanup")
        namespaces = [self._valid_ns(ns) for ns in request.namespaces]
        if not namespaces:
            raise _Refused("bad_request", "cleanup needs at least one namespace")
        if len(namespaces) > MAX_CLEANUP_NAMESPACES:
            raise _Refused("bad_request", f"cleanup of {len(namespaces)} namespaces in one request: at most "
                                          f"{MAX_CLEANUP_NAMESPACES}")
        if not (request.timeout >= 0 and request.timeout <= 3600):
            raise _Refused("bad_request", f"cleanup timeout {request.timeout!r} must be within [0, 3600] seconds")
        for ns, manager in zip(namespaces, request.managers):
            self._labels(ns, request.base, manager)
        try:
            lock_dir = self._lock_dir(request.lock_dir, peer, "cleanup")
        except _Refused as exc:
            if exc.code != "not_found":
                raise
            for ns in namespaces:
                self._authorize(ns, peer, "clean up")
                if segment_owner_uid(ns) is not None:
                    raise _Refused("conflict", f"coordinator segment of {ns} exists but the lock directory "
                                               f"{request.lock_dir} (its journal) does not: run cleanup with the "
                                               "workers' TMPDIR") from None
            return proto.CleanupReply(reports=[proto.CleanupRow(namespace=ns, generation=None, removed=[],
                                                                already_absent=[], waited_s=0.0)
                                               for ns in namespaces])
        queued = sum(1 for job in self.reaper.pending if job.uid == peer.uid)
        if queued >= MAX_PENDING_CLEANUPS_PER_UID:
            raise _Refused("busy", f"cleanup refused: uid {peer.uid} already has {queued} cleanups waiting (at most "
                                   f"{MAX_PENDING_CLEANUPS_PER_UID}); wait for them to finish, or use a shorter "
                                   "--timeout")
        for ns in namespaces:
            owner = self._authorize(ns, peer, "clean up", fallback_owner=lock_dir.uid)
            if owner is not None and owner != lock_dir.uid:
                raise _Refused("forbidden", f"cleanup refused: namespace {ns} belongs to uid {owner}, not to the owner "
                                            f"of {lock_dir.path}")
            if ns in self.registry.holds:
                raise _Refused("conflict", f"the daemon holds {ns}: `ftd release` it first")
        job = PendingCleanup(reply_to=reply_to, lock_dir=lock_dir, namespaces=namespaces,
                             deadline=time.monotonic() + request.timeout, uid=peer.uid)
        self.reaper.add_pending(job)
        for frames, reply in self.reaper.poll_pending():
            if frames is reply_to:
                return reply
            self.info["send"](frames, reply)
        return None
