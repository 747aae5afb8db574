"""Wire protocol between ``ftd`` (the per-host daemon) and its clients: workers and the ``ftd`` CLI.

It lives in ``flextensor.shm`` rather than in the daemon because workers register with the daemon from the
coordinator / session layer, and imports only point downwards (daemon -> shm, client -> shm): a worker must
be able to speak to ``ftd`` without importing ``flextensor.daemon``.

Transport
---------
ZeroMQ over ``ipc://<socket path>``: the daemon binds a ROUTER socket, each client request uses a fresh
DEALER socket (so a late reply to an abandoned request can never be mistaken for the next one's).  One
request frame, one reply frame; a REQ-style empty delimiter frame before the payload is accepted too.
The daemon learns who is asking from the kernel: libzmq puts the peer's ``SO_PEERCRED`` (uid, gid, pid) in
the ``Peer-Address`` message property of ipc connections; no credential travels in the payload.

Frames
------
Each frame is one msgpack map encoding a msgspec Struct of the tagged union below: the ``type`` key names
the message, the ``v`` key carries ``PROTOCOL_VERSION``.  The daemon first decodes only ``{v, type}``
(:class:`Envelope`) so that a client of another protocol version gets an ``unsupported_version`` error
rather than a decoding error.  Frames longer than ``MAX_FRAME_BYTES`` get a ``too_large`` error reply;
frames longer than ``HARD_FRAME_LIMIT`` are dropped by libzmq itself (``ZMQ_MAXMSGSIZE``: the connection
is closed before the bytes are buffered), so a hostile peer cannot make the daemon allocate without bound.

Every request is answered with exactly one reply: the request's own reply type, or :class:`ErrorReply`
(``code`` is one of ``ERROR_CODES``).  Unknown fields are rejected (``forbid_unknown_fields``) so that a
typo in a hand-written client is an error instead of a silently ignored option.

Namespaces on the wire are always *per-manager* namespaces (``names.manager_namespace(base, manager)``);
``base``/``manager`` travel alongside only as labels for humans (``ftd ls``) and for ``drain`` of a base.
"""

from __future__ import annotations

from typing import Union

import msgspec

from flextensor.shm.identity import ParticipantIdentity

__all__ = [
    "PROTOCOL_VERSION",
    "MAX_FRAME_BYTES",
    "HARD_FRAME_LIMIT",
    "ERROR_CODES",
    "Envelope",
    "StatusRequest",
    "ListRequest",
    "RegisterRequest",
    "UnregisterRequest",
    "DrainRequest",
    "HoldRequest",
    "ReleaseRequest",
    "CleanupRequest",
    "OkReply",
    "ErrorReply",
    "StatusReply",
    "GenerationRow",
    "ListReply",
    "CleanupRow",
    "CleanupReply",
    "Request",
    "Reply",
    "encode",
    "decode_request",
    "decode_reply",
    "ProtocolDecodeError",
]

#: Version of this wire protocol (independent of the SHM header protocol in ``header.py``).
PROTOCOL_VERSION = 1
#: Largest request/reply frame accepted and answered (64 KiB: the largest legitimate request is a cleanup
#: of a few dozen namespaces; ``ls`` replies of thousands of rows stay far below the hard limit).
MAX_FRAME_BYTES = 64 * 1024
#: Frames above this are dropped by libzmq (``ZMQ_MAXMSGSIZE``) without an answer.
HARD_FRAME_LIMIT = 1024 * 1024
#: Replies may be larger than requests (``ls`` with many generations); clients accept up to this.
MAX_REPLY_BYTES = HARD_FRAME_LIMIT

#: ``ErrorReply.code`` values.
ERROR_CODES = (
    "bad_request",  # undecodable, unknown type, invalid field value, truncated frame
    "unsupported_version",  # ``v`` is not PROTOCOL_VERSION
    "too_large",  # frame longer than MAX_FRAME_BYTES
    "forbidden",  # requester is not the namespace's owner (nor root), or its credentials are unknown
    "not_found",  # no such namespace / generation / hold / registration
    "draining",  # registration refused: the namespace is draining
    "conflict",  # e.g. hold of a generation that is not READY, slot identity mismatch
    "busy",  # the namespace is locked by someone else right now; retry
    "timeout",  # a cleanup's leases stayed live (or its lock taken) until its timeout
    "internal",  # the daemon failed; see its log
)


class ProtocolDecodeError(ValueError):
    """A frame that is not a valid message of this protocol (``code`` tells which ``ERROR_CODES`` applies)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class Envelope(msgspec.Struct):
    """The two keys every message has; decoded first to check the version before the full schema."""

    type: str
    v: int


class _Message(msgspec.Struct, tag_field="type", kw_only=True, forbid_unknown_fields=True):
    v: int = PROTOCOL_VERSION


# ------------------------------------------------------------------------------------------------ requests


class StatusRequest(_Message, tag="status"):
    """Is the daemon up; version, uptime and counts."""


class ListRequest(_Message, tag="ls"):
    """One row per generation the daemon knows about (all users' namespaces: the view is read-only)."""


class RegisterRequest(_Message, tag="register"):
    """A participant that joined ``namespace``'s lease table at ``slot_index`` asks to be watched.

    ``lock_dir`` is the participant's lock directory (where the namespace's journal lives).  The daemon
    watches the *sending* process (pidfd of the SO_PEERCRED pid, whose start time must equal
    ``identity.start_time``), falling back to ``identity.pid`` when sender and participant differ but share
    the daemon's pid namespace.
    """

    namespace: str
    slot_index: int
    identity: ParticipantIdentity
    lock_dir: str
    base: str | None = None
    manager: str | None = None


class UnregisterRequest(_Message, tag="unregister"):
    """The participant left cleanly (its lease slot is free): stop watching it."""

    namespace: str
    slot_index: int
    identity: ParticipantIdentity


class DrainRequest(_Message, tag="drain"):
    """Refuse new registrations for ``namespaces`` (per-manager) or, with none, for every namespace whose
    ``base`` is the given one; ``undo`` lifts the drain."""

    namespaces: list[str] = []
    base: str | None = None
    managers: list[str] = []
    lock_dir: str | None = None
    undo: bool = False


class HoldRequest(_Message, tag="hold"):
    """The daemon joins the current READY generation of ``namespace`` as a participant and heartbeats."""

    namespace: str
    lock_dir: str
    base: str | None = None
    manager: str | None = None


class ReleaseRequest(_Message, tag="release"):
    """The daemon leaves the generation it holds in ``namespace`` (reclaiming it if it was the last)."""

    namespace: str


class CleanupRequest(_Message, tag="cleanup"):
    """Reclaim ``namespaces`` like ``cleanup_manager_namespace``, waiting at most ``timeout`` seconds in all."""

    namespaces: list[str]
    lock_dir: str
    timeout: float = 0.0
    base: str | None = None
    managers: list[str] = []


Request = Union[
    StatusRequest,
    ListRequest,
    RegisterRequest,
    UnregisterRequest,
    DrainRequest,
    HoldRequest,
    ReleaseRequest,
    CleanupRequest,
]

# ------------------------------------------------------------------------------------------------- replies


class OkReply(_Message, tag="ok"):
    message: str = ""


class ErrorReply(_Message, tag="error"):
    code: str
    message: str


class StatusReply(_Message, tag="status_reply"):
    version: str
    protocol: int
    pid: int
    uptime_s: float
    socket: str
    lock_dirs: list[str]
    namespaces: int
    generations: int
    participants: int
    registered: int
    held: list[str]
    draining: list[str]
    metrics_port: int | None = None


class MemberRow(msgspec.Struct, forbid_unknown_fields=True):
    """One live participant of a generation in ``ftd ls --json`` (``members``)."""

    pid: int
    slot: int
    state: str  # serving / sleeping / updating (its lease slot's activity, shm/activity.py), or held (ftd hold)
    weights_version: int  # the weights version its model holds


class GenerationRow(msgspec.Struct, forbid_unknown_fields=True):
    """One row of ``ftd ls``; the JSON keys of ``ftd ls --json`` are exactly these field names."""

    namespace: str  # the per-manager namespace (what names the segments)
    manager: str | None
    generation: int
    state: str  # INITIALIZING / READY / FAILED / DRAINING / STALE (older generation with leftovers)
    participants: int
    bytes: int
    age: float  # seconds since the generation's creator wrote its header
    base: str | None = None  # the base namespace it derives from, when known (journal, registration, request)
    shm_dir: str = "/dev/shm"  # the directory of its segments (the journal's)
    page_size: int = 4096  # bytes per page its segments get there (segment_dir.page_info)
    pages: str = ""  # how that directory gives them, e.g. "2 MiB pages (tmpfs huge=always)"
    sleeping: int = 0  # live participants whose models sleep (ft.sleep)
    weights_version: int = 0  # the version of the weights in its host copy (0: as published; update_weights)
    members: list[MemberRow] = []  # the live participants, each with its state


class ListReply(_Message, tag="ls_reply"):
    rows: list[GenerationRow]


class CleanupRow(msgspec.Struct, forbid_unknown_fields=True):
    namespace: str
    generation: int | None
    removed: list[str]
    already_absent: list[str]
    waited_s: float


class CleanupReply(_Message, tag="cleanup_reply"):
    reports: list[CleanupRow]


Reply = Union[OkReply, ErrorReply, StatusReply, ListReply, CleanupReply]

_encoder = msgspec.msgpack.Encoder()
_envelope_decoder = msgspec.msgpack.Decoder(Envelope)
_request_decoder = msgspec.msgpack.Decoder(Request)
_reply_decoder = msgspec.msgpack.Decoder(Reply)
_REQUEST_TAGS = frozenset(t.__struct_config__.tag for t in Request.__args__)  # type: ignore[attr-defined]
_REPLY_TAGS = frozenset(t.__struct_config__.tag for t in Reply.__args__)  # type: ignore[attr-defined]


def encode(message: msgspec.Struct) -> bytes:
    """One frame for ``message``."""
    return _encoder.encode(message)


def _check_envelope(frame: bytes, tags: frozenset[str], what: str) -> None:
    try:
        env = _envelope_decoder.decode(frame)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolDecodeError("bad_request", f"malformed {what} frame: {exc}") from None
    if env.v != PROTOCOL_VERSION:
        raise ProtocolDecodeError(
            "unsupported_version",
            f"{what} uses ftd protocol {env.v}; this side speaks protocol {PROTOCOL_VERSION}: use the same "
            "flextensor version for the daemon and its clients",
        )
    if env.type not in tags:
        raise ProtocolDecodeError("bad_request", f"unknown {what} type {env.type[:40]!r}")


def decode_request(frame: bytes) -> Request:
    """Parse a request frame; :class:`ProtocolDecodeError` for anything that is not a valid request."""
    if len(frame) > MAX_FRAME_BYTES:
        raise ProtocolDecodeError("too_large", f"request of {len(frame)} bytes exceeds {MAX_FRAME_BYTES}")
    _check_envelope(frame, _REQUEST_TAGS, "request")
    try:
        return _request_decoder.decode(frame)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolDecodeError("bad_request", f"invalid request: {exc}") from None


def decode_reply(frame: bytes) -> Reply:
    """Parse a reply frame; :class:`ProtocolDecodeError` for anything that is not a valid reply."""
    if len(frame) > MAX_REPLY_BYTES:
        raise ProtocolDecodeError("too_large", f"reply of {len(frame)} bytes exceeds {MAX_REPLY_BYTES}")
    _check_envelope(frame, _REPLY_TAGS, "reply")
    try:
        return _reply_decoder.decode(frame)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolDecodeError("bad_request", f"invalid reply: {exc}") from None
