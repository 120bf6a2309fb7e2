"""A real S3 HTTP endpoint on loopback (the `s3` fixture) for the shared-store tests, and a real
proxy in front of it.

moto's server mode speaks the S3 wire protocol (create-only writes with If-None-Match, multipart
uploads, conditional deletes), so cgbuild's own boto3 client talks to it exactly as to a bucket.
The proxy forwards every request unchanged and logs it (to count what a command asked), or drops
the If-None-Match header: a store that ignores create-only writes, for the capability probe; or
denies one prefix, as a bucket policy would; or drops the connection halfway through a body; or
answers a create-only write "exists" for a name nobody can read.
"""

from __future__ import annotations

import http.client
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

BUCKET = "cgbuild-shared"


@dataclass
class Proxy:
    """A forwarding HTTP proxy: `log` holds (method, path-with-query) of every request seen."""

    upstream: tuple[str, int]
    strip_if_none_match: bool = False
    deny: str | None = None
    """Requests whose path holds this are answered 403 AccessDenied (a prefix a policy forbids)."""
    cut: str | None = None
    """GETs whose path holds this get their headers and half the body, then the connection drops."""
    refuse_create: str | None = None
    """Create-only PUTs whose path holds this are answered 412 and never reach the store: the
    writer is told the name exists, a reader finds nothing (as if quarantined in between)."""
    log: list[tuple[str, str]] = field(default_factory=list)
    server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        assert self.server is not None
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> Proxy:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _error(self, status: int, reason: str, code: str) -> None:
                body = f"<Error><Code>{code}</Code><Message>{reason}</Message></Error>".encode()
                self.send_response(status, reason)
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _forward(self) -> None:
                proxy.log.append((self.command, self.path))
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                headers = {k: v for k, v in self.headers.items() if k.lower() != "host"}
                if proxy.deny and proxy.deny in self.path:
                    return self._error(403, "Forbidden", "AccessDenied")
                refused = proxy.refuse_create and proxy.refuse_create in self.path
                if refused and self.command == "PUT" and "If-None-Match" in self.headers:
                    return self._error(412, "Precondition Failed", "PreconditionFailed")
                if proxy.strip_if_none_match:
                    headers = {k: v for k, v in headers.items() if k.lower() != "if-none-match"}
                conn = http.client.HTTPConnection(*proxy.upstream, timeout=60)
                conn.request(self.command, self.path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                self.send_response(resp.status, resp.reason)
                for k, v in resp.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command == "GET" and proxy.cut and proxy.cut in self.path:
                    self.wfile.write(data[: len(data) // 2])
                    self.close_connection = True
                elif self.command != "HEAD":
                    self.wfile.write(data)
                conn.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()

    def requests(self, method: str, path_part: str) -> list[str]:
        return [p for m, p in self.log if m == method and path_part in p]


@dataclass
class S3:
    """A test module's S3 endpoint; `env` is what a cgbuild process needs to reach it."""

    endpoint: str
    upstream: tuple[str, int]
    env: dict[str, str]

    def client(self) -> Any:
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint)


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3]:
    """moto's S3 server on a free loopback port for one test module, with dummy credentials in
    this process's environment while the module runs (boto3's default chain finds them, and so do
    the cgbuild processes and Ray nodes started meanwhile). A module's own server: no module sees
    another's objects or environment."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    nowhere = tmp_path_factory.mktemp("aws") / "none"
    env = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": f"http://{host}:{port}",
        "AWS_CONFIG_FILE": str(nowhere),
        "AWS_SHARED_CREDENTIALS_FILE": str(nowhere),
    }
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        mp.delenv("AWS_ENDPOINT_URL_S3", raising=False)
        mp.delenv("AWS_PROFILE", raising=False)
        s = S3(env["AWS_ENDPOINT_URL"], (host, port), env)
        s.client().create_bucket(Bucket=BUCKET)
        yield s
    server.stop()


def child_env(s3: S3, **extra: str | None) -> dict[str, str]:
    """This process's environment for a cgbuild child, with `extra` set (None: removed)."""
    env = {**os.environ, **s3.env}
    for k, v in extra.items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    return env
