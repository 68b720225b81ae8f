"""A small IMDSv2 imitation on 127.0.0.1 for the spot watcher's tests.

It speaks the two calls the watcher makes, with AWS's rules:
- ``PUT /latest/api/token`` needs ``X-aws-ec2-metadata-token-ttl-seconds`` (1..21600), else 400; answers a
  fresh token.
- ``GET /latest/meta-data/spot/instance-action`` needs a live token in ``X-aws-ec2-metadata-token``, else
  401; answers 404 while no notice is served, then 200 with ``{"action": ..., "time": ...}``.

Notices are served on demand (``serve_notice``) or after a delay (``serve_notice_after``). Standalone:
``python tests/imds_server.py --port 8169 --notice-after 30`` (then point ``scaling.spot_endpoint`` at it).
"""

from __future__ import annotations

import argparse
import json
import secrets
import threading
import time
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

TOKEN_PATH = "/latest/api/token"
ACTION_PATH = "/latest/meta-data/spot/instance-action"


class ImdsServer:
    """Serves IMDSv2 on 127.0.0.1:<port> (port 0 = any free one) in a daemon thread until ``close()``."""

    def __init__(self, port: int = 0):
        self._lock = threading.Lock()
        self._body: bytes | None = None  # None = 404, no notice
        self._tokens: set[str] = set()
        self._timer: threading.Timer | None = None
        self.token_requests = 0
        self.action_requests = 0
        self.unauthorized = 0
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_PUT(self) -> None:  # noqa: N802 - http.server's naming
                if self.path != TOKEN_PATH:
                    return self._reply(404, b"")
                ttl = self.headers.get("X-aws-ec2-metadata-token-ttl-seconds", "")
                if not ttl.isdigit() or not 1 <= int(ttl) <= 21600:
                    return self._reply(400, b"")
                token = secrets.token_urlsafe(24)
                with owner._lock:
                    owner.token_requests += 1
                    owner._tokens.add(token)
                self._reply(200, token.encode())

            def do_GET(self) -> None:  # noqa: N802
                with owner._lock:
                    authorized = self.headers.get("X-aws-ec2-metadata-token", "") in owner._tokens
                    if not authorized:
                        owner.unauthorized += 1
                    elif self.path == ACTION_PATH:
                        owner.action_requests += 1
                    body = owner._body
                if not authorized:
                    return self._reply(401, b"")
                if self.path != ACTION_PATH or body is None:
                    return self._reply(404, b"<?xml version=\"1.0\"?><title>404 - Not Found</title>")
                self._reply(200, body, "text/plain")

            def _reply(self, code: int, body: bytes, ctype: str = "text/html") -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:  # quiet: tests poll many times a second
                pass

        class Server(ThreadingHTTPServer):
            def handle_error(self, request, client_address) -> None:
                pass  # a client that timed out and hung up (loaded host) is the client's business

        self._httpd = Server(("127.0.0.1", port), Handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="imds-server", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    def serve_notice(self, action: str = "terminate", in_s: float = 120.0, body: bytes | str | None = None) -> dict:
        """Start answering 200 with a notice for ``in_s`` seconds from now (or the raw ``body``, for bad
        notices). Returns the notice served, with ``deadline_ms`` for comparisons."""
        if body is not None:
            with self._lock:
                self._body = body.encode() if isinstance(body, str) else body
            return {"body": self._body}
        when = datetime.fromtimestamp(int(time.time() + in_s), tz=timezone.utc)
        notice = {"action": action, "time": when.strftime("%Y-%m-%dT%H:%M:%SZ")}
        with self._lock:
            self._body = json.dumps(notice).encode()
        return {**notice, "deadline_ms": int(when.timestamp() * 1000)}

    def serve_notice_after(self, delay_s: float, action: str = "terminate", in_s: float = 120.0) -> None:
        """Serve a notice ``delay_s`` seconds from now (like a spot reclaim arriving mid-run)."""
        self._timer = threading.Timer(delay_s, self.serve_notice, kwargs={"action": action, "in_s": in_s})
        self._timer.daemon = True
        self._timer.start()

    def clear(self) -> None:
        """Back to 404: no notice."""
        with self._lock:
            self._body = None

    def expire_tokens(self) -> None:
        """Forget every issued token (as after the service restarts): the next GET gets 401."""
        with self._lock:
            self._tokens.clear()

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._httpd.shutdown()
        self._httpd.server_close()

    def __enter__(self) -> ImdsServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def main() -> None:
    parser = argparse.ArgumentParser(description="IMDSv2 imitation for spot-notice tests")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--notice-after", type=float, default=-1.0, help="seconds until a notice; <0 = never")
    parser.add_argument("--action", default="terminate")
    parser.add_argument("--in-s", type=float, default=120.0, help="notice deadline, seconds after it appears")
    args = parser.parse_args()
    server = ImdsServer(args.port)
    if args.notice_after >= 0:
        server.serve_notice_after(args.notice_after, action=args.action, in_s=args.in_s)
    print(server.url, flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        server.close()


if __name__ == "__main__":
    main()
