"""Namespace validation, compact derived names, hash stability and the private lock directory."""

from __future__ import annotations

import hashlib
import os
import stat
import tempfile
from pathlib import Path

import pytest

from flextensor.shm import names
from flextensor.shm.names import (
    compute_shm_namespace,
    coordinator_lock_path,
    coordinator_segment_name,
    generation_resource_name,
    journal_path,
    lock_directory,
    manager_namespace,
    resolve_lock_directory,
    segment_name,
    validate_base_namespace,
    validate_manager_name,
    validate_namespace,
)

BAD_USER_NAMES = [
    ("", "empty"),
    ("/", "'/'"),
    ("a/b", "'/'"),
    ("a\x00b", "NUL"),
    ("..", "'..'"),
    ("a..b", "'..'"),
    ("bell\x07", "non-printable"),
    ("zero\u200bwidth", "non-printable"),
    ("a b", "whitespace"),
    ("tab\there", "whitespace"),
    ("line\n", "whitespace"),
    ("x" * 201, "201 characters"),
    (None, "NoneType"),
    (42, "int"),
    (b"bytes", "bytes"),
]


@pytest.mark.parametrize(
    ("validator", "argument"),
    [(validate_base_namespace, "base namespace"), (validate_manager_name, "manager name")],
)
@pytest.mark.parametrize(("value", "reason"), BAD_USER_NAMES)
def test_bad_user_names_are_refused_with_a_named_argument(validator, argument, value, reason):
    with pytest.raises(ValueError) as info:
        validator(value)
    message = str(info.value)
    assert argument in message
    assert reason in message
    assert repr(value)[:20] in message  # the offending value is shown (truncated when long)
    assert "must be" in message  # ... and what is allowed


def test_long_bad_values_are_truncated_in_the_message():
    with pytest.raises(ValueError) as info:
        validate_base_namespace("y" * 5000)
    assert len(str(info.value)) < 400
    assert "..." in str(info.value)


@pytest.mark.parametrize("value", ["a", "model-x_1.2", "Llama-3.1-8B", "x" * 200, "modèle", "ns:v2@rev"])
def test_valid_user_names_are_returned_unchanged(value):
    assert validate_base_namespace(value) == value
    assert validate_manager_name(value) == value


@pytest.mark.parametrize(
    "value", ["", ".", "..", "a..b", ".hidden", "-opt", "a/b", "a b", "é", "x" * 65, None, 7]
)
def test_validate_namespace_refuses(value):
    with pytest.raises(ValueError, match="namespace"):
        validate_namespace(value)


@pytest.mark.parametrize("value", ["ft-0123", "a", "a.b-c_d", "x" * 64])
def test_validate_namespace_accepts(value):
    assert validate_namespace(value) == value


def test_manager_namespace_shape_and_formula():
    ns = manager_namespace("meta-llama:Llama-3", "default")
    digest = hashlib.blake2b(b"meta-llama:Llama-3\x00default", digest_size=8).hexdigest()
    assert ns == f"ftmeta-llama_L-{digest}"
    assert validate_namespace(ns) == ns


def test_manager_namespace_is_stable_across_versions():
    # A changed hash would orphan every namespace of a running host after an upgrade: pin the exact value.
    assert manager_namespace("base", "mgr") == "ftbase-" + hashlib.blake2b(b"base\x00mgr", digest_size=8).hexdigest()
    assert manager_namespace("base", "mgr") == manager_namespace("base", "mgr")
    assert compute_shm_namespace("gpt2") == compute_shm_namespace("gpt2")


def test_manager_namespace_separates_inputs():
    seen = {
        manager_namespace("model", "a"),
        manager_namespace("model", "b"),
        manager_namespace("modelx", "a"),
        manager_namespace("a", "bc"),
        manager_namespace("ab", "c"),
    }
    assert len(seen) == 5


def test_manager_namespace_validates_its_arguments():
    with pytest.raises(ValueError, match="manager name"):
        manager_namespace("ok", "bad/name")
    with pytest.raises(ValueError, match="base namespace"):
        manager_namespace("..", "ok")


@pytest.mark.parametrize(("base", "manager"), [("b" * 200, "m" * 200), ("ü" * 200, "€" * 200), ("a", "b")])
def test_every_derived_name_is_compact(base, manager):
    ns = manager_namespace(base, manager)
    assert len(ns) <= 31
    derived = [
        coordinator_segment_name(ns),
        generation_resource_name(ns, 10**9, "b65535"),
        generation_resource_name(ns, 0, "sd"),
        generation_resource_name(ns, 2**32, "l" + "k" * 15),
        "sem." + generation_resource_name(ns, 3, "l0")[1:],
        coordinator_lock_path(ns).name,
        journal_path(ns).name,
    ]
    for name in derived:
        assert len(name) < 64, name
        assert "/" not in name.lstrip("/")


def test_derived_name_formats():
    ns = manager_namespace("base", "mgr")
    assert coordinator_segment_name(ns) == f"/{ns}.c"
    assert generation_resource_name(ns, 3, "b0") == f"/{ns}.g3.b0"
    assert segment_name(ns, "g1.sm") == f"/{ns}.g1.sm"
    for bad in (-1, True, 1.0, "1"):
        with pytest.raises(ValueError, match="generation"):
            generation_resource_name(ns, bad, "b0")
    for bad in ("", "0b", "a/b", "a.b", "a" * 17):
        with pytest.raises(ValueError, match="kind"):
            generation_resource_name(ns, 0, bad)
    for bad in ("", ".x", "x.", "a/b", "a..b"):
        with pytest.raises(ValueError, match="suffix"):
            segment_name(ns, bad)
    with pytest.raises(ValueError, match="namespace"):
        coordinator_segment_name("../etc")


def test_compute_shm_namespace_inputs():
    identity = {"model": "meta-llama/Llama-3-8B", "revision": "abc", "dtype": "bfloat16"}
    ns = compute_shm_namespace(identity)
    assert ns.startswith("ftmeta-llama_L-")
    assert len(ns) <= 31 and validate_namespace(ns) == ns and validate_base_namespace(ns) == ns
    reordered = {"dtype": "bfloat16", "revision": "abc", "model": "meta-llama/Llama-3-8B"}
    assert compute_shm_namespace(reordered) == ns  # key order does not matter
    assert compute_shm_namespace({**identity, "dtype": "float16"}) != ns
    assert compute_shm_namespace("gpt2") != compute_shm_namespace(b"gpt2")
    assert compute_shm_namespace(b"\x00\xff").startswith("ft-")
    custom = compute_shm_namespace("gpt2", prefix="job7")
    assert custom.startswith("job7gpt2-") and custom[-16:] == compute_shm_namespace("gpt2")[-16:]
    long_ns = compute_shm_namespace("q" * 10_000)
    assert len(long_ns) <= 31


@pytest.mark.parametrize("identity", ["", 3.5, None, ["model"], {"model": float("nan")}])
def test_compute_shm_namespace_refuses_bad_identity(identity):
    with pytest.raises(ValueError, match="identity"):
        compute_shm_namespace(identity)


@pytest.mark.parametrize("prefix", ["", "1ft", "f/t", "toolongprefix", "f.t"])
def test_compute_shm_namespace_refuses_bad_prefix(prefix):
    with pytest.raises(ValueError, match="prefix"):
        compute_shm_namespace("gpt2", prefix=prefix)


def test_lock_directory_is_private_and_under_tmpdir(isolated_host):
    path = lock_directory()
    assert path == Path(os.environ["TMPDIR"]) / f"flextensor-{os.getuid()}"
    st = os.lstat(path)
    assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.getuid()
    assert lock_directory() == path  # idempotent
    assert coordinator_lock_path("ns1") == path / "ns1.lock"
    assert journal_path("ns1") == path / "ns1.journal"


def test_explicit_lock_dir_is_used_as_given(isolated_host, tmp_path):
    """ftd passes another user's lock directory: paths go there, and nothing is created or checked."""
    other = tmp_path / "flextensor-12345"
    assert resolve_lock_directory(other) == other and resolve_lock_directory(str(other)) == other
    assert coordinator_lock_path("ns1", other) == other / "ns1.lock"
    assert journal_path("ns1", str(other)) == other / "ns1.journal"
    assert not other.exists()
    assert not (isolated_host / f"flextensor-{os.getuid()}").exists()  # the default one was not touched
    with pytest.raises(ValueError, match="namespace"):
        journal_path("../x", other)
    assert resolve_lock_directory() == lock_directory() == isolated_host / f"flextensor-{os.getuid()}"


def test_lock_directory_follows_tmpdir_at_call_time(tmp_path, monkeypatch):
    other = tmp_path / "elsewhere"
    other.mkdir()
    monkeypatch.setenv("TMPDIR", str(other))
    assert lock_directory() == other / f"flextensor-{os.getuid()}"
    assert (other / f"flextensor-{os.getuid()}").is_dir()


def test_lock_directory_refuses_group_writable(isolated_host):
    path = lock_directory()
    os.chmod(path, 0o770)
    with pytest.raises(PermissionError, match="chmod 700"):
        lock_directory()


def test_lock_directory_refuses_symlink(isolated_host, tmp_path):
    target = tmp_path / "target"
    target.mkdir(mode=0o700)
    (Path(tempfile.gettempdir()) / f"flextensor-{os.getuid()}").symlink_to(target)
    with pytest.raises(PermissionError, match="symlink"):
        lock_directory()


@pytest.mark.skipif(os.getuid() != 0, reason="changing a directory's owner needs root")
def test_lock_directory_of_a_foreign_owner_is_passed_over_for_a_fallback_of_ours(isolated_host, caplog):
    path = lock_directory()
    os.chown(path, 12345, -1)
    fallback = path.with_name(path.name + ".1")
    try:
        with caplog.at_level("WARNING", logger="flextensor.shm.names"):
            assert lock_directory() == fallback == names.lock_directory_path()
        assert f"lock directory {path} belongs to uid 12345" in caplog.text and f"using {fallback}" in caplog.text
        assert os.stat(fallback).st_uid == os.getuid() and os.stat(fallback).st_mode & 0o777 == 0o700
        path.rmdir()  # the other user gives the name back: the journals live in the fallback now, it stays
        assert lock_directory() == fallback and not path.exists()
    finally:
        if path.exists():
            os.chown(path, os.getuid(), -1)
        fallback.rmdir()


def test_module_does_not_import_torch():
    import subprocess
    import sys

    code = "import sys, flextensor.shm.names, flextensor.shm.segment, flextensor.shm.locks, " \
           "flextensor.shm.identity, flextensor.shm.pinning; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
    assert names.MAX_USER_NAME_LENGTH == 200
