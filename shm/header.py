"""The coordinator segment's header page: a fixed binary layout that every participant validates first.

The coordinator segment ``/{ns}.c`` is one 4 KiB header page followed by the lease table (``leases.py``).
It is the only shared state a process reads before it knows whether the other side speaks its protocol, so
the layout is fixed, versioned and checked before any other byte is trusted.

Byte order is the host's native order (the segment never leaves the host); every field sits at an offset
aligned to its own size, so the state and the lease heartbeats can be read and written with single aligned
4/8-byte loads and stores (``ctypes.c_uint32/c_uint64.from_buffer``), which other processes never see torn.

Header page (protocol 3, ``HEADER_SIZE`` = 4096 bytes)::

    offset size  field             meaning
    0      8     magic             b"FLXTNSR\\0"
    8      4     protocol          u32, PROTOCOL_VERSION (3); another value -> ShmProtocolError
    12     4     header_size       u32, 4096: the lease table starts here
    16     16    library_version   ASCII, NUL padded: flextensor.__version__ of the creator
    32     4     state             u32, State: 1 INITIALIZING, 2 READY, 3 FAILED (aligned store)
    36     4     slot_count        u32, number of lease slots after the header (1..4096)
    40     8     generation        u64, >= 1, one per creator election in this namespace
    48     8     lease_ns          u64, the creator's lease length (each slot also carries its own)
    56     8     created_at_ns     u64, wall clock (time.time_ns) when the creator wrote the header
    64     4     slot_size         u32, 128 (bytes per lease slot)
    68     4     creator_slot      u32, index of the creator's lease slot
    72     48    creator identity  see "identity record" below
    120    4     failure_len       u32, bytes of failure message used (<= FAILURE_CAPACITY)
    124    4     reserved          0
    128    2048  failure message   UTF-8, truncated with TRUNCATION_MARKER when longer
    2176   8     weights_version   u64, version of the weights in the host copy (0: as the creator published
                                   them; each update_weights stores a larger one; aligned store)
    2184   4     update_state      u32, UpdateState: 0 IDLE, 1 WRITING (an update is writing the host copy),
                                   2 TORN (an update stopped midway); rules in ``activity.py``
    2188   1908  reserved          0

Identity record (48 bytes, relative to its start)::

    0  4   pid            u32
    4  4   reserved       0
    8  8   start_time     u64, clock ticks after boot (/proc/<pid>/stat field 22)
    16 16  boot_id        the 128-bit boot id (/proc/sys/kernel/random/boot_id) as raw UUID bytes
    32 16  token          16 random bytes (the identity's hex token, decoded)

State machine: the creator writes the whole page with state INITIALIZING (magic last, all under the
coordinator lock), publishes its data and manifests through ``ShmOwner``, then stores READY — or, on
failure, stores the message bytes, then ``failure_len``, then FAILED. The state is always the last store of
a publication, so a reader that sees READY/FAILED with an aligned load sees everything written before it:
x86-64 keeps stores in program order (TSO). On weakly ordered CPUs (aarch64) Python offers no fence; there
the ordering rests on the system calls between the steps (unmapping the manifest blob before READY, opening
and mapping segments after it), which is believed but not proven sufficient. States never go back to
INITIALIZING.
"""

from __future__ import annotations

import ctypes
import enum
import struct
import uuid

import msgspec

from flextensor.shm.errors import ShmProtocolError
from flextensor.shm.identity import ParticipantIdentity
from flextensor.shm.names import coordinator_segment_name
from flextensor.shm.segment import SharedSegment

__all__ = [
    "MAGIC",
    "PROTOCOL_VERSION",
    "HEADER_SIZE",
    "SLOT_SIZE",
    "DEFAULT_SLOT_COUNT",
    "FAILURE_CAPACITY",
    "TRUNCATION_MARKER",
    "State",
    "HeaderInfo",
    "library_version",
    "LIBRARY_VERSION",
    "coordinator_segment_size",
    "write_header",
    "validate_header",
    "open_coordinator_segment",
    "AbortedCreationError",
    "read_state",
    "store_state",
    "write_failure",
    "read_failure",
    "bound_message",
    "pack_identity",
    "unpack_identity",
    "load_u32",
    "load_u64",
    "store_u32",
    "store_u64",
]

MAGIC = b"FLXTNSR\x00"
PROTOCOL_VERSION = 3  # 2: 128-byte lease slots with pid namespace and flags; 3: activity and weights versions
HEADER_SIZE = 4096
SLOT_SIZE = 128
DEFAULT_SLOT_COUNT = 128
MAX_SLOT_COUNT = 4096
FAILURE_CAPACITY = 2048
TRUNCATION_MARKER = " ...[truncated]"
LIBRARY_VERSION_BYTES = 16
IDENTITY_BYTES = 48

OFF_MAGIC = 0
OFF_PROTOCOL = 8
OFF_HEADER_SIZE = 12
OFF_LIBRARY_VERSION = 16
OFF_STATE = 32
OFF_SLOT_COUNT = 36
OFF_GENERATION = 40
OFF_LEASE_NS = 48
OFF_CREATED_AT = 56
OFF_SLOT_SIZE = 64
OFF_CREATOR_SLOT = 68
OFF_CREATOR = 72
OFF_FAILURE_LEN = 120
OFF_FAILURE = 128
OFF_WEIGHTS_VERSION = 2176
OFF_UPDATE_STATE = 2184

_IDENTITY = struct.Struct("=II Q 16s 16s")  # pid, reserved, start_time, boot_id, token
assert _IDENTITY.size == IDENTITY_BYTES


class State(enum.IntEnum):
    """Lifecycle of one generation, stored at offset 32."""

    INITIALIZING = 1
    READY = 2
    FAILED = 3


class HeaderInfo(msgspec.Struct, frozen=True):
    """A validated snapshot of the header page (everything but the reserved bytes)."""

    segment: str
    protocol: int
    header_size: int
    library_version: str
    state: State
    slot_count: int
    slot_size: int
    generation: int
    lease_ns: int
    created_at_ns: int
    creator_slot: int
    creator: ParticipantIdentity
    failure_message: str


def library_version() -> str:
    """flextensor's version, from ``shm/_version.py`` (the lowest layer: nothing here imports upwards)."""
    from flextensor.shm._version import __version__

    return __version__


#: flextensor.__version__ of this process, as stored in headers, journals and manifests.
LIBRARY_VERSION = library_version()


def coordinator_segment_size(slot_count: int = DEFAULT_SLOT_COUNT) -> int:
    """Bytes of a coordinator segment with ``slot_count`` lease slots."""
    return HEADER_SIZE + slot_count * SLOT_SIZE


# ---------------------------------------------------------------------------------------------------------
# aligned scalar access: one machine load/store each, so concurrent readers never see a torn value


def load_u32(buf: memoryview, offset: int) -> int:
    assert offset % 4 == 0
    return ctypes.c_uint32.from_buffer(buf, offset).value


def load_u64(buf: memoryview, offset: int) -> int:
    assert offset % 8 == 0
    return ctypes.c_uint64.from_buffer(buf, offset).value


def store_u32(buf: memoryview, offset: int, value: int) -> None:
    assert offset % 4 == 0
    ctypes.c_uint32.from_buffer(buf, offset).value = value


def store_u64(buf: memoryview, offset: int, value: int) -> None:
    assert offset % 8 == 0
    ctypes.c_uint64.from_buffer(buf, offset).value = value


# ---------------------------------------------------------------------------------------------------------
# identity records


def _token_bytes(token: str) -> bytes:
    raw = bytes.fromhex(token)
    if len(raw) != 16:
        raise ValueError(f"participant token {token!r} must be 32 hex characters (16 bytes)")
    return raw


def pack_identity(identity: ParticipantIdentity) -> bytes:
    """The 48-byte identity record (layout in the module docstring)."""
    return _IDENTITY.pack(
        identity.pid, 0, identity.start_time, uuid.UUID(identity.boot_id).bytes, _token_bytes(identity.token)
    )


def unpack_identity(raw: bytes | memoryview) -> ParticipantIdentity:
    pid, _reserved, start_time, boot, token = _IDENTITY.unpack(bytes(raw))
    return ParticipantIdentity(pid=pid, start_time=start_time, boot_id=str(uuid.UUID(bytes=boot)),
                               token=token.hex())


# ---------------------------------------------------------------------------------------------------------
# writing (creator, under the coordinator lock)


def write_header(
    buf: memoryview,
    *,
    generation: int,
    lease_ns: int,
    slot_count: int,
    creator: ParticipantIdentity,
    creator_slot: int,
    created_at_ns: int,
) -> None:
    """Fill a fresh (zeroed) header page with state INITIALIZING; the magic is stored last, so a reader that
    races the creator sees "not a coordinator yet" rather than a half-written header."""
    if len(buf) < coordinator_segment_size(slot_count):
        raise ValueError(f"coordinator buffer of {len(buf)} bytes is too small for {slot_count} slots")
    version = library_version().encode("ascii")
    if len(version) > LIBRARY_VERSION_BYTES:
        raise ValueError(f"library version {version!r} is longer than {LIBRARY_VERSION_BYTES} bytes")
    struct.pack_into("=II", buf, OFF_PROTOCOL, PROTOCOL_VERSION, HEADER_SIZE)
    buf[OFF_LIBRARY_VERSION:OFF_LIBRARY_VERSION + LIBRARY_VERSION_BYTES] = version.ljust(LIBRARY_VERSION_BYTES,
                                                                                      b"\x00")
    store_u32(buf, OFF_SLOT_COUNT, slot_count)
    store_u64(buf, OFF_GENERATION, generation)
    store_u64(buf, OFF_LEASE_NS, lease_ns)
    store_u64(buf, OFF_CREATED_AT, created_at_ns)
    store_u32(buf, OFF_SLOT_SIZE, SLOT_SIZE)
    store_u32(buf, OFF_CREATOR_SLOT, creator_slot)
    buf[OFF_CREATOR:OFF_CREATOR + IDENTITY_BYTES] = pack_identity(creator)
    store_u32(buf, OFF_FAILURE_LEN, 0)
    store_u32(buf, OFF_STATE, State.INITIALIZING)
    buf[OFF_MAGIC:OFF_MAGIC + len(MAGIC)] = MAGIC


def bound_message(message: str) -> bytes:
    """UTF-8 bytes of ``message``, at most FAILURE_CAPACITY, cut on a character boundary and marked."""
    data = message.encode("utf-8", errors="replace")
    if len(data) <= FAILURE_CAPACITY:
        return data
    marker = TRUNCATION_MARKER.encode("ascii")
    head = data[: FAILURE_CAPACITY - len(marker)].decode("utf-8", errors="ignore").encode("utf-8")
    return head + marker


def write_failure(buf: memoryview, message: str) -> None:
    """Publish FAILED with ``message``: message bytes, then their length, then the state (in that order)."""
    data = bound_message(message)
    buf[OFF_FAILURE:OFF_FAILURE + len(data)] = data
    store_u32(buf, OFF_FAILURE_LEN, len(data))
    store_u32(buf, OFF_STATE, State.FAILED)


def store_state(buf: memoryview, state: State) -> None:
    store_u32(buf, OFF_STATE, int(state))


# ---------------------------------------------------------------------------------------------------------
# reading (anyone; validate first)


def read_state(buf: memoryview, segment: str = "coordinator segment") -> State:
    value = load_u32(buf, OFF_STATE)
    try:
        return State(value)
    except ValueError:
        raise ShmProtocolError(
            f"{segment}: header state {value} is not one of INITIALIZING/READY/FAILED; the segment is corrupt: "
            f"{force_remedy(segment)}"
        ) from None


def read_failure(buf: memoryview) -> str:
    length = min(load_u32(buf, OFF_FAILURE_LEN), FAILURE_CAPACITY)
    return bytes(buf[OFF_FAILURE:OFF_FAILURE + length]).decode("utf-8", errors="replace")


def force_remedy(segment: str) -> str:
    """The way out of metadata nobody can trust: plain cleanup refuses it (it never guesses), a forced one
    removes everything derivable from the namespace's name."""
    ns = segment.lstrip("/").removesuffix(".c")
    return (f"nothing was removed. Stop every worker of namespace {ns}, then run cleanup with force: "
            f"`ftd cleanup {ns} --force` (or SharedOffloadSession.cleanup_namespace(..., force=True)), which "
            f"removes /dev/shm/{ns}.*, /dev/shm/sem.{ns}.* and the namespace's files in the lock directory")


def _protocol_error(segment: str, problem: str, fix: str | None = None) -> ShmProtocolError:
    fix = fix or (force_remedy(segment) + " (or, if the segment was written by another flextensor version, run "
                  "cleanup with that version)")
    return ShmProtocolError(f"coordinator segment {segment}: {problem}; {fix}")


def validate_header(buf: memoryview, segment: str, segment_size: int | None = None) -> HeaderInfo:
    """Check magic, protocol, header size and segment size before trusting any other byte.

    ``segment`` is the POSIX name, used in messages. Raises ``ShmProtocolError`` for a truncated segment,
    bad magic (including a header still all zeros), another protocol version or inconsistent sizes.
    """
    size = len(buf) if segment_size is None else segment_size
    if size < HEADER_SIZE or len(buf) < HEADER_SIZE:
        raise _protocol_error(segment, f"it is truncated: {size} bytes, smaller than the {HEADER_SIZE}-byte header")
    magic = bytes(buf[OFF_MAGIC:OFF_MAGIC + len(MAGIC)])
    if magic != MAGIC:
        what = "all zeros (its creator died while writing it?)" if not any(magic) else repr(magic)
        raise _protocol_error(segment, f"bad magic {what}, expected {MAGIC!r}: it is not a flextensor "
                                       "coordinator segment or it is corrupt")
    protocol, header_size = struct.unpack_from("=II", buf, OFF_PROTOCOL)
    if protocol != PROTOCOL_VERSION:
        raw_version = bytes(buf[OFF_LIBRARY_VERSION:OFF_LIBRARY_VERSION + LIBRARY_VERSION_BYTES])
        other = raw_version.rstrip(b"\x00").decode("ascii", errors="replace")
        raise _protocol_error(
            segment,
            f"protocol version {protocol} (written by flextensor {other!r}), this flextensor "
            f"{library_version()} speaks protocol {PROTOCOL_VERSION}",
            "restart all workers with the same flextensor version, and run cleanup for this namespace with the "
            "version that created it",
        )
    if header_size != HEADER_SIZE:
        raise _protocol_error(segment, f"header size {header_size}, expected {HEADER_SIZE}")
    slot_count = load_u32(buf, OFF_SLOT_COUNT)
    slot_size = load_u32(buf, OFF_SLOT_SIZE)
    if slot_size != SLOT_SIZE or not 1 <= slot_count <= MAX_SLOT_COUNT:
        raise _protocol_error(segment, f"lease table of {slot_count} slots x {slot_size} bytes is invalid "
                                       f"(expected 1..{MAX_SLOT_COUNT} slots of {SLOT_SIZE} bytes)")
    needed = coordinator_segment_size(slot_count)
    if size < needed or len(buf) < needed:
        raise _protocol_error(segment, f"it is truncated: {min(size, len(buf))} bytes, the header declares "
                                       f"{slot_count} slots needing {needed} bytes")
    raw_version = bytes(buf[OFF_LIBRARY_VERSION:OFF_LIBRARY_VERSION + LIBRARY_VERSION_BYTES])
    try:
        version = raw_version.rstrip(b"\x00").decode("ascii")
    except UnicodeDecodeError:
        raise _protocol_error(segment, f"library version field {raw_version!r} is not ASCII") from None
    generation = load_u64(buf, OFF_GENERATION)
    if generation < 1:
        raise _protocol_error(segment, "generation 0 is invalid")
    creator_slot = load_u32(buf, OFF_CREATOR_SLOT)
    if creator_slot >= slot_count:
        raise _protocol_error(segment, f"creator slot {creator_slot} is outside the {slot_count}-slot table")
    failure_len = load_u32(buf, OFF_FAILURE_LEN)
    if failure_len > FAILURE_CAPACITY:
        raise _protocol_error(segment, f"failure message length {failure_len} exceeds {FAILURE_CAPACITY}")
    try:
        creator = unpack_identity(buf[OFF_CREATOR:OFF_CREATOR + IDENTITY_BYTES])
    except ValueError as exc:
        raise _protocol_error(segment, f"creator identity is malformed ({exc})") from None
    return HeaderInfo(
        segment=segment,
        protocol=protocol,
        header_size=header_size,
        library_version=version,
        state=read_state(buf, segment),
        slot_count=slot_count,
        slot_size=slot_size,
        generation=generation,
        lease_ns=load_u64(buf, OFF_LEASE_NS),
        created_at_ns=load_u64(buf, OFF_CREATED_AT),
        creator_slot=creator_slot,
        creator=creator,
        failure_message=read_failure(buf),
    )



class AbortedCreationError(ShmProtocolError):
    """The coordinator segment exists but was never completely written (empty, or magic still zero).

    The creator writes the header under the coordinator lock and the magic last, so a process that *holds
    that lock* and still sees this knows the creator died while creating it: the election and cleanup code
    reclaim such a segment. Without the lock it may simply be a creation in progress.
    """


def open_coordinator_segment(namespace: str) -> tuple[SharedSegment, HeaderInfo]:
    """Map ``/{namespace}.c`` and validate its header; the caller closes the segment.

    ``FileNotFoundError`` when it does not exist; ``AbortedCreationError`` when it is empty or its magic is
    still zero; ``ShmProtocolError`` for anything else untrustworthy.
    """
    name = coordinator_segment_name(namespace)
    try:
        segment = SharedSegment.open(name)
    except FileNotFoundError:
        raise
    except ValueError as exc:  # the only ValueError of open() with min_size=0: the segment is empty
        raise AbortedCreationError(
            f"coordinator segment {name}: it is empty ({exc}); its creator died while creating it, or is "
            "creating it right now"
        ) from None
    try:
        if len(segment.buffer) >= len(MAGIC) and not any(segment.buffer[: len(MAGIC)]):
            raise AbortedCreationError(
                f"coordinator segment {name}: its magic is still zero; its creator died while writing the "
                "header, or is writing it right now"
            )
        header = validate_header(segment.buffer, name, segment.size)
    except BaseException:
        segment.close()
        raise
    return segment, header
