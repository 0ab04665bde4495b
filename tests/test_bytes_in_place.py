"""service.transport.bytes_in_place: a ``bytes`` object drafted at its largest, written, then cut,
reads back as the same ``bytes`` made the usual way, and nothing writes into it once it is out."""

from __future__ import annotations

import gc
import sys

import pytest

from service.transport.bytes_in_place import AVAILABLE, Draft


def test_this_interpreter_lays_bytes_out_as_the_draft_expects():
    """On CPython the check at import holds: were it to fail, replies would still be right but
    copied (``StepReply.output`` None), so a CPython where it does is worth knowing of."""
    assert sys.implementation.name == "cpython"
    assert AVAILABLE


@pytest.mark.parametrize("length", [2, 100, 4095, 4096])
def test_a_draft_written_and_cut_is_the_bytes_written(length):
    want = bytes(range(256)) * 16
    draft = Draft(4096)
    draft.write(0, want[:10])
    view = draft.view(10, 4096 - 10)
    view[:] = want[10:]
    got = draft.finish(length)
    assert type(got) is bytes and len(got) == length
    assert got == want[:length] and hash(got) == hash(want[:length])
    assert got + b"!" == want[:length] + b"!" and got.endswith(want[length - 1 : length])
    assert bytes(memoryview(got)) == want[:length]


def test_finish_releases_every_view_so_nothing_writes_after():
    draft = Draft(64)
    view = draft.view(0, 64)
    view[:] = b"a" * 64
    got = draft.finish(32)
    with pytest.raises(ValueError):
        view[0] = 0
    assert got == b"a" * 32


def test_a_view_keeps_the_object_alive_after_the_draft_is_dropped():
    draft = Draft(64)
    view = draft.view(8, 16)
    del draft  # the view alone holds the object now
    gc.collect()
    view[:] = b"b" * 16  # still the object's memory
    assert view.obj.owner[8:24] == b"b" * 16


def test_discard_releases_the_views():
    draft = Draft(64)
    view = draft.view(0, 8)
    draft.discard()
    with pytest.raises(ValueError):
        view[0] = 0


def test_writes_views_and_lengths_outside_the_draft_are_refused():
    draft = Draft(16)
    with pytest.raises(ValueError):
        draft.write(10, b"x" * 7)
    with pytest.raises(ValueError):
        draft.view(8, 9)
    with pytest.raises(ValueError):
        draft.finish(17)
    with pytest.raises(ValueError):
        draft.finish(0)
    with pytest.raises(ValueError):
        Draft(1)
    assert draft.finish(16) is not None
