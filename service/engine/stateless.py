"""The stateless ``DecodeStep``: a step over caches the client sends, validated in full before
it is computed (``backends.reference.gqa_decode_step``). No engine state is involved.
"""

from __future__ import annotations

import logging

from backends.reference import gqa_decode_step
from backends.validation import check_cache_tensors, check_heads, check_step_tensors

from ..errors import Internal, InvalidArgument, ServiceError

__all__ = ["check_stateless", "stateless_step"]

log = logging.getLogger("gqa.engine")


def check_stateless(query, new_key, new_value, key_cache, value_cache, hq: int, hkv: int) -> None:
    """Validation of a stateless ``DecodeStep``'s tensors (``InvalidArgument`` naming the
    field): every failure of the request is found here, before the computation."""
    try:
        check_heads(hq, hkv)
        check_step_tensors(query, new_key, new_value, hq, hkv)
        check_cache_tensors(key_cache, value_cache, query, hkv)
    except (TypeError, ValueError) as exc:
        raise InvalidArgument(str(exc)) from None


def stateless_step(query, new_key, new_value, key_cache, value_cache, hq: int, hkv: int) -> dict:
    """A stateless decode step (``backends.reference.gqa_decode_step``) over checked
    tensors; what it raises is a fault, not the caller's: ``Internal``."""
    try:
        return gqa_decode_step(query, new_key, new_value, key_cache, value_cache, hq, hkv)
    except ServiceError:
        raise
    except Exception:
        log.exception("DecodeStep failed")
        raise Internal("internal error") from None
