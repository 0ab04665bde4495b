"""What the ``gqa-serve`` subcommands share: exit statuses, the one-line error, the argparse
types, and the connection flags of the client commands (``demo``, ``bench``).

Imported by ``main``, ``commands`` and ``loadgen``; imports none of them (no cycle).
"""

from __future__ import annotations

import argparse
import os
import re
import sys

from ..config import ConfigError

__all__ = [
    "EXIT_USAGE",
    "EXIT_FAILURE",
    "OneLineParser",
    "fail",
    "plain",
    "positive_int",
    "non_negative_int",
    "add_client_arguments",
    "client_from_args",
]

EXIT_USAGE = 2
"""Bad input or configuration."""
EXIT_FAILURE = 1
"""A failure at run time (no server, a port in use, a refused call)."""


class OneLineParser(argparse.ArgumentParser):
    """argparse, with its errors on one line (no usage block) and exit status 2."""

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def plain(docstring_text: str) -> str:
    """Docstring prose as a terminal shows it: a reStructuredText literal (a name between two
    backticks on each side) without its backticks."""
    return re.sub(r"``([^`]+)``", r"\1", docstring_text)


def fail(message: str, status: int = EXIT_USAGE) -> int:
    print(f"gqa-serve: error: {message}".replace("\n", " "), file=sys.stderr)
    return status


def positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise ValueError(text)
    return value


positive_int.__name__ = "positive integer"


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise ValueError(text)
    return value


non_negative_int.__name__ = "non-negative integer"


def add_client_arguments(parser: argparse.ArgumentParser) -> None:
    """Where the server is and how to reach it (TLS, token)."""
    group = parser.add_argument_group("connection")
    group.add_argument(
        "--address",
        default="127.0.0.1:50051",
        help="host:port of the server, or a gRPC target such as dns:///host:port (default %(default)s)",
    )
    group.add_argument("--tls", action="store_true", help="speak TLS, trusting the system's roots (or --tls-ca-file)")
    group.add_argument("--tls-ca-file", help="PEM CA bundle to verify the server with (implies --tls)")
    group.add_argument("--tls-cert-file", help="PEM client certificate, for mutual TLS (with --tls-key-file)")
    group.add_argument("--tls-key-file", help="PEM private key of --tls-cert-file")
    group.add_argument(
        "--tls-server-name", help="name to verify the server's certificate against, if not the address's host"
    )
    group.add_argument("--token-file", help="file holding the bearer token (default: $GQA_AUTH_TOKEN if set)")


def client_from_args(args: argparse.Namespace, client_class=None, **kwargs):
    """A ``Client`` (or ``client_class``, e.g. ``AsyncClient``) from the connection flags;
    ``ConfigError`` for an unreadable file."""
    from gqa_client import Client

    def read(path: str | None, flag: str) -> bytes | None:
        if not path:
            return None
        try:
            with open(path, "rb") as f:
                return f.read()
        except OSError as exc:
            raise ConfigError(f"{flag}: cannot read {path!r}: {exc.strerror}") from None

    token = os.environ.get("GQA_AUTH_TOKEN", "").strip() or None
    if args.token_file:
        token = read(args.token_file, "--token-file").decode().strip()
        if not token:
            raise ConfigError(f"--token-file: {args.token_file!r} holds no token")
    if bool(args.tls_cert_file) != bool(args.tls_key_file):
        raise ConfigError("--tls-cert-file and --tls-key-file: give both (mutual TLS) or neither")
    options = [("grpc.ssl_target_name_override", args.tls_server_name)] if args.tls_server_name else []
    return (client_class or Client)(
        args.address,
        tls=args.tls or bool(args.tls_ca_file),
        root_certificates=read(args.tls_ca_file, "--tls-ca-file"),
        certificate_chain=read(args.tls_cert_file, "--tls-cert-file"),
        private_key=read(args.tls_key_file, "--tls-key-file"),
        token=token,
        options=options,
        **kwargs,
    )
