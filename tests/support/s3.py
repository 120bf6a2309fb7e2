"""Real S3 HTTP endpoints on loopback (the `s3` fixture) for the shared-store tests, and a real
proxy in front of them.

The `s3` fixture is parametrised over two servers, each started once per session: moto's server
mode, which implements the S3 wire protocol in this process, and SeaweedFS (support/seaweedfs.py),
an object store teams deploy. Both speak create-only writes with If-None-Match, multipart
uploads and conditional deletes, so cgbuild's own boto3 client talks to either exactly as to a
bucket; a test module runs once against each (`-k moto`, `-k seaweedfs` select one).

The proxy forwards every request and logs it (to count what a command asked), or drops the
If-None-Match header: a store that ignores create-only writes, for the capability probe; or
checks for the name and writes without the header after a pause: a store whose create-only
writes race; or denies one prefix, as a bucket policy would; or drops the connection halfway
through a body; or answers a create-only write "exists" for a name nobody can read; or, for a
stretch of requests, answers 503 SlowDown or resets the connection halfway through the request's
body (what botocore's retries meet, and give up on past their bound). It signs
what it forwards again with the test identity (SigV4 covers the Host and the headers it drops),
as a gateway holding the bucket's credentials would.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import socket
import struct
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from support import seaweedfs

BUCKET = "cgbuild-shared"
BACKENDS = ("moto", "seaweedfs")
REGION = "us-east-1"
RACE_WINDOW_S = 0.3
"""How long a racing create waits between finding the name absent and writing it: longer than
two threads released together take to arrive, so both find it absent."""


@dataclass
class S3:
    """A test module's S3 endpoint; `env` is what a cgbuild process needs to reach it."""

    backend: str
    """`moto` or `seaweedfs`: for the one case where moto is known to differ."""
    endpoint: str
    upstream: tuple[str, int]
    env: dict[str, str]

    def client(self) -> Any:
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint)

    def bucket(self, name: str, timeout: float = 60.0) -> None:
        """Create bucket `name` and wait until it takes a write: SeaweedFS gives a new bucket its
        volume lazily and answers InternalError until then (seen on a loaded 2-core box)."""
        client = self.client()
        with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou):
            client.create_bucket(Bucket=name)
        deadline = time.monotonic() + timeout
        while True:
            try:
                client.put_object(Bucket=name, Key="ready", Body=b"")
                client.delete_object(Bucket=name, Key="ready")
                return
            except client.exceptions.ClientError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)


@dataclass
class Proxy:
    """A forwarding HTTP proxy in front of `s3`: `log` holds (method, path-with-query) of every
    request seen."""

    s3: S3
    strip_if_none_match: bool = False
    racy_create: bool = False
    """Create-only PUTs are checked (HEAD) and, when the name is absent, forwarded without the
    header `RACE_WINDOW_S` later: one writer is refused as S3 would, two concurrent ones both win."""
    deny: str | None = None
    """Requests whose path holds this are answered 403 AccessDenied (a prefix a policy forbids)."""
    cut: str | None = None
    """GETs whose path holds this get their headers and half the body, then the connection drops."""
    refuse_create: str | None = None
    """Create-only PUTs whose path holds this are answered 412 and never reach the store: the
    writer is told the name exists, a reader finds nothing (as if quarantined in between)."""
    slow_down: int = 0
    """The next this many requests are answered 503 SlowDown, as a store shedding load does; each
    attempt a client retries counts one."""
    reset: int = 0
    """The next this many requests that carry a body (objects, parts, refs) are cut off mid-transfer:
    half the body is read, then the connection is reset with no answer."""
    log: list[tuple[str, str]] = field(default_factory=list)
    server: ThreadingHTTPServer | None = None
    _faults: threading.Lock = field(default_factory=threading.Lock)

    def take(self, fault: str) -> bool:
        """Whether this request meets `fault` (`slow_down` or `reset`), counting it off the stretch."""
        with self._faults:
            left = int(getattr(self, fault))
            if left > 0:
                setattr(self, fault, left - 1)
            return left > 0

    @property
    def url(self) -> str:
        assert self.server is not None
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    def send(self, method: str, path: str, body: bytes | None, headers: dict[str, str]) -> tuple[Any, bytes]:
        """One request to the upstream server, signed again: (response, its body)."""
        from botocore.auth import S3SigV4Auth
        from botocore.awsrequest import AWSRequest
        from botocore.credentials import Credentials

        host, port = self.s3.upstream
        kept = {k: v for k, v in headers.items() if k.lower() not in ("host", "authorization", "x-amz-date")}
        request = AWSRequest(method=method, url=f"http://{host}:{port}{path}", data=body or b"", headers=kept)
        key, secret = seaweedfs.credentials()
        S3SigV4Auth(Credentials(key, secret), "s3", REGION).add_auth(request)
        conn = http.client.HTTPConnection(host, port, timeout=60)
        try:
            conn.request(method, path, body=body, headers=dict(request.headers.items()))
            resp = conn.getresponse()
            return resp, resp.read()
        finally:
            conn.close()

    def create_racily(
        self, path: str, body: bytes | None, headers: dict[str, str]
    ) -> tuple[Any, bytes] | None:
        """Check, wait, write (without the header): None when the name was there."""
        head, _ = self.send("HEAD", path, None, {})
        if head.status == 200:
            return None
        time.sleep(RACE_WINDOW_S)
        return self.send("PUT", path, body, headers)

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
                if self.command != "HEAD":  # a HEAD answer has no body: it would start the next one
                    self.wfile.write(body)

            def _reset(self, length: int) -> None:
                """Read half the body, then close with SO_LINGER 0: the peer gets a reset, no answer."""
                self.rfile.read(length // 2)
                self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                self.close_connection = True

            def _forward(self) -> None:
                proxy.log.append((self.command, self.path))
                length = int(self.headers.get("Content-Length") or 0)
                if length and proxy.take("reset"):
                    return self._reset(length)
                body = self.rfile.read(length) if length else None
                headers = dict(self.headers.items())
                if proxy.take("slow_down"):
                    return self._error(503, "Slow Down", "SlowDown")
                if proxy.deny and proxy.deny in self.path:
                    return self._error(403, "Forbidden", "AccessDenied")
                create = self.command == "PUT" and "If-None-Match" in self.headers
                if create and proxy.refuse_create and proxy.refuse_create in self.path:
                    return self._error(412, "Precondition Failed", "PreconditionFailed")
                if proxy.strip_if_none_match or (create and proxy.racy_create):
                    headers = {k: v for k, v in headers.items() if k.lower() != "if-none-match"}
                got = (
                    proxy.create_racily(self.path, body, headers)
                    if create and proxy.racy_create
                    else proxy.send(self.command, self.path, body, headers)
                )
                if got is None:
                    return self._error(412, "Precondition Failed", "PreconditionFailed")
                resp, data = got
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

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()

    def __enter__(self) -> Proxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def requests(self, method: str, path_part: str) -> list[str]:
        return [p for m, p in self.log if m == method and path_part in p]


@contextlib.contextmanager
def behind_proxy(s3: S3, env: Mapping[str, str] | None = None, **faults: Any) -> Iterator[Proxy]:
    """A proxy in front of `s3` with `faults` set (`Proxy`'s fields), and this process's boto3
    pointed at it (AWS_ENDPOINT_URL) with `env` set, while it runs; the environment is restored,
    then the proxy stopped, on the way out."""
    with Proxy(s3, **faults) as proxy, pytest.MonkeyPatch.context() as mp:
        for k, v in {**(env or {}), "AWS_ENDPOINT_URL": proxy.url}.items():
            mp.setenv(k, v)
        yield proxy


@pytest.fixture(scope="session")
def moto_server() -> Iterator[tuple[str, int]]:
    """moto's S3 server on a free loopback port, with the bucket, for the whole session."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        _client(f"http://{host}:{port}").create_bucket(Bucket=BUCKET)
        yield host, port
    finally:
        server.stop()


@pytest.fixture(scope="session")
def seaweedfs_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, int]]:
    """SeaweedFS on loopback, with the bucket, for the whole session (support/seaweedfs.py)."""
    with seaweedfs.running(tmp_path_factory.mktemp("seaweedfs"), BUCKET) as server:
        yield "127.0.0.1", server.port


def _client(endpoint: str) -> Any:
    import boto3

    key, secret = seaweedfs.credentials()
    return boto3.session.Session().client(
        "s3", endpoint_url=endpoint, aws_access_key_id=key, aws_secret_access_key=secret, region_name=REGION
    )


@pytest.fixture(scope="module", params=BACKENDS)
def s3(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3]:
    """One of the session's S3 servers (each module runs against each), with the test identity's
    credentials in this process's environment while the module runs (boto3's default chain finds
    them, and so do the cgbuild processes and Ray nodes started meanwhile). Modules share a
    server's bucket; each test works under a prefix of its own."""
    host, port = request.getfixturevalue(f"{request.param}_server")
    with pytest.MonkeyPatch.context() as mp:
        env = use_endpoint(mp, f"http://{host}:{port}", tmp_path_factory.mktemp("aws"))
        yield S3(request.param, env["AWS_ENDPOINT_URL"], (host, port), env)


def use_endpoint(mp: pytest.MonkeyPatch, endpoint: str, folder: Path) -> dict[str, str]:
    """Point boto3's default chain in this process at `endpoint` with the test identity, and at no
    configuration file or profile (`folder` holds the empty ones); returns what was set."""
    env = seaweedfs.client_env(endpoint, folder, REGION)
    for k, v in env.items():
        mp.setenv(k, v)
    for name in ("AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "AWS_SESSION_TOKEN"):
        mp.delenv(name, raising=False)
    return env


def child_env(s3: S3, **extra: str | None) -> dict[str, str]:
    """This process's environment for a cgbuild child, with `extra` set (None: removed)."""
    env = {**os.environ, **s3.env}
    for k, v in extra.items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    return env
