"""The kept engine's wire: length-prefixed pickled messages over a Unix socket.

Pickle is safe here only because both ends are the same user: the socket's folder is the
user's alone, the client refuses a socket another user owns, and the server refuses a peer
whose credentials (SO_PEERCRED) name another user before it reads a byte of the peer's."""

from __future__ import annotations

import pickle
import socket
import struct
from typing import Any

_HEADER = struct.Struct("!Q")
_MAX_MESSAGE = 1 << 31  # a batch of prompts' ids is megabytes; a corrupt header is not


class ConnectionClosed(ConnectionError):
    """The other end closed the connection (or died)."""


def send(sock: socket.socket, message: Any) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    sock.sendall(_HEADER.pack(len(data)) + data)


def receive(sock: socket.socket) -> Any:
    (size,) = _HEADER.unpack(_exactly(sock, _HEADER.size))
    if size > _MAX_MESSAGE:
        raise ConnectionClosed(f"a message of {size} bytes: not a batchllm peer")
    return pickle.loads(_exactly(sock, size))


def _exactly(sock: socket.socket, size: int) -> bytes:
    chunks, needed = [], size
    while needed:
        chunk = sock.recv(min(needed, 1 << 20))
        if not chunk:
            raise ConnectionClosed("the connection was closed")
        chunks.append(chunk)
        needed -= len(chunk)
    return b"".join(chunks)


def peer_uid(sock: socket.socket) -> int:
    """The user id of the process at the other end of a Unix socket (Linux SO_PEERCRED)."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return uid
