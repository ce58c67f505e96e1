"""vLLM's frontend flags for `ember serve`: TLS, the root path, CORS, a unix socket, request-id headers and the
docs pages, with vLLM's names, value formats and meanings.

TLS, the root path and the unix socket are uvicorn's own settings; CORS is Starlette's middleware, added only when
`--allowed-origins` is given (vLLM allows every origin by default; ember answers no cross-origin request unless the
operator names the origins, so a browser page elsewhere cannot use a server that was never meant for it).
"""

from __future__ import annotations

import argparse
import json
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ember.errors import ConfigError

__all__ = ["Frontend", "add_frontend_flags", "frontend"]


def add_frontend_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ssl-keyfile", default=None, help="serve HTTPS: the private key file (PEM)")
    p.add_argument("--ssl-certfile", default=None, help="serve HTTPS: the certificate (chain) file (PEM)")
    p.add_argument("--ssl-ca-certs", default=None, help="CA certificates to verify clients' certificates against")
    p.add_argument(
        "--ssl-cert-reqs",
        type=int,
        default=int(ssl.CERT_NONE),
        help="client certificates: 0 none (default), 1 optional, 2 required (ssl.CERT_*)",
    )
    p.add_argument("--ssl-ciphers", default=None, help="OpenSSL cipher list for TLS 1.2 and below")
    p.add_argument("--root-path", default=None, help="the path prefix a proxy serves ember under (ASGI root_path)")
    p.add_argument("--allowed-origins", default=None, help='CORS: JSON list of origins, e.g. ["https://app.example"]')
    p.add_argument("--allowed-methods", default='["*"]', help="CORS: JSON list of methods (default all)")
    p.add_argument("--allowed-headers", default='["*"]', help="CORS: JSON list of request headers (default all)")
    p.add_argument("--allow-credentials", action="store_true", help="CORS: allow cookies and Authorization")
    p.add_argument("--uds", default=None, help="serve on this unix domain socket instead of --host/--port")
    p.add_argument(
        "--enable-request-id-headers",
        action="store_true",
        help="accepted: ember always answers with X-Request-Id (the client's when plain)",
    )
    p.add_argument("--disable-fastapi-docs", action="store_true", help="no /docs, /redoc or /openapi.json")
    p.add_argument(
        "--otlp-traces-endpoint",
        "--otlp-endpoint",
        default=None,
        help="export a trace of each request to this OTLP/HTTP collector, e.g. http://otel-collector:4318 "
        "(default: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT; needs pip install 'ember[otel]')",
    )
    p.add_argument(
        "--collect-detailed-traces",
        default=None,
        help="accepted (vLLM's): ember's traces always hold every stage of a request",
    )
    p.add_argument(
        "--log-format",
        choices=("text", "json"),
        default="text",
        help="json: one JSON object per line (time, level, logger, message; access lines also request id, "
        "model, route, status, tokens and timings)",
    )


@dataclass(frozen=True)
class Frontend:
    """What the flags ask of uvicorn and of the app."""

    uvicorn: dict[str, Any]
    cors: dict[str, Any] | None
    docs: bool

    @property
    def scheme(self) -> str:
        return "https" if self.uvicorn.get("ssl_certfile") else "http"


def _json_list(raw: str, flag: str) -> list[str]:
    try:
        value = json.loads(raw)
    except ValueError:
        value = None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{flag} takes a JSON list of strings, e.g. {flag} '[\"https://app.example\"]'; got {raw!r}")
    return value


def frontend(args: argparse.Namespace) -> Frontend:
    """The frontend flags checked (files exist, values in range, lists parse), naming the flag at fault."""
    for flag in ("ssl_keyfile", "ssl_certfile", "ssl_ca_certs"):
        path = getattr(args, flag)
        if path is not None and not Path(path).is_file():
            raise ConfigError(f"--{flag.replace('_', '-')} {path}: no such file")
    if bool(args.ssl_keyfile) != bool(args.ssl_certfile):
        raise ConfigError("--ssl-keyfile and --ssl-certfile go together: HTTPS needs both the key and the certificate")
    if args.ssl_cert_reqs not in (0, 1, 2):
        raise ConfigError(f"--ssl-cert-reqs is 0 (none), 1 (optional) or 2 (required), got {args.ssl_cert_reqs}")
    if args.ssl_cert_reqs and not args.ssl_ca_certs:
        raise ConfigError("--ssl-cert-reqs asks for client certificates: give --ssl-ca-certs to verify them against")
    if args.ssl_cert_reqs and not args.ssl_certfile:
        raise ConfigError("--ssl-cert-reqs needs HTTPS: give --ssl-keyfile and --ssl-certfile")
    server: dict[str, Any] = {}
    if args.ssl_certfile:
        server.update(
            ssl_keyfile=args.ssl_keyfile,
            ssl_certfile=args.ssl_certfile,
            ssl_ca_certs=args.ssl_ca_certs,
            ssl_cert_reqs=args.ssl_cert_reqs,
        )
        if args.ssl_ciphers:
            server["ssl_ciphers"] = args.ssl_ciphers
    if args.root_path:
        server["root_path"] = "/" + args.root_path.strip("/")
    if args.uds:
        server["uds"] = args.uds
    cors = None
    if args.allowed_origins is not None:
        cors = {
            "allow_origins": _json_list(args.allowed_origins, "--allowed-origins"),
            "allow_methods": _json_list(args.allowed_methods, "--allowed-methods"),
            "allow_headers": _json_list(args.allowed_headers, "--allowed-headers"),
            "allow_credentials": args.allow_credentials,
            "expose_headers": ["x-request-id", "retry-after"],
        }
    return Frontend(server, cors, not args.disable_fastapi_docs)
