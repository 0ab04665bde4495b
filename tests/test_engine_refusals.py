"""Engine.counting_open_refusals: a refusal raised by the translation layer counts as an open
refused for reason ``invalid``; anything else passes through uncounted."""

from __future__ import annotations

import pytest

from service.config import ServerConfig
from service.engine.engine import Engine, EngineObserver
from service.errors import InvalidArgument


class Refusals(EngineObserver):
    def __init__(self):
        self.reasons: list[str] = []

    def open_refused(self, reason: str) -> None:
        self.reasons.append(reason)


def test_service_errors_count_and_propagate_others_do_not():
    observer = Refusals()
    engine = Engine(ServerConfig(metrics_port=0, workers=1), observer=observer)
    try:
        with pytest.raises(InvalidArgument), engine.counting_open_refusals():
            raise InvalidArgument("open.head_dim: 0")
        assert observer.reasons == ["invalid"]
        with pytest.raises(KeyError), engine.counting_open_refusals():
            raise KeyError("not a refusal")
        with engine.counting_open_refusals():
            pass
        assert observer.reasons == ["invalid"]
    finally:
        engine.stop()
