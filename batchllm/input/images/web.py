"""http(s) images (BATCHLLM_ALLOW_HTTP_IMAGES), fetched from public addresses only.

A line's URL must not make the server or a worker reach what only they can reach. The host is
resolved and every address it resolves to is checked: loopback, private, link-local, shared,
unspecified, multicast, reserved and cloud metadata addresses are refused (all but metadata
may be let in by BATCHLLM_IMAGE_HTTP_ALLOW_NETWORKS). The connection goes to the checked
address itself, so no second resolution (which a DNS rebind could answer differently) takes
place. Redirects are followed here, at most _MAX_REDIRECTS, every hop checked the same way.

Every failure is one text to the line, its reason logged for the operator only: a tenant can
tell neither a closed port from an open one nor an internal name from a missing one. A fetch
ends by its deadline (its own timeout, or the input file's, checks.py): a watchdog closes the
socket of a server that answers a byte at a time.
"""

from __future__ import annotations

import functools
import http.client
import ipaddress
import logging
import socket
import ssl
import threading
import time
from urllib.parse import SplitResult, urljoin, urlsplit

from batchllm.input.images.problem import ImageProblem, shown
from batchllm.settings import Settings

log = logging.getLogger(__name__)

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network

_MAX_REDIRECTS = 5
_REDIRECTS = frozenset({301, 302, 303, 307, 308})
_METADATA = frozenset(
    ipaddress.ip_address(address)
    for address in (
        "169.254.169.254",  # AWS, GCP, Azure, OpenStack
        "169.254.170.2",  # AWS ECS task credentials
        "fd00:ec2::254",  # AWS over IPv6
        "100.100.100.200",  # Alibaba Cloud
        "192.0.0.192",  # Oracle Cloud
    )
)
# IPv6 ranges that carry an IPv4 address (which may be a private one) or that Python's
# is_global does not exclude: IPv4-compatible, NAT64, 6to4, Teredo.
_EMBEDDING_V4 = tuple(
    ipaddress.IPv6Network(network)
    for network in ("::/96", "64:ff9b::/96", "64:ff9b:1::/48", "2002::/16", "2001::/32")
)


class _Refused(Exception):
    """Why a fetch failed: for the log, never for the line."""


def fetch_failed(url: str) -> str:
    """The one text of every failed fetch."""
    return (
        f"cannot fetch image {shown(url)}: no answer, an error status, a refused address or "
        "over the time limits (the server's log says which)"
    )


def http_bytes(url: str, settings: Settings, deadline: float | None) -> bytes:
    """The body of an http(s) image (at most one byte more than the size limit), fetched by
    `deadline` (time.monotonic()) and within BATCHLLM_IMAGE_FETCH_TIMEOUT."""
    if not settings.allow_http_images:
        raise ImageProblem(
            "http(s) image URLs are off (set BATCHLLM_ALLOW_HTTP_IMAGES=true to fetch them); "
            "give the image as a data: URL, an s3:// object or a path under BATCHLLM_IMAGE_ROOT"
        )
    ends = time.monotonic() + settings.image_fetch_timeout
    if deadline is not None:
        ends = min(ends, deadline)
    try:
        return _fetch(url, settings, ends)
    except (_Refused, OSError, http.client.HTTPException, ValueError) as exc:
        log.info("image %s not fetched: %s", shown(url), str(exc) or type(exc).__name__)
        raise ImageProblem(fetch_failed(url)) from None


def _fetch(url: str, settings: Settings, ends: float) -> bytes:
    networks = allowed_networks(settings.image_http_allow_networks)
    for _ in range(_MAX_REDIRECTS + 1):
        body, location = _get(urlsplit(url), networks, settings.max_image_bytes + 1, ends)
        if body is not None:
            return body
        url = urljoin(url, location)
    raise _Refused(f"more than {_MAX_REDIRECTS} redirects")


def _get(
    target: SplitResult, networks: tuple[Network, ...], limit: int, ends: float
) -> tuple[bytes | None, str]:
    """One request: (the body, "") or (None, where it redirects to)."""
    if target.scheme not in ("http", "https"):
        raise _Refused(f"{target.scheme!r} is not http(s)")
    if "@" in target.netloc:
        raise _Refused("a user or password in the URL")
    host = target.hostname
    if not host:
        raise _Refused("no host")
    tls = target.scheme == "https"
    port = target.port or (443 if tls else 80)
    address = _checked_address(host, port, networks)
    connection = _PinnedConnection(host, port, address=address, tls=tls, timeout=_left(ends))
    watchdog = threading.Timer(_left(ends), _abort, (connection,))
    watchdog.daemon = True
    watchdog.start()
    try:
        path = (target.path or "/") + (f"?{target.query}" if target.query else "")
        connection.request("GET", path, headers={"Accept": "image/*", "User-Agent": "batchllm"})
        response = connection.getresponse()
        if response.status in _REDIRECTS:
            location = response.getheader("Location")
            if not location:
                raise _Refused(f"HTTP {response.status} without a Location")
            return None, location
        if response.status != 200:
            raise _Refused(f"HTTP {response.status}")
        return _body(response, limit, ends), ""
    finally:
        watchdog.cancel()
        connection.close()


def _body(response: http.client.HTTPResponse, limit: int, ends: float) -> bytes:
    chunks: list[bytes] = []
    total = 0
    while total < limit:
        _left(ends)
        chunk = response.read1(min(64 * 1024, limit - total))
        if not chunk:
            break
        chunks.append(chunk)
        total += len(chunk)
    _left(ends)  # the watchdog's close reads as the end of the body
    if total < limit and response.length:
        raise _Refused(f"the body ended {response.length:,} bytes early")
    return b"".join(chunks)


def _left(ends: float) -> float:
    """Seconds left of the fetch; _Refused when none are."""
    left = ends - time.monotonic()
    if left <= 0:
        raise _Refused("over its time limit")
    return left


def _abort(connection: http.client.HTTPConnection) -> None:
    sock = connection.sock
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)  # wakes a blocked read
        except OSError:
            pass


def _checked_address(host: str, port: int, networks: tuple[Network, ...]) -> str:
    """The address to connect to: the first the host resolves to, once every one of them is
    allowed (a name with one public and one private address is refused)."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    addresses = list(dict.fromkeys(str(info[4][0]) for info in infos))
    for text in addresses:
        if not is_allowed(ipaddress.ip_address(text.partition("%")[0]), networks):
            raise _Refused(f"{host} resolves to {text}, not a public address")
    if not addresses:
        raise _Refused(f"{host} resolves to no address")
    return addresses[0]


def is_allowed(address: Address, networks: tuple[Network, ...] = ()) -> bool:
    """Whether an image may be fetched from `address`: a public one, or one in `networks`
    that is no cloud metadata address."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    if address in _METADATA:
        return False
    if any(address in network for network in networks):
        return True
    if isinstance(address, ipaddress.IPv6Address) and any(
        address in network for network in _EMBEDDING_V4
    ):
        return False
    return address.is_global and not address.is_multicast


@functools.lru_cache(maxsize=4)
def allowed_networks(text: str) -> tuple[Network, ...]:
    """BATCHLLM_IMAGE_HTTP_ALLOW_NETWORKS parsed (settings.py has checked it)."""
    items = (item.strip() for item in text.split(","))
    return tuple(ipaddress.ip_network(item, strict=False) for item in items if item)


@functools.cache
def _tls() -> ssl.SSLContext:
    return ssl.create_default_context()


class _PinnedConnection(http.client.HTTPConnection):
    """An HTTP(S) connection to `host` (its Host header, its certificate's name) made to an
    address resolved and checked beforehand."""

    def __init__(self, host: str, port: int, *, address: str, tls: bool, timeout: float) -> None:
        super().__init__(host, port, timeout=timeout)
        self.default_port = 443 if tls else 80  # the Host header leaves a default port out
        self._address = address
        self._tls = tls

    def connect(self) -> None:
        sock = socket.create_connection((self._address, self.port), self.timeout)
        if not self._tls:
            self.sock = sock
            return
        try:
            self.sock = _tls().wrap_socket(sock, server_hostname=self.host)
        except BaseException:
            sock.close()
            raise
