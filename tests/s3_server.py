"""The tests' local S3 server: moto's S3 API on a werkzeug server in a thread, with its writes made atomic.

S3 evaluates a conditional write (If-None-Match, If-Match) and applies it as one step: of two creates racing for
one key, one wins and the other gets 412. moto checks the condition, then writes, in separate steps on a threaded
server, so two racing creates could both succeed. In CI, two of five drivers racing for a run lock were both told
they held it (2026-12-05). This server lets one write request in at a time, so the store under test keeps S3's
guarantee. Reads stay concurrent."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any

WRITES = frozenset({"PUT", "POST", "DELETE"})
# Dummy credentials the local server takes (the tests' and bench.soak's).
S3_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


class _OneWriteAtATime:
    def __init__(self, app: Callable[..., Iterable[bytes]]):
        self.app, self.lock = app, threading.Lock()

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if environ.get("REQUEST_METHOD") not in WRITES:
            return self.app(environ, start_response)
        with self.lock:
            return list(self.app(environ, start_response))  # the whole answer made inside the lock


class LocalS3Server:
    """start(), get_host_and_port(), stop(): moto's S3 API on 127.0.0.1 at a free port."""

    def __init__(self) -> None:
        from moto.server import DomainDispatcherApplication, create_backend_app
        from werkzeug.serving import make_server

        app = _OneWriteAtATime(DomainDispatcherApplication(create_backend_app))
        self._server = make_server("127.0.0.1", 0, app, threaded=True)
        self._thread = threading.Thread(target=self._server.serve_forever, name="local-s3", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def get_host_and_port(self) -> tuple[str, int]:
        host, port = self._server.server_address[:2]
        return str(host), int(port)

    def stop(self) -> None:
        self._server.shutdown()
        self._thread.join()
