"""The ownership journal: exact format, strict validation, and that a bad journal makes nothing disappear."""

from __future__ import annotations

import json
import os
import stat

import pytest

from flextensor.shm.cleanup import cleanup_manager_namespace
from flextensor.shm.coordinator import ShmCoordinator
from flextensor.shm.errors import ShmProtocolError
from flextensor.shm.header import LIBRARY_VERSION
from flextensor.shm.journal import (
    Intent,
    append_intent,
    create_journal,
    list_journals,
    read_journal,
    remove_journal,
)
from flextensor.shm.leases import LeaseTable
from flextensor.shm.names import journal_path, lock_directory, manager_namespace


@pytest.fixture
def ns(namespace: str) -> str:
    return manager_namespace(namespace, "journal")


def test_format_round_trip_and_mode(ns):
    path = create_journal(ns, 3)
    append_intent(ns, "segment", f"/{ns}.g3.sd", 3)
    append_intent(ns, "semaphore", f"/{ns}.g3.lb0", 3)
    append_intent(ns, "lockfile", f"{ns}.g3.lb0.lock", 3)
    append_intent(ns, "segment", f"/{ns}.g3.sd", 3)  # a retried setup may journal twice
    assert path == journal_path(ns) and stat.S_IMODE(os.stat(path).st_mode) == 0o600
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines[0] == {"record": "header", "protocol": 1, "library_version": LIBRARY_VERSION, "namespace": ns,
                        "generation": 3, "shm_dev": os.stat("/dev/shm").st_dev}
    assert lines[1] == {"record": "intent", "kind": "segment", "name": f"/{ns}.g3.sd", "generation": 3}
    journal = read_journal(ns)
    assert read_journal(path) == journal
    assert journal.generation == 3 and journal.namespace == ns and len(journal.intents) == 4
    assert journal.resources() == [
        Intent("segment", f"/{ns}.g3.sd", 3),
        Intent("semaphore", f"/{ns}.g3.lb0", 3),
        Intent("lockfile", f"{ns}.g3.lb0.lock", 3),
    ]
    assert list_journals() == [ns] and list_journals(lock_directory()) == [ns]
    with pytest.raises(FileExistsError):
        create_journal(ns, 4)
    assert remove_journal(ns) and not remove_journal(ns)
    assert list_journals() == []
    with pytest.raises(FileNotFoundError):
        read_journal(ns)


def test_append_refuses_foreign_names(ns):
    create_journal(ns, 1)
    for kind, name in [("segment", "/other.g1.sd"), ("segment", f"/{ns}.g2.sd"), ("lockfile", f"../{ns}.g1.x.lock"),
                       ("semaphore", f"/{ns}.c")]:
        with pytest.raises(ShmProtocolError, match="refusing|differs"):
            append_intent(ns, kind, name, 1)
    assert read_journal(ns).intents == []
    remove_journal(ns)


def _write(ns: str, lines: list[str], *, newline: bool = True) -> None:
    journal_path(ns).write_text("\n".join(lines) + ("\n" if newline else ""))


def _header(ns: str, protocol: int = 1, generation: int = 1) -> str:
    return json.dumps({"record": "header", "protocol": protocol, "library_version": "0.1.0", "namespace": ns,
                       "generation": generation})


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda ns: [_header(ns, protocol=2)], r"line 1: journal protocol 2"),
        (lambda ns: [_header(ns), "{not json"], r"line 2: malformed record"),
        (lambda ns: [_header(ns), '{"record": "intent", "kind": "disk", "name": "x", "generation": 1}'],
         r"line 2: malformed record"),
        (lambda ns: [_header(ns), json.dumps({"record": "intent", "kind": "segment", "name": f"/{ns}.g1.sd",
                                              "generation": 1, "extra": 1})], r"line 2: malformed record"),
        (lambda ns: [_header(ns), json.dumps({"record": "intent", "kind": "segment", "name": "/etc.g1.passwd",
                                              "generation": 1})], r"line 2: .*refusing to touch it"),
        (lambda ns: [_header(ns), json.dumps({"record": "intent", "kind": "segment", "name": f"/{ns}.g2.sd",
                                              "generation": 2})], r"line 2: .*differs"),
        (lambda ns: [_header(ns), _header(ns)], r"line 2: a second header"),
        (lambda ns: [json.dumps({"record": "intent", "kind": "segment", "name": "/x", "generation": 1})],
         r"line 1: the first line is not a journal header"),
        (lambda ns: [_header("ftother-0000000000000000")], r"line 1: the header names namespace"),
        (lambda ns: [_header(ns, generation=0)], r"line 1: generation 0"),
    ],
)
def test_malformed_journal_raises_naming_file_and_line(ns, make, match):
    _write(ns, make(ns))
    with pytest.raises(ShmProtocolError, match=match) as info:
        read_journal(ns)
    assert str(journal_path(ns)) in str(info.value)
    journal_path(ns).unlink()


def test_incomplete_and_empty_journal(ns):
    _write(ns, [_header(ns), '{"record": "intent"'], newline=False)
    with pytest.raises(ShmProtocolError, match="line 2: the last line is incomplete"):
        read_journal(ns)
    _write(ns, [], newline=False)
    with pytest.raises(ShmProtocolError, match="empty"):
        read_journal(ns)
    journal_path(ns).unlink()


@pytest.mark.parametrize("damage", ["malformed", "protocol"])
def test_bad_journal_means_nothing_is_deleted(ns, damage):
    c = ShmCoordinator(ns, lease_seconds=1.0)
    c.memory_owner.write_blob("p", b"precious")
    c.notify_ready()
    with LeaseTable.open(ns) as table:
        table.end_lease(c.lease_slot)  # as if ftd saw it die: no live lease, cleanup would proceed
    path = journal_path(ns)
    good = path.read_bytes()
    if damage == "malformed":
        path.write_bytes(good + b"garbage\n")
        match = "line 3: malformed"
    else:
        path.write_bytes(good.replace(b'"protocol":1', b'"protocol":7'))
        match = "line 1: journal protocol 7"
    with pytest.raises(ShmProtocolError, match=match):
        cleanup_manager_namespace(ns, timeout=0)
    with pytest.raises(ShmProtocolError, match=match):  # an election does not guess either
        ShmCoordinator(ns, lease_seconds=1.0, timeout=1)
    assert sorted(n for n in os.listdir("/dev/shm") if ns in n) == sorted([f"{ns}.c", f"{ns}.g1.p"])
    path.write_bytes(good)  # repaired: cleanup goes through
    report = cleanup_manager_namespace(ns, timeout=0)
    assert report.generation == 1 and f"/{ns}.g1.p" in report.removed and f"/{ns}.c" in report.removed
    c.close()  # everything is gone already: close only tidies the lock file it re-created
    assert [n for n in os.listdir("/dev/shm") if ns in n] == []


def test_journal_in_an_explicit_lock_dir(ns, tmp_path):
    """Every journal function reaches another lock directory through lock_dir= (what ftd does for its users)."""
    other = tmp_path / "flextensor-other"
    other.mkdir(mode=0o700)
    path = create_journal(ns, 2, lock_dir=other)
    assert path == other / f"{ns}.journal"
    append_intent(ns, "segment", f"/{ns}.g2.sd", 2, lock_dir=other)
    journal = read_journal(ns, lock_dir=other)
    assert journal.path == str(path) and [i.name for i in journal.intents] == [f"/{ns}.g2.sd"]
    assert list_journals(other) == [ns] and list_journals() == []
    with pytest.raises(FileNotFoundError):
        read_journal(ns)  # this process's own lock directory has no such journal
    assert remove_journal(ns, lock_dir=other) and not path.exists()
    assert not remove_journal(ns, lock_dir=other)
