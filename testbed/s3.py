"""A real S3 API on localhost for tests: ``moto_server`` in a subprocess, and a fault-injecting proxy.

``MotoS3`` starts ``moto_server`` on a free port and points this process's environment (inherited by
a Ray started afterwards, hence by the rank actors) at it: ``AWS_ENDPOINT_URL`` and dummy
credentials, which s3fs/botocore read. ``FaultProxy`` sits between the clients and moto and answers
HTTP 503 (S3's "SlowDown") to the first ``fail`` requests whose method and path match, forwarding
everything else untouched: a transient object-store error, injected at the HTTP level.
"""

from __future__ import annotations

import http.client
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

ENV_KEYS = ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MotoS3:
    def __init__(self) -> None:
        self.port = free_port()
        exe = shutil.which("moto_server") or str(Path(sys.executable).with_name("moto_server"))
        self.proc = subprocess.Popen([exe, "-H", "127.0.0.1", "-p", str(self.port)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.close()
                    raise RuntimeError("moto_server did not start")
                time.sleep(0.1)
        self.url = f"http://127.0.0.1:{self.port}"
        self._saved = {k: os.environ.get(k) for k in ENV_KEYS}

    def use(self, endpoint: str | None = None) -> None:
        """Point this process (and processes started later) at ``endpoint`` (default: moto itself)."""
        os.environ.update(AWS_ENDPOINT_URL=endpoint or self.url, AWS_ACCESS_KEY_ID="test",
                          AWS_SECRET_ACCESS_KEY="test", AWS_DEFAULT_REGION="us-east-1")
        _forget_s3_clients()

    def filesystem(self):
        import s3fs

        # Straight to moto (not through a proxy). No region_name: s3fs would send it as the bucket's
        # LocationConstraint, which us-east-1 (AWS_DEFAULT_REGION) refuses.
        return s3fs.S3FileSystem(key="test", secret="test", client_kwargs={"endpoint_url": self.url},
                                 skip_instance_cache=True)

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        for k, v in getattr(self, "_saved", {}).items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        _forget_s3_clients()


def _forget_s3_clients() -> None:
    """Drop the s3fs filesystems this process made: fsspec caches them by their options, and code
    opening a plain ``s3://`` URI passes none, so a later test's moto on another port would be reached
    through a client still pointed at an earlier, closed one ("Could not connect to the endpoint URL")."""
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()


class FaultProxy:
    """HTTP proxy to ``upstream`` that fails the first ``fail`` requests matching (method, path regex)
    with ``status`` / S3 error ``code`` (default 503 SlowDown: transient; 403 AccessDenied: refused).
    ``method`` None matches every method."""

    def __init__(self, upstream_port: int, method: str | None, path_pattern: str, fail: int,
                 status: int = 503, code: str = "SlowDown") -> None:
        self.upstream_port = upstream_port
        self.method, self.path_pattern, self.fail = method, path_pattern, fail
        self.status, self.code = status, code
        self.failed: list[str] = []
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _ProxyHandler)
        self.server.proxy = self  # what each request's handler reads (``_ProxyHandler.proxy``)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def takes_fault(self, command: str, path: str) -> bool:
        """Whether this request is one of the first ``fail`` that match (it is then recorded)."""
        with self.lock:
            inject = (self.method in (None, command) and re.search(self.path_pattern, path)
                      and len(self.failed) < self.fail)
            if inject:
                self.failed.append(f"{command} {path}")
        return bool(inject)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class _ProxyHandler(BaseHTTPRequestHandler):
    """One request through a ``FaultProxy``: answered with the injected error, or forwarded upstream."""

    protocol_version = "HTTP/1.1"

    @property
    def proxy(self) -> FaultProxy:
        return self.server.proxy

    def log_message(self, *_):
        pass

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            out = b""
            while True:
                size = int(self.rfile.readline().split(b";")[0], 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return out
                out += self.rfile.read(size)
                self.rfile.readline()
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n else b""

    def _handle(self):
        body = self._body()
        if self.proxy.takes_fault(self.command, self.path):
            self._answer_injected()
            return
        self._forward(body)

    def _answer_injected(self) -> None:
        msg = f"<Error><Code>{self.proxy.code}</Code><Message>injected</Message></Error>".encode()
        self.send_response(self.proxy.status)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(msg)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(msg)

    def _forward(self, body: bytes) -> None:
        headers = {k: v for k, v in self.headers.items() if k.lower() != "transfer-encoding"}
        headers["Content-Length"] = str(len(body))
        conn = http.client.HTTPConnection("127.0.0.1", self.proxy.upstream_port, timeout=60)
        try:
            conn.request(self.command, self.path, body=body, headers=headers)
            resp = conn.getresponse()
            data = resp.read()
        finally:
            conn.close()
        self.send_response(resp.status)
        for k, v in resp.getheaders():
            if k.lower() not in ("transfer-encoding", "content-length", "connection"):
                self.send_header(k, v)
        # A HEAD answer has no body but tells the object's size: pass that on as it is.
        length = resp.getheader("Content-Length", "0") if self.command == "HEAD" else str(len(data))
        self.send_header("Content-Length", length)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle
