"""A ``bytes`` object written in place before anything else sees it: the buffer a ``Batch`` step
reply is built in, so the kernel writes each output row straight into the message grpc sends
(``service.transport.batch_reply``; docs/design.md, "The step reply written in place").

grpc's Python API sends ``bytes`` and nothing else, and a ``bytes`` object's size is fixed when
it is made, while the reply's last fields (the step's numbers) are only known after the
computation. CPython's C API has the three moves this needs: make a ``bytes`` object of a given
size with its contents unset (``PyBytes_FromStringAndSize(NULL, n)``), let its maker fill it,
and let its maker shorten it before it is shared (what ``_PyBytes_Resize`` does when it
shrinks in place: the size field set, the byte after the last set to 0). ``Draft`` does them
through ``ctypes``: a reply is drafted at its largest size, written, then cut to its length.

The module checks at import that this interpreter lays a ``bytes`` object out as it expects
(its size field and its first byte where ``Draft`` writes them, a fresh object written and cut
reading back as the bytes written, hashed and compared as any other); ``AVAILABLE`` is False
where that does not hold, and callers copy instead.
"""

from __future__ import annotations

import ctypes
import sys

__all__ = ["AVAILABLE", "Draft"]

_new = ctypes.pythonapi.PyBytes_FromStringAndSize
_new.restype = ctypes.py_object  # a new reference, which ctypes takes over
_new.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t)

_SIZE_AT = ctypes.sizeof(ctypes.c_ssize_t) + ctypes.sizeof(ctypes.c_void_p)  # after ob_refcnt, ob_type
_DATA_AT = bytes.__basicsize__ - 1  # ob_sval: the header, then the bytes (and one more, the 0)


class Draft:
    """A ``bytes`` object of ``capacity`` bytes, unset, that only its maker holds: ``write`` and
    ``view`` fill it, ``finish(length)`` cuts it to its first ``length`` bytes and returns it.
    Nothing may write into it after ``finish``: the views handed out are released there."""

    __slots__ = ("_obj", "_address", "_capacity", "_views")

    def __init__(self, capacity: int):
        if capacity < 2:  # 0 and 1 byte objects may be the interpreter's shared ones
            raise ValueError(f"Draft: capacity {capacity} is below 2")
        self._obj = _new(None, capacity)
        self._address = id(self._obj) + _DATA_AT
        self._capacity = capacity
        self._views: list[memoryview] = []

    def write(self, at: int, data: bytes) -> None:
        """``data`` at offset ``at``."""
        if not 0 <= at <= self._capacity - len(data):
            raise ValueError(f"Draft.write: {len(data)} bytes at {at} pass its {self._capacity}")
        ctypes.memmove(self._address + at, data, len(data))

    def view(self, at: int, n: int) -> memoryview:
        """A writable view of bytes [at, at + n), released by ``finish`` and ``discard``; it
        keeps the object alive while it exists."""
        if not (0 <= at and n >= 0 and at + n <= self._capacity):
            raise ValueError(f"Draft.view: [{at}, {at + n}) passes its {self._capacity} bytes")
        memory = (ctypes.c_char * n).from_address(self._address + at)
        memory.owner = self._obj  # the view's memory is the object's
        view = memoryview(memory).cast("B")
        self._views.append(view)
        return view

    def finish(self, length: int) -> bytes:
        """The object, cut to its first ``length`` bytes; the draft is spent."""
        if not 0 < length <= self._capacity:
            raise ValueError(f"Draft.finish: length {length} is not in (0, {self._capacity}]")
        obj = self._obj
        self.discard()  # no write after this: the object is about to be shared
        ctypes.c_ssize_t.from_address(id(obj) + _SIZE_AT).value = length
        ctypes.c_char.from_address(id(obj) + _DATA_AT + length).value = b"\0"
        return obj

    def discard(self) -> None:
        """Spends the draft unfinished: its views released, the object dropped."""
        self._obj = None
        for view in self._views:
            view.release()
        self._views = []


def _lays_out_bytes_as_expected() -> bool:
    """A draft written, viewed and cut reads back as the same ``bytes`` made the usual way."""
    if sys.implementation.name != "cpython":
        return False
    try:
        want = bytes(range(7, 107))
        draft = Draft(160)
        if ctypes.c_ssize_t.from_address(id(draft._obj) + _SIZE_AT).value != 160:
            return False
        if ctypes.cast(draft._obj, ctypes.c_void_p).value != draft._address:
            return False
        draft.write(0, want[:40])
        draft.view(40, 60)[:] = want[40:]
        got = draft.finish(100)
        return len(got) == 100 and got == want and hash(got) == hash(want) and got[-1:] == want[-1:]
    except Exception:
        return False


AVAILABLE = _lays_out_bytes_as_expected()
