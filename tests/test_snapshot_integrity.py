"""Snapshots a client may have altered: consistency checks always, signatures with a key (#17 item 5)."""

from __future__ import annotations

import grpc
import pytest
import torch

from service.api import gqa_pb2
from service.config import ConfigError, ServerConfig, load_snapshot_key
from service.engine import snapshot
from service.server import ServerThread
from tests.client import CHANNEL_OPTIONS, Session, open_message

HQ, HKV, D = 4, 2, 8
STRICT = dict(policy="strict", window=4)
KEY = "k" * 24


def _server(**kwargs) -> ServerThread:
    return ServerThread(ServerConfig(address="127.0.0.1:0", metrics_port=0, **kwargs))


def _steps(g, n):
    return [
        (torch.randn(1, HQ, D, generator=g), torch.randn(1, HKV, D, generator=g), torch.randn(1, HKV, D, generator=g))
        for _ in range(n)
    ]


def _copy(chunks):
    return [gqa_pb2.SnapshotChunk.FromString(c.SerializeToString()) for c in chunks]


def _with_tokens(chunks, t):
    out = _copy(chunks)
    out[0].tokens_seen[0] = t
    return out


def _refusal(channel, chunks) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        Session(channel, restore=chunks)
    return info.value


def _six_token_stream(channel):
    g = torch.Generator().manual_seed(3)
    session = Session(channel, open_message(hq=HQ, hkv=HKV, d=D, **STRICT))
    for x in _steps(g, 6):
        session.step(0, *x)
    return session


@pytest.fixture(scope="module")
def plain():
    with _server() as srv, grpc.insecure_channel(srv.address, options=CHANNEL_OPTIONS) as ch:
        yield srv, ch


@pytest.fixture(scope="module")
def signing():
    with _server(snapshot_key=KEY) as srv, grpc.insecure_channel(srv.address, options=CHANNEL_OPTIONS) as ch:
        yield srv, ch


@pytest.mark.parametrize("t", [2**64 - 1, snapshot.MAX_TOKENS])
def test_an_impossible_token_count_is_refused_at_restore(plain, t):
    """Before: accepted (the CRC covers data only, and L(T) of a full strict window is W for
    any T), then the first step ended the RPC with INTERNAL (T + 1 overflowed the reply)."""
    server, channel = plain
    session = _six_token_stream(channel)
    reserved = server.engine.bytes_reserved
    error = _refusal(channel, _with_tokens(session.snapshot(), t))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "tokens_seen[0]" in error.details()
    assert server.engine.bytes_reserved == reserved
    session.close()


def test_unsigned_snapshots_say_what_their_checksum_cannot_catch(plain):
    """Without a key, T 6 -> 7 on a full strict window has the same rows: the server cannot
    tell, which is why the documents point to the snapshot key."""
    _, channel = plain
    session = _six_token_stream(channel)
    chunks = session.snapshot()
    assert not chunks[-1].signature
    moved = Session(channel, restore=_with_tokens(chunks, 7))
    assert list(moved.opened.tokens_seen) == [7]
    moved.close()
    session.close()


def test_signed_snapshot_restores_bit_identically(signing):
    _, channel = signing
    g = torch.Generator().manual_seed(4)
    session = _six_token_stream(channel)
    chunks = session.snapshot()
    assert len(chunks[-1].signature) == 32
    moved = Session(channel, restore=chunks)
    for x in _steps(g, 5):
        assert torch.equal(moved.output(moved.step(0, *x)), session.output(session.step(0, *x)))
    moved.close()
    session.close()


@pytest.mark.parametrize(
    "alter,word",
    [
        (lambda c: _with_tokens(c, 7), "signature does not match"),
        (lambda c: [*_copy(c)[:-1], _unsigned(c[-1])], "carries no signature"),
        (lambda c: _resigned(c, b"another key, 24 bytes.."), "signature does not match"),
    ],
    ids=["token-count", "signature-removed", "other-key"],
)
def test_a_signing_server_refuses_altered_snapshots(signing, alter, word):
    server, channel = signing
    session = _six_token_stream(channel)
    reserved = server.engine.bytes_reserved
    error = _refusal(channel, alter(session.snapshot()))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert word in error.details()
    assert server.engine.bytes_reserved == reserved
    session.close()


def test_a_snapshot_from_an_unsigning_server_is_refused_by_a_signing_one(plain, signing):
    session = _six_token_stream(plain[1])
    error = _refusal(signing[1], session.snapshot())
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "carries no signature" in error.details()
    session.close()


def _unsigned(chunk):
    out = gqa_pb2.SnapshotChunk.FromString(chunk.SerializeToString())
    out.ClearField("signature")
    return out


def _resigned(chunks, key: bytes):
    out = _copy(chunks)
    out[-1].signature = snapshot.signature(out, key)
    return out


@pytest.mark.parametrize(
    "kwargs,word",
    [
        (dict(snapshot_key="   "), "GQA_SNAPSHOT_KEY"),
        (dict(snapshot_key="short"), "at least 16 bytes"),
    ],
    ids=["blank", "short"],
)
def test_a_key_source_that_is_set_but_unusable_refuses_to_start(kwargs, word):
    with pytest.raises(ConfigError, match=word):
        load_snapshot_key(ServerConfig(**kwargs))


def test_an_empty_key_variable_refuses_to_start():
    from service.config import from_args

    with pytest.raises(ConfigError, match="GQA_SNAPSHOT_KEY: set but empty"):
        from_args(None, {"GQA_SNAPSHOT_KEY": " "})


def test_an_empty_key_file_refuses_to_start(tmp_path):
    path = tmp_path / "key"
    path.write_text("\n")
    with pytest.raises(ConfigError, match="--snapshot-key-file"):
        load_snapshot_key(ServerConfig(snapshot_key_file=str(path)))
    with pytest.raises(ConfigError, match="set one of them"):
        ServerConfig(snapshot_key_file=str(path), snapshot_key=KEY).validate()
