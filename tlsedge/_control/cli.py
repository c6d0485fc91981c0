"""The ``tlsedge`` command: run, check, demo, cert.

Parsing the command line and reporting errors happens here; running an edge
with its signal handling is `tlsedge._control.run.run_edge` (shared with the demo).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from functools import partial

import trio

from tlsedge._backends.preflight import access_log_error, check_environment
from tlsedge._control.edge import Edge
from tlsedge._control.logs import setup_logging, shutdown_logging
from tlsedge._control.run import reload_from_file, run_edge, tune_gc
from tlsedge._core.accesslog import ACCESS_LOG_OFF
from tlsedge._core.config import (
    Config,
    ConfigError,
    ConfigFileError,
    config_warnings,
    load_config,
    parse_config,
    read_config_text,
)
from tlsedge._version import __version__

__all__ = ["main"]

LOGGER = logging.getLogger("tlsedge.cli")

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_CONFIG = 2


def _run(args: argparse.Namespace) -> int:
    """``tlsedge run``.

    Raises:
        ConfigError: the edge cannot start; the message starts with the dotted
            path of the value at fault.
    """
    if args.worker is not None:
        from tlsedge._control.worker import run_worker

        return run_worker(args.worker, args.config, args.log_level)
    text = read_config_text(args.config)
    config = parse_config(text, args.config)
    log_format = args.log_format or config.edge.log_format
    if config.edge.workers > 1:
        from tlsedge._control.workers import supervise

        # The workers write the access log; the supervisor opens none.
        setup_logging(args.log_level, log_format, ACCESS_LOG_OFF)
        _log_warnings(config, args.config)
        return supervise(
            config,
            text,
            args.config,
            sys.argv[1:] if args.argv is None else args.argv,
            log_format=log_format,
        )
    try:
        setup_logging(args.log_level, log_format, config.edge.access_log)
    except OSError as exc:
        raise access_log_error(config.edge.access_log, exc) from exc
    _log_warnings(config, args.config)
    tune_gc()
    edge = Edge(config)
    trio.run(run_edge, edge, partial(reload_from_file, edge, args.config))
    return EXIT_OK


def _log_warnings(config: Config, path: str) -> None:
    """Log what is valid in *config* but probably not meant (once per edge:
    the supervisor, not each worker)."""
    for warning in config_warnings(config):
        LOGGER.warning("%s: %s", path, warning)


def _config_error(config: str, exc: ConfigError) -> str:
    """The line that reports *exc* about the file *config*, naming it once
    (an error about the file itself names it already)."""
    if isinstance(exc, ConfigFileError):
        return f"tlsedge: {exc}"
    return f"tlsedge: {config}: {exc}"


def _cmd_run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except ConfigError as exc:
        print(_config_error(args.config, exc), file=sys.stderr)
        return EXIT_CONFIG


def _cmd_check(args: argparse.Namespace) -> int:
    try:
        config = load_config(args.config)
        if not args.config_only:
            trio.run(check_environment, config)
    except ConfigError as exc:
        print(_config_error(args.config, exc), file=sys.stderr)
        return EXIT_CONFIG
    for warning in config_warnings(config):
        print(f"tlsedge: {args.config}: warning: {warning}", file=sys.stderr)
    print(
        f"{args.config}: OK ({len(config.listeners)} listeners, "
        f"{len(config.backends)} backends)"
    )
    return EXIT_OK


def _cmd_demo(args: argparse.Namespace) -> int:
    from tlsedge._control.demo import run_demo

    try:
        trio.run(run_demo, args.host, args.port)
    except ConfigError as exc:
        print(f"tlsedge demo: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    return EXIT_OK


def _cmd_cert(args: argparse.Namespace) -> int:
    from tlsedge._tls.certs import make_dev_certificates

    try:
        made = make_dev_certificates(
            args.directory,
            names=args.name or ("localhost", "127.0.0.1", "::1"),
            key_type=args.key_type,
            days=args.days,
            client_cn=args.client,
        )
    except (ValueError, OSError) as exc:
        print(f"tlsedge cert: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    print(f"CA:          {made.ca_cert} (key {made.ca_key})")
    print(f"server:      {made.cert} (key {made.key})")
    if made.client_cert is not None:
        print(f"client:      {made.client_cert} (key {made.client_key})")
    print("Development certificates: never use them in production.")
    return EXIT_OK


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tlsedge",
        description="A PROXY-protocol aware TLS and TCP edge (trio).",
    )
    parser.add_argument("--version", action="version", version=f"tlsedge {__version__}")
    parser.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="log level for stderr (default: info)",
    )
    parser.add_argument(
        "--log-format",
        choices=["text", "json"],
        help="format of the log on stderr (default: [edge] log_format, else text)",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the edge described by CONFIG")
    run.add_argument("config", help="TOML configuration file")
    # The supervisor's worker processes: FD is the worker's end of its link.
    run.add_argument("--worker", type=int, metavar="FD", help=argparse.SUPPRESS)
    run.set_defaults(func=_cmd_run, argv=None)
    check = sub.add_parser(
        "check",
        help="check CONFIG and what running it would meet: certificate files, "
        "host names (exit 2 if anything is wrong)",
    )
    check.add_argument("config", help="TOML configuration file")
    check.add_argument(
        "--config-only",
        action="store_true",
        help="check the file alone: open no certificate file, resolve no name "
        "(to check a configuration on another machine)",
    )
    check.set_defaults(func=_cmd_check)
    demo = sub.add_parser(
        "demo",
        help="run an edge in front of a built-in backend that shows what it learned",
    )
    demo.add_argument("--host", default="127.0.0.1", help="address to listen on")
    demo.add_argument(
        "--port", type=int, default=8443, help="first port (default 8443)"
    )
    demo.set_defaults(func=_cmd_demo)
    cert = sub.add_parser(
        "cert", help="make a development CA, server and client certificates"
    )
    cert.add_argument("directory", help="where to write the PEM files")
    cert.add_argument(
        "--name",
        action="append",
        help="a DNS name or IP address for the server (repeat; default: "
        "localhost, 127.0.0.1, ::1)",
    )
    cert.add_argument(
        "--key-type", choices=["ecdsa-p256", "rsa2048"], default="ecdsa-p256"
    )
    cert.add_argument("--days", type=int, default=90, help="validity (default 90)")
    cert.add_argument("--client", metavar="CN", help="also make a client certificate")
    cert.set_defaults(func=_cmd_cert)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``tlsedge`` and ``python -m tlsedge``."""
    args = _parser().parse_args(argv)
    setup_logging(args.log_level, args.log_format or "text")
    try:
        if getattr(args, "argv", "unset") is None:
            args.argv = list(sys.argv[1:] if argv is None else argv)
        result: int = args.func(args)
    finally:
        shutdown_logging()
    return result
