"""A free TCP port on the loopback interface, for the servers and clusters that tests start (one helper for all)."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A port nothing listens on now; the caller binds it soon after (another process may take it meanwhile)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
