"""A private tensor's pages given back as its copy advances (flextensor.runtime.source_pages): only where nothing else
can read them, and then page by page behind the copy."""

from __future__ import annotations

import mmap

import numpy as np
import pytest
import torch
from torch import nn

from flextensor.runtime.source_pages import SourcePages, releasable
from tests.helpers.process_memory import status_bytes

MIB = 1 << 20


def _weight(nbytes: int = 4 * MIB) -> nn.Parameter:
    return nn.Parameter(torch.arange(nbytes // 4, dtype=torch.float32), requires_grad=False)


def test_a_parameter_that_alone_uses_its_storage_is_releasable() -> None:
    weight = _weight()
    assert releasable(weight)
    linear = nn.Linear(1024, 1024)  # a module's own parameters, as a factory builds them
    assert releasable(linear.weight)


@pytest.mark.parametrize("other_user", [
    "detached alias", "data alias", "second parameter", "view", "numpy buffer", "byte buffer", "transposed",
    "offset view", "meta", "tiny",
])
def test_tensors_another_reader_can_see_are_never_releasable(other_user: str) -> None:
    weight = _weight()
    keep = []
    if other_user == "detached alias":
        keep.append(weight.detach())
        tensor = weight
    elif other_user == "data alias":
        keep.append(weight.data)
        tensor = weight
    elif other_user == "second parameter":
        keep.append(nn.Parameter(weight.data, requires_grad=False))
        tensor = weight
    elif other_user == "view":
        tensor = weight
        keep.append(weight[10:20])
    elif other_user == "numpy buffer":
        array = np.zeros(MIB, dtype=np.float32)
        keep.append(array)
        tensor = torch.from_numpy(array)
    elif other_user == "byte buffer":
        tensor = torch.frombuffer(bytearray(4 * MIB), dtype=torch.float32)
    elif other_user == "transposed":
        tensor = nn.Parameter(torch.zeros(1024, 1024).t(), requires_grad=False)
    elif other_user == "offset view":  # covers only part of its storage; the rest stays readable through it
        tensor = nn.Parameter(torch.zeros(2 * MIB)[MIB:], requires_grad=False)
    elif other_user == "meta":
        tensor = torch.empty(MIB, device="meta")
    else:  # less than a page: nothing to give back
        tensor = nn.Parameter(torch.zeros(16), requires_grad=False)
    assert not releasable(tensor)


def test_pages_go_back_behind_the_copy_and_only_whole_copied_pages() -> None:
    nbytes = 64 * MIB
    weight = nn.Parameter(torch.ones(nbytes // 4), requires_grad=False)
    assert releasable(weight)
    copy = torch.empty_like(weight.data)
    pages = SourcePages(weight)
    half = nbytes // 2 + 100  # not on a page edge: the page it cuts stays until the next step
    copy[: half // 4].copy_(weight.detach()[: half // 4])
    before = status_bytes("RssAnon")
    pages.through(half)
    first = pages.released_bytes
    assert nbytes // 2 - mmap.PAGESIZE <= first <= half
    assert before - status_bytes("RssAnon") >= first - 2 * MIB  # the kernel took them (room for other threads)
    assert weight.detach()[(half // mmap.PAGESIZE * mmap.PAGESIZE) // 4:].eq(1).all()  # the rest untouched
    copy[half // 4:].copy_(weight.detach()[half // 4:])
    pages.through(nbytes)
    assert nbytes - mmap.PAGESIZE <= pages.released_bytes <= nbytes
    assert copy.eq(1).all()  # the copy holds every byte
    pages.through(nbytes)  # nothing more to give back: a no-op
    assert pages.released_bytes <= nbytes
