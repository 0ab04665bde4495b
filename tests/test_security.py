"""Transport security and authentication as a client sees them.

Certificates are generated here with ``cryptography`` (EC P-256, valid for an hour): a CA, a
server certificate for 127.0.0.1/localhost, a client certificate from the same CA, and a rogue
CA with its own client certificate. Nothing is read from the machine's trust store.
"""

from __future__ import annotations

import dataclasses
import datetime
import ipaddress
import logging

import grpc
import pytest
import torch
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc

from service.api import gqa_pb2, gqa_pb2_grpc
from service.config import ConfigError, ServerConfig, from_args
from service.server import Server, ServerThread
from tests.client import Session, open_message
from tests.test_cli import free_port

TOKEN = "s3cret-token-0123456789abcdef"
BASE = ServerConfig(address="127.0.0.1:0", metrics_port=0, idle_timeout_s=3600.0)
HOST_OVERRIDE = [("grpc.ssl_target_name_override", "localhost")]


@dataclasses.dataclass
class Pki:
    ca: bytes
    server_cert: bytes
    server_key: bytes
    client_cert: bytes
    client_key: bytes
    rogue_cert: bytes
    rogue_key: bytes


def _pem_key(key) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _cert(subject: str, key, issuer_name, issuer_key, *, ca=False, server=False):
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
        .issuer_name(issuer_name or x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if ca:
        builder = builder.add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
    elif server:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        ).add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
    else:
        builder = builder.add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
    return builder.sign(issuer_key or key, hashes.SHA256())


def _ca(name: str):
    key = ec.generate_private_key(ec.SECP256R1())
    return key, _cert(name, key, None, None, ca=True)


def _leaf(name: str, ca_key, ca_cert, *, server=False):
    key = ec.generate_private_key(ec.SECP256R1())
    return key, _cert(name, key, ca_cert.subject, ca_key, server=server)


def _pem(cert) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


@pytest.fixture(scope="module")
def pki() -> Pki:
    ca_key, ca = _ca("gqa-test-ca")
    server_key, server = _leaf("localhost", ca_key, ca, server=True)
    client_key, client = _leaf("gqa-client", ca_key, ca)
    rogue_ca_key, rogue_ca = _ca("rogue-ca")
    rogue_key, rogue = _leaf("gqa-client", rogue_ca_key, rogue_ca)
    return Pki(
        _pem(ca),
        _pem(server),
        _pem_key(server_key),
        _pem(client),
        _pem_key(client_key),
        _pem(rogue),
        _pem_key(rogue_key),
    )


@pytest.fixture(scope="module")
def files(pki, tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    out = {}
    for name in ("ca", "server_cert", "server_key"):
        path = d / f"{name}.pem"
        path.write_bytes(getattr(pki, name))
        out[name] = str(path)
    token = d / "token"
    token.write_text(TOKEN + "\n")  # `echo` and editors add one; it is stripped
    out["token"] = str(token)
    return out


def _info(channel, metadata=None):
    return gqa_pb2_grpc.AttentionServiceStub(channel).GetServerInfo(
        gqa_pb2.GetServerInfoRequest(), metadata=metadata, timeout=10
    )


def _health(channel):
    return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=10).status


def _refused(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value


def _secure(address, pki: Pki, *, ca=True, client=None):
    creds = grpc.ssl_channel_credentials(
        root_certificates=pki.ca if ca else None,
        private_key=client[1] if client else None,
        certificate_chain=client[0] if client else None,
    )
    return grpc.secure_channel(address, creds, options=HOST_OVERRIDE)


# -- TLS ----------------------------------------------------------------------------------
def test_tls_serves_clients_that_trust_the_ca_and_no_one_else(pki, files):
    config = dataclasses.replace(BASE, tls_cert_file=files["server_cert"], tls_key_file=files["server_key"])
    with ServerThread(config) as srv:
        with _secure(srv.address, pki) as ch:
            assert _info(ch).version
            session = Session(ch, open_message())
            assert (
                session.step(0, torch.zeros(1, 4, 8), torch.zeros(1, 2, 8), torch.zeros(1, 2, 8)).step.status.code == 0
            )
            session.close()
        with _secure(srv.address, pki, ca=False) as ch:  # system roots: does not know our CA
            assert _refused(lambda: _info(ch)).code() == grpc.StatusCode.UNAVAILABLE
        with grpc.insecure_channel(srv.address) as ch:  # plaintext against a TLS port
            assert _refused(lambda: _info(ch)).code() == grpc.StatusCode.UNAVAILABLE


def test_mutual_tls_needs_a_client_certificate_from_the_ca(pki, files):
    config = dataclasses.replace(
        BASE, tls_cert_file=files["server_cert"], tls_key_file=files["server_key"], tls_client_ca_file=files["ca"]
    )
    with ServerThread(config) as srv:
        with _secure(srv.address, pki, client=(pki.client_cert, pki.client_key)) as ch:
            assert _info(ch).version
            assert _health(ch) == health_pb2.HealthCheckResponse.SERVING
        with _secure(srv.address, pki) as ch:  # no client certificate
            assert _refused(lambda: _info(ch)).code() == grpc.StatusCode.UNAVAILABLE
        with _secure(srv.address, pki, client=(pki.rogue_cert, pki.rogue_key)) as ch:  # another CA's
            assert _refused(lambda: _info(ch)).code() == grpc.StatusCode.UNAVAILABLE
        with _secure(srv.address, pki, ca=False, client=(pki.client_cert, pki.client_key)) as ch:
            assert _refused(lambda: _info(ch)).code() == grpc.StatusCode.UNAVAILABLE


def test_plaintext_health_port_for_probes_beside_mutual_tls(pki, files):
    """kubelet's grpc probe cannot speak TLS: --health-port serves grpc.health.v1 alone in
    plaintext, and follows the drain; the attention service is not reachable there."""
    from tests.test_cli import free_port

    config = dataclasses.replace(
        BASE,
        tls_cert_file=files["server_cert"],
        tls_key_file=files["server_key"],
        tls_client_ca_file=files["ca"],
        health_port=free_port(),
    )
    with ServerThread(config) as srv:
        with grpc.insecure_channel(f"127.0.0.1:{srv.server.health_port}") as ch:
            assert _health(ch) == health_pb2.HealthCheckResponse.SERVING
            assert _refused(lambda: _info(ch)).code() == grpc.StatusCode.UNIMPLEMENTED
            srv.call(srv.server.health.enter_graceful_shutdown())
            assert _health(ch) == health_pb2.HealthCheckResponse.NOT_SERVING


# -- bearer token -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def token_server(files):
    config = dataclasses.replace(BASE, metrics_port=free_port(), auth_token_file=files["token"])
    with ServerThread(config) as srv:
        yield srv


@pytest.mark.parametrize(
    "metadata",
    [
        None,
        (("authorization", "Bearer wrong-token"),),
        (("authorization", "Bearer " + TOKEN[:-1]),),
        (("authorization", "Bearer " + TOKEN + "x"),),
        (("authorization", "Basic " + TOKEN),),
        (("authorization", TOKEN),),
        (("authorization", "Bearer " + TOKEN), ("authorization", "Bearer " + TOKEN)),
        (("x-api-key", TOKEN),),
    ],
    ids=["none", "wrong", "prefix", "longer", "basic", "no-scheme", "twice", "other-header"],
)
def test_missing_or_wrong_token_is_unauthenticated(token_server, metadata, caplog):
    caplog.set_level(logging.DEBUG)
    with grpc.insecure_channel(token_server.address) as ch:
        error = _refused(lambda: _info(ch, metadata))
        assert error.code() == grpc.StatusCode.UNAUTHENTICATED
        assert TOKEN not in error.details()
        stub = gqa_pb2_grpc.AttentionServiceStub(ch)
        opening = gqa_pb2.DecodeRequest(open=open_message())
        error = _refused(lambda: list(stub.Decode(iter([opening]), metadata=metadata, timeout=10)))
        assert error.code() == grpc.StatusCode.UNAUTHENTICATED
        error = _refused(lambda: stub.DecodeStep(gqa_pb2.DecodeStepRequest(), metadata=metadata, timeout=10))
        assert error.code() == grpc.StatusCode.UNAUTHENTICATED
    assert token_server.engine.active_streams == 0
    assert TOKEN not in caplog.text


def test_right_token_passes_and_health_needs_none(token_server):
    good = (("authorization", "Bearer " + TOKEN),)
    with grpc.insecure_channel(token_server.address) as ch:
        assert _info(ch, good).version
        assert _info(ch, (("authorization", "bearer " + TOKEN),)).version  # the scheme is case-insensitive
        session = Session(ch, open_message(), metadata=good)
        assert session.step(0, torch.zeros(1, 4, 8), torch.zeros(1, 2, 8), torch.zeros(1, 2, 8)).step.status.code == 0
        session.close()
        assert _health(ch) == health_pb2.HealthCheckResponse.SERVING


def test_reflection_needs_the_token(token_server):
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    request = reflection_pb2.ServerReflectionRequest(list_services="")
    with grpc.insecure_channel(token_server.address) as ch:
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        error = _refused(lambda: list(stub.ServerReflectionInfo(iter([request]), timeout=10)))
        assert error.code() == grpc.StatusCode.UNAUTHENTICATED
        replies = list(
            stub.ServerReflectionInfo(iter([request]), timeout=10, metadata=(("authorization", "Bearer " + TOKEN),))
        )
        assert "gqa.v1.AttentionService" in {s.name for s in replies[0].list_services_response.service}


def test_refusals_are_counted_with_their_code(token_server):
    m = token_server.server.metrics
    labels = {
        "grpc_type": "unary",
        "grpc_service": "gqa.v1.AttentionService",
        "grpc_method": "GetServerInfo",
        "grpc_code": "Unauthenticated",
    }
    before = m.value("grpc_server_handled_total", labels)
    with grpc.insecure_channel(token_server.address) as ch:
        _refused(lambda: _info(ch))
    from tests.client import wait_until

    assert wait_until(lambda: m.value("grpc_server_handled_total", labels) == before + 1, timeout=5)


def test_token_from_the_environment_and_tls_together(pki, files):
    config = from_args(
        None,
        {
            "GQA_ADDRESS": "127.0.0.1:0",
            "GQA_METRICS_PORT": "0",
            "GQA_AUTH_TOKEN": TOKEN,
            "GQA_TLS_CERT_FILE": files["server_cert"],
            "GQA_TLS_KEY_FILE": files["server_key"],
        },
    )
    assert TOKEN not in repr(config)
    with ServerThread(config) as srv, _secure(srv.address, pki) as ch:
        assert _refused(lambda: _info(ch)).code() == grpc.StatusCode.UNAUTHENTICATED
        assert _info(ch, (("authorization", "Bearer " + TOKEN),)).version
        assert _health(ch) == health_pb2.HealthCheckResponse.SERVING


# -- configuration ------------------------------------------------------------------------
def test_bad_security_configuration_names_the_setting(files, tmp_path):
    cases = [
        (dict(tls_cert_file=files["server_cert"]), "--tls-key-file"),
        (dict(tls_client_ca_file=files["ca"]), "--tls-client-ca-file"),
        (dict(tls_cert_file=str(tmp_path / "absent.pem"), tls_key_file=files["server_key"]), "--tls-cert-file"),
        (dict(auth_token=TOKEN, auth_token_file=files["token"]), "GQA_AUTH_TOKEN"),
    ]
    for fields, word in cases:
        with pytest.raises(ConfigError) as info:
            dataclasses.replace(BASE, **fields).validate()
        assert word in str(info.value)
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(ConfigError) as info:
        Server(dataclasses.replace(BASE, auth_token_file=str(empty)).validate())
    assert "--auth-token-file" in str(info.value)


def test_the_token_has_no_flag():
    import argparse

    from service.config import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    flags = {a for action in parser._actions for a in action.option_strings}
    assert "--auth-token-file" in flags and "--tls-client-ca-file" in flags
    assert "--auth-token" not in flags


# -- authentication never fails open (#17 item 11) ----------------------------------------------
EMPTY_TOKENS = {"empty": "", "space": " ", "whitespace": " \t\n", "newline": "\n"}


@pytest.mark.parametrize("raw", list(EMPTY_TOKENS.values()), ids=list(EMPTY_TOKENS))
def test_an_empty_token_variable_refuses_to_start(raw):
    # An empty Secret key through secretKeyRef sets the variable to "": that is a broken
    # deployment, not a request to run without authentication.
    with pytest.raises(ConfigError) as info:
        from_args(None, {"GQA_ADDRESS": "127.0.0.1:0", "GQA_METRICS_PORT": "0", "GQA_AUTH_TOKEN": raw})
    assert "GQA_AUTH_TOKEN" in str(info.value) and "empty" in str(info.value)
    assert "\n" not in str(info.value)
    # Built directly, a whitespace token is refused too (an empty string is "not configured").
    if raw:
        with pytest.raises(ConfigError, match="GQA_AUTH_TOKEN"):
            dataclasses.replace(BASE, auth_token=raw).validate()


@pytest.mark.parametrize("raw", list(EMPTY_TOKENS.values()), ids=list(EMPTY_TOKENS))
def test_an_empty_token_file_refuses_to_start(tmp_path, raw):
    path = tmp_path / "token"
    path.write_text(raw)
    with pytest.raises(ConfigError) as info:
        from_args(None, {"GQA_ADDRESS": "127.0.0.1:0", "GQA_METRICS_PORT": "0", "GQA_AUTH_TOKEN_FILE": str(path)})
    assert "--auth-token-file" in str(info.value) and "empty" in str(info.value)


def test_a_token_with_inner_whitespace_is_refused():
    with pytest.raises(ConfigError, match="whitespace"):
        from_args(None, {"GQA_ADDRESS": "127.0.0.1:0", "GQA_METRICS_PORT": "0", "GQA_AUTH_TOKEN": "two words"})


def test_no_token_variable_means_no_authentication():
    config = from_args(None, {"GQA_ADDRESS": "127.0.0.1:0", "GQA_METRICS_PORT": "0"})
    assert config.auth_token == "" and not config.auth_token_file


@pytest.mark.parametrize("source", ["variable", "file"])
def test_serve_with_an_empty_token_exits_2_with_one_line(tmp_path, source):
    import os
    import subprocess
    import sys

    env = dict(os.environ, GQA_ADDRESS=f"127.0.0.1:{free_port()}", GQA_METRICS_PORT="0")
    if source == "variable":
        env["GQA_AUTH_TOKEN"] = "   "
        where = "GQA_AUTH_TOKEN"
    else:
        path = tmp_path / "token"
        path.write_text(" \n")
        env["GQA_AUTH_TOKEN_FILE"] = str(path)
        where = "--auth-token-file"
    run = subprocess.run(
        [sys.executable, "-m", "service.cli", "serve"], env=env, capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 2, run.stdout + run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gqa-serve: error: ") and where in lines[0], run.stderr
