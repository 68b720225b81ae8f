"""A TCP front for the local S3 server that misbehaves as networks and S3-compatible stores do: it can lose the
reply to a conditional PUT that the server has applied (the client sees the connection drop and botocore
retries the request), or strip the conditions from every request (a store that ignores ``If-Match`` and
``If-None-Match``). Each request goes to the server over a fresh connection; replies come back whole."""

from __future__ import annotations

import socket
import threading

CONDITIONS = (b"if-match:", b"if-none-match:")


def _read_head(f) -> bytes | None:
    lines = []
    while True:
        line = f.readline()
        if not line:
            return None
        lines.append(line)
        if line in (b"\r\n", b"\n"):
            return b"".join(lines)


def _length(head: bytes) -> int | None:
    for line in head.split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value.strip())
    return None


def _read_chunked(f) -> bytes:
    out = []
    while True:
        size_line = f.readline()
        out.append(size_line)
        size = int(size_line.split(b";")[0].strip() or b"0", 16)
        if size == 0:
            while True:  # trailers, then the blank line
                line = f.readline()
                out.append(line)
                if line in (b"\r\n", b"\n", b""):
                    return b"".join(out)
        out.append(f.read(size + 2))


def _read_body(f, head: bytes, *, until_close: bool) -> bytes:
    n = _length(head)
    if n is not None:
        return f.read(n)
    if b"transfer-encoding: chunked" in head.lower():
        return _read_chunked(f)
    return f.read() if until_close else b""


class S3Proxy:
    def __init__(self, host: str, port: int):
        self.target = (host, port)
        self.lose_conditional_put_replies = 0  # how many of the next conditional PUTs' replies to lose
        self.strip_conditions = False
        self.lost: list[bytes] = []  # the request lines whose replies were lost
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def uri(self, bucket_path: str) -> str:
        return f"s3://{bucket_path}?endpoint_override=127.0.0.1:{self.port}&scheme=http&region=us-east-1"

    def close(self) -> None:
        self.server.close()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn, conn.makefile("rb") as f:
            while True:
                head = _read_head(f)
                if head is None:
                    return
                body = _read_body(f, head, until_close=False)
                lines = head.split(b"\r\n")
                conditional = any(ln.lower().startswith(CONDITIONS) for ln in lines)
                if self.strip_conditions:
                    head = b"\r\n".join(ln for ln in lines if not ln.lower().startswith(CONDITIONS))
                reply = self._forward(head, body, head_only=head.startswith(b"HEAD "))
                with self._lock:
                    lose = head.startswith(b"PUT ") and conditional and self.lose_conditional_put_replies > 0
                    if lose:
                        self.lose_conditional_put_replies -= 1
                        self.lost.append(lines[0])
                if lose:  # the server applied the write; its reply never reaches the client
                    conn.shutdown(socket.SHUT_RDWR)
                    return
                conn.sendall(reply)

    def _forward(self, head: bytes, body: bytes, *, head_only: bool) -> bytes:
        with socket.create_connection(self.target) as up, up.makefile("rb") as uf:
            up.sendall(head + body)
            reply_head = _read_head(uf) or b""
            status = reply_head.split(b" ", 2)[1] if reply_head.count(b" ") >= 2 else b""
            no_body = head_only or status in (b"204", b"304")
            return reply_head + (b"" if no_body else _read_body(uf, reply_head, until_close=True))
