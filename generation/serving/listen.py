"""The server's listening socket, bound before anything slow happens.

A 176B model takes minutes to load: a busy port, an unknown host or a port out of range must be
one error line at once, not a traceback after the load. So ``./bloom.py --serve`` binds here first
and hands the bound socket to uvicorn.
"""

from __future__ import annotations

import errno
import socket


class ListenError(ValueError):
    """The address cannot be listened on (one line for the user)."""


def bind(host: str, port: int) -> socket.socket:
    """A socket bound to (host, port) and listening, or ListenError saying why not."""
    if not 0 <= port <= 65535:
        raise ListenError(f"--port {port} is not a port number (0-65535)")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as error:
        raise ListenError(f"--host {host!r} is not an address of this machine ({error})") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: restarts need no wait
        sock.bind(address)
        sock.listen(2048)
    except OSError as error:
        sock.close()
        if error.errno == errno.EADDRINUSE:
            raise ListenError(f"{host}:{port} is already in use by another program; choose another --port") from None
        if error.errno == errno.EACCES:
            raise ListenError(f"no permission to listen on {host}:{port} (ports below 1024 need privileges)") from None
        if error.errno == errno.EADDRNOTAVAIL:
            raise ListenError(f"--host {host!r} is not an address of this machine") from None
        raise ListenError(f"cannot listen on {host}:{port}: {error.strerror or error}") from None
    sock.setblocking(False)
    return sock
