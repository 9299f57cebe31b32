"""The parts of `kvcache`'s argument parsing that are not commands: the parser class, argument types,
and the global options (target, timeout, JSON, TLS) every command accepts."""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable
from typing import Any, NoReturn

from kvcache_client._cli.inputs import CliError
from kvcache_client.client import DEFAULT_TARGET
from kvcache_client.connection import TOKEN_ENV, TLSConfig

TARGET_ENV = "KVCACHE_TARGET"
DEFAULT_TIMEOUT_S = 10.0


class Parser(argparse.ArgumentParser):
    """argparse, but its errors reach main() as CliError: one line, exit code USAGE."""

    def error(self, message: str) -> NoReturn:
        raise CliError(f"{message} (see '{self.prog} --help')")


def arg_type(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """An argparse `type` from an inputs parser: its CliError becomes argparse's own error."""

    def convert(text: str) -> Any:
        try:
            return parse(text)
        except CliError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = parse.__name__
    return convert


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise CliError(f"{text!r} is not a number") from None
    if not 0 < value < math.inf:
        raise CliError(f"{text!r} must be a positive number of seconds")
    return value


def key_value(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep:
        raise CliError(f"{text!r} is not KEY=VALUE")
    return key, value


def global_options() -> argparse.ArgumentParser:
    """--target, --timeout, --json and the TLS options, as a parent of the top-level parser and of every
    command's, so they are accepted before the command and after it. SUPPRESS keeps a command's parser
    from resetting a value given before the command; the caller applies the defaults."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument(
        "--target",
        metavar="HOST:PORT",
        default=argparse.SUPPRESS,
        help=f"the server (default ${TARGET_ENV} or {DEFAULT_TARGET})",
    )
    p.add_argument(
        "--timeout",
        type=arg_type(positive_float),
        metavar="SECONDS",
        default=argparse.SUPPRESS,
        help=f"deadline of each call, retries included (default {DEFAULT_TIMEOUT_S:g})",
    )
    p.add_argument(
        "--json", action="store_true", default=argparse.SUPPRESS, help="print machine-readable JSON on stdout"
    )
    tls = p.add_argument_group("TLS (servers with [tls]; the API token comes from $" + TOKEN_ENV + ")")
    tls.add_argument(
        "--tls", action="store_true", default=argparse.SUPPRESS, help="verify the server against the system roots"
    )
    for flag, help_ in (
        ("--ca-file", "CA bundle that signed the server's certificate (implies --tls)"),
        ("--cert-file", "this client's certificate, for mTLS (with --key-file)"),
        ("--key-file", "this client's private key, for mTLS"),
    ):
        tls.add_argument(flag, metavar="FILE", default=argparse.SUPPRESS, help=help_)
    tls.add_argument("--server-name", metavar="NAME", default=argparse.SUPPRESS, help="name the certificate must carry")
    return p


def tls_options(args: argparse.Namespace) -> TLSConfig | bool:
    """False (plaintext), True (system roots) or a TLSConfig, from the TLS options."""
    files = {name: getattr(args, name, None) for name in ("ca_file", "cert_file", "key_file")}
    server_name = getattr(args, "server_name", None)
    if not any(files.values()) and server_name is None:
        return getattr(args, "tls", False)
    for name, path in files.items():
        if path is not None and not os.access(path, os.R_OK):
            raise CliError(f"--{name.replace('_', '-')}: cannot read {path}")
    if bool(files["cert_file"]) != bool(files["key_file"]):
        raise CliError("--cert-file and --key-file go together")
    return TLSConfig(**files, server_name=server_name)
