"""The benchmarks' writer of docs/benchmarks.md (bench/common.py): one section replaced, the rest untouched."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))

import common  # noqa: E402

DOC = """# Benchmarks

Intro, kept as is.  Trailing spaces too.  \n
## Shared memory

What it measures.

<!-- bench:bench_shm:start -->
old shm table
<!-- bench:bench_shm:end -->

## Engine

<!-- bench:bench_engine:start -->
old engine table
<!-- bench:bench_engine:end -->
tail without a final newline"""


def test_replaces_only_its_section() -> None:
    new = common.replace_docs_section(DOC, "bench_shm", "| a | b |\n|---|---|\n| 1 | 2 |\n")
    start, end = common.docs_markers("bench_shm")
    before, rest = DOC.split(start)
    _, after = rest.split(end)
    assert new == before + start + "\n| a | b |\n|---|---|\n| 1 | 2 |\n" + end + after
    assert "old shm table" not in new
    assert "old engine table" in new
    # Replacing again with the same body changes nothing (a run twice in a row leaves one copy).
    assert common.replace_docs_section(new, "bench_shm", "| a | b |\n|---|---|\n| 1 | 2 |") == new


def test_write_docs_section_leaves_the_rest_byte_identical(tmp_path: Path) -> None:
    path = tmp_path / "benchmarks.md"
    path.write_bytes(DOC.encode())
    body = common.docs_body([("Table", "| x |\n|---|\n| 1 |")])
    assert body.startswith("Latest run: ") and " UTC; machine: " in body
    common.write_docs_section("bench_engine", body, path)
    text = path.read_bytes().decode()
    start, end = common.docs_markers("bench_engine")
    assert text.split(start)[0] == DOC.split(start)[0]
    assert text.split(end)[1] == DOC.split(end)[1]
    assert "**Table**\n\n| x |" in text
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]  # no temporary file left behind


@pytest.mark.parametrize("doc", [
    DOC.replace("<!-- bench:bench_shm:end -->", ""),
    DOC.replace("<!-- bench:bench_shm:start -->", ""),
    DOC + "\n<!-- bench:bench_shm:start -->\n",
])
def test_missing_or_repeated_marker_is_a_clear_error(doc: str) -> None:
    with pytest.raises(ValueError, match=r"bench:bench_shm:(start|end).*exactly once"):
        common.replace_docs_section(doc, "bench_shm", "body")


def test_markers_out_of_order() -> None:
    start, end = common.docs_markers("bench_shm")
    doc = DOC.replace(start, "@@").replace(end, start).replace("@@", end)
    with pytest.raises(ValueError, match="comes before"):
        common.replace_docs_section(doc, "bench_shm", "body")


def test_unknown_section_names_the_fix(tmp_path: Path) -> None:
    path = tmp_path / "benchmarks.md"
    path.write_text(DOC)
    with pytest.raises(ValueError, match="bench:bench_daemon:start"):
        common.write_docs_section("bench_daemon", "body", path)
    assert path.read_text() == DOC
