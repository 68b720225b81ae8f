"""The S3 address a run knows, as a TCP relay in front of a local S3 server (moto): taken down, it cuts every open
connection and turns every new one away, as an S3 endpoint that vanished does, and counts what it turned away
(a stopped server's refused connect cannot be counted; this one can). Used by the S3 outage test and
``bench.soak``."""

from __future__ import annotations

import socket
import struct
import threading
import time


def _close(sock: socket.socket, reset: bool = False) -> None:
    """Close a relayed connection, waking a relay thread blocked reading it; ``reset``: with an RST, as a
    vanished server drops it, not an orderly close."""
    try:
        if reset:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.shutdown(socket.SHUT_RD if reset else socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


class S3Relay:
    """The S3 address the run knows: a TCP relay to the moto server on ``target``. ``set_down(True)`` resets every
    connection open through it; while down, each new connection is reset at once and its time kept in
    ``turned_away`` (a stopped server's refused connect cannot be counted; this one can)."""

    def __init__(self, port: int, target: int):
        self.target, self.turned_away = target, []
        self._down, self._lock = False, threading.Lock()
        self._pairs: dict[tuple, int] = {}  # open connection (client, upstream) -> directions ended
        self._server = socket.create_server(("127.0.0.1", port))
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._server.accept()
            except OSError:
                return  # closed
            upstream = None
            if not self._down:
                try:
                    upstream = socket.create_connection(("127.0.0.1", self.target))
                except OSError:
                    pass
            pair = (client, upstream)
            with self._lock:  # checked again: the outage may have begun while connecting upstream
                relayed = upstream is not None and not self._down
                if relayed:
                    self._pairs[pair] = 0
                elif self._down:
                    self.turned_away.append(time.time())
            if not relayed:
                for s in pair:
                    if s is not None:
                        _close(s, reset=True)
                continue
            for src, dst in (pair, pair[::-1]):
                threading.Thread(target=self._pump, args=(src, dst, pair), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, pair: tuple) -> None:
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
            dst.shutdown(socket.SHUT_WR)  # an orderly end passed on: the other way may still carry a reply
            clean = True
        except OSError:
            clean = False  # reset by one side, or cut by the outage
        with self._lock:
            if pair not in self._pairs:
                return  # cut by the outage, or closed already
            self._pairs[pair] += 1
            if clean and self._pairs[pair] < 2:
                return
            del self._pairs[pair]
        for s in pair:
            _close(s)

    def set_down(self, down: bool) -> None:
        with self._lock:
            self._down = down
            cut = list(self._pairs) if down else []
            if down:
                self._pairs.clear()
        for pair in cut:
            for s in pair:
                _close(s, reset=True)

    def close(self) -> None:
        self._server.close()
        self.set_down(True)
