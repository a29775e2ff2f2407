"""Download http(s) images safely: size limit, deadline, SSRF guard, cache, de-duplication.

SSRF guard: the host is resolved by our own aiohttp resolver, which refuses loopback,
private, link-local (incl. cloud metadata 169.254.169.254), multicast, reserved,
unspecified, shared (100.64/10), 6to4/NAT64 and every other non-global address --
the ranges vLLM 0.33 ``multimodal/media/connector.py::_ip_is_blocked`` blocks, plus
``not is_global`` -- unless the host name, address or a CIDR containing it is in
``allow_hosts``. aiohttp then connects to exactly the addresses that resolver returned,
so a second DNS answer cannot swap in another address (DNS rebinding). aiohttp skips
the resolver for IP-literal hosts, so those are checked before each request. Redirects
are followed by hand, each hop checked the same way.

Error codes (all 400): ``invalid_url``, ``forbidden_address``, ``media_too_large`` (the
request is bad) and ``image_unreachable``, ``image_http_error``, ``image_timeout``,
``image_fetch_failed`` (the router could not get it; the worker might).

Cache: fetched bytes per exact URL in an LRU bounded by total bytes (entries expire
after ``cache_ttl`` seconds: the content behind a URL may change). Concurrent fetches
of one URL share one download.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import time
from collections import OrderedDict
from typing import Any, Callable, Iterable
from urllib.parse import urljoin, urlsplit

import aiohttp
from aiohttp.abc import AbstractResolver

from mmroute.media.errors import MediaError

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

_EXTRA_BLOCKED = (
    ipaddress.ip_network("100.64.0.0/10"),  # RFC 6598 shared address space
    ipaddress.ip_network("2002::/16"),  # 6to4 (embeds an IPv4 destination)
    ipaddress.ip_network("64:ff9b::/96"),  # NAT64
)
_METADATA = (ipaddress.ip_address("169.254.169.254"), ipaddress.ip_address("fd00:ec2::254"))
_REDIRECTS = (301, 302, 303, 307, 308)

SessionFactory = Callable[[aiohttp.BaseConnector], aiohttp.ClientSession]


def is_forbidden(addr: IPAddress) -> bool:
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped  # ::ffff:127.0.0.1 is 127.0.0.1
    return (
        addr in _METADATA
        or addr.is_private
        or addr.is_loopback
        or addr.is_link_local
        or addr.is_reserved
        or addr.is_multicast
        or addr.is_unspecified
        or not addr.is_global
        or any(addr in net for net in _EXTRA_BLOCKED)
    )


class AddressPolicy:
    """``allow``: host names (exact, case-insensitive), IP addresses or CIDRs that may be
    fetched even though they are not public."""

    def __init__(self, allow: Iterable[str] = ()):
        self.hosts: set[str] = set()
        self.networks: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = []
        for entry in allow:
            entry = entry.strip()
            if not entry:
                continue
            try:
                self.networks.append(ipaddress.ip_network(entry.strip("[]"), strict=False))
            except ValueError:
                self.hosts.add(entry.lower().rstrip("."))

    def check(self, host: str, ip: str) -> None:
        """Raise MediaError 400 unless ``host`` resolving to ``ip`` may be fetched."""
        if host.lower().rstrip(".") in self.hosts:
            return
        try:
            addr = ipaddress.ip_address(ip.split("%", 1)[0])
        except ValueError:
            raise MediaError(400, "forbidden_address", f"image URL host {host!r} resolved to a non-IP {ip!r}") from None
        mapped = addr.ipv4_mapped if isinstance(addr, ipaddress.IPv6Address) else None
        if any(addr in net or (mapped is not None and mapped in net) for net in self.networks):
            return
        if is_forbidden(addr):
            raise MediaError(
                400,
                "forbidden_address",
                f"image URL host {host!r} resolves to {addr}, a private, loopback, link-local or "
                "otherwise non-public address; fetching it is not allowed (see media_allow_hosts)",
            )


class _Forbidden(OSError):
    """Carries the MediaError through aiohttp's connector, which wraps OSErrors."""

    def __init__(self, error: MediaError):
        super().__init__(str(error))
        self.error = error


class GuardedResolver(AbstractResolver):
    """Resolve with the event loop's getaddrinfo and refuse forbidden addresses."""

    def __init__(self, policy: AddressPolicy):
        self.policy = policy

    async def resolve(self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET) -> list[dict[str, Any]]:
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM, family=family)
        out: list[dict[str, Any]] = []
        for fam, _type, proto, _canon, sockaddr in infos:
            if fam not in (socket.AF_INET, socket.AF_INET6):
                continue
            try:
                self.policy.check(host, sockaddr[0])
            except MediaError as exc:
                raise _Forbidden(exc) from None  # any forbidden answer refuses the host
            out.append(
                {
                    "hostname": host,
                    "host": sockaddr[0],
                    "port": sockaddr[1],
                    "family": fam,
                    "proto": proto,
                    "flags": socket.AI_NUMERICHOST | socket.AI_NUMERICSERV,
                }
            )
        if not out:
            raise OSError(f"no address for {host!r}")
        return out

    async def close(self) -> None:
        return None


class _ByteLRU:
    def __init__(self, max_bytes: int, ttl: float | None, clock: Callable[[], float]):
        self.max_bytes = max_bytes
        self.ttl = ttl
        self.clock = clock
        self.size = 0
        self._data: OrderedDict[str, tuple[bytes, float]] = OrderedDict()

    def get(self, key: str) -> bytes | None:
        entry = self._data.get(key)
        if entry is None:
            return None
        data, stored = entry
        if self.ttl is not None and self.clock() - stored > self.ttl:
            self._drop(key)
            return None
        self._data.move_to_end(key)
        return data

    def put(self, key: str, data: bytes) -> None:
        if len(data) > self.max_bytes:
            return
        if key in self._data:
            self._drop(key)
        self._data[key] = (data, self.clock())
        self.size += len(data)
        while self.size > self.max_bytes:
            self._drop(next(iter(self._data)))

    def _drop(self, key: str) -> None:
        data, _ = self._data.pop(key)
        self.size -= len(data)

    def __len__(self) -> int:
        return len(self._data)


class MediaFetcher:
    def __init__(
        self,
        session_factory: SessionFactory | None = None,
        *,
        max_bytes: int = 32 * 1024 * 1024,
        timeout: float = 10.0,
        allow_hosts: Iterable[str] = (),
        cache_bytes: int = 256 * 1024 * 1024,
        cache_ttl: float | None = 300.0,
        max_redirects: int = 5,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.max_bytes = max_bytes
        self.timeout = timeout
        self.max_redirects = max_redirects
        self.policy = AddressPolicy(allow_hosts)
        self.cache = _ByteLRU(cache_bytes, cache_ttl, clock)
        self.downloads = 0  # network fetches started (cache misses not joined to one in flight)
        self._session_factory = session_factory
        self._session: aiohttp.ClientSession | None = None
        self._inflight: dict[str, asyncio.Future[bytes]] = {}

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> "MediaFetcher":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(resolver=GuardedResolver(self.policy), use_dns_cache=False)
            if self._session_factory is not None:
                self._session = self._session_factory(connector)
            else:
                self._session = aiohttp.ClientSession(connector=connector, trust_env=False)
        return self._session

    async def fetch(self, url: str) -> bytes:
        """The bytes behind an http(s) URL; MediaError 400 on any failure."""
        cached = self.cache.get(url)
        if cached is not None:
            return cached
        fut = self._inflight.get(url)
        if fut is None:
            fut = asyncio.ensure_future(self._download(url))
            self._inflight[url] = fut
            fut.add_done_callback(lambda f, u=url: self._settle(u, f))
        return await asyncio.shield(fut)

    def _settle(self, url: str, fut: asyncio.Future[bytes]) -> None:
        if self._inflight.get(url) is fut:
            del self._inflight[url]
        if fut.cancelled():
            return
        if fut.exception() is None:  # also marks a failure as retrieved
            self.cache.put(url, fut.result())

    def _check_url(self, url: str) -> tuple[str, str]:
        try:
            parts = urlsplit(url)
            host = parts.hostname
            parts.port  # noqa: B018 - raises ValueError on a bad port
        except ValueError as exc:
            raise MediaError(400, "invalid_url", f"invalid image URL: {exc}") from None
        if parts.scheme not in ("http", "https") or not host:
            raise MediaError(400, "invalid_url", f"image URLs must be http(s) with a host, got {url[:100]!r}")
        try:
            ipaddress.ip_address(host.split("%", 1)[0])
        except ValueError:
            return parts.scheme, host  # a name: checked by GuardedResolver on connect
        self.policy.check(host, host)  # IP literal: aiohttp would not ask the resolver
        return parts.scheme, host

    async def _download(self, url: str) -> bytes:
        self.downloads += 1
        try:
            return await asyncio.wait_for(self._follow(url), self.timeout)
        except asyncio.TimeoutError:
            raise MediaError(400, "image_timeout", f"fetching {_short(url)} timed out after {self.timeout:g}s") from None

    async def _follow(self, url: str) -> bytes:
        session = self._get_session()
        current = url
        for _hop in range(self.max_redirects + 1):
            self._check_url(current)
            try:
                async with session.get(
                    current, allow_redirects=False, headers={"Accept": "image/*"}, auto_decompress=True
                ) as resp:
                    if resp.status in _REDIRECTS and "Location" in resp.headers:
                        current = urljoin(current, resp.headers["Location"])
                        continue
                    if resp.status != 200:
                        raise MediaError(400, "image_http_error", f"fetching {_short(current)} returned HTTP {resp.status}")
                    return await self._read(resp, current)
            except _Forbidden as exc:
                raise exc.error from None
            except aiohttp.InvalidURL as exc:  # e.g. a non-canonical numeric IPv4 host
                raise MediaError(400, "invalid_url", f"invalid image URL {_short(current)}: {exc}") from None
            except aiohttp.ClientConnectorError as exc:
                if isinstance(exc.os_error, _Forbidden):
                    raise exc.os_error.error from None
                raise MediaError(400, "image_unreachable", f"cannot connect to {_short(current)}: {exc.os_error}") from None
            except aiohttp.ClientError as exc:
                raise MediaError(400, "image_fetch_failed", f"fetching {_short(current)} failed: {exc}") from None
        raise MediaError(400, "image_fetch_failed", f"fetching {_short(url)}: more than {self.max_redirects} redirects")

    async def _read(self, resp: aiohttp.ClientResponse, url: str) -> bytes:
        too_large = MediaError(
            400, "media_too_large", f"the image at {_short(url)} is larger than {self.max_bytes} bytes"
        )
        if resp.content_length is not None and resp.content_length > self.max_bytes:
            raise too_large
        buf = bytearray()
        async for chunk in resp.content.iter_chunked(64 * 1024):
            buf += chunk
            if len(buf) > self.max_bytes:
                raise too_large  # leaving the context closes (aborts) the connection
        return bytes(buf)


def _short(url: str) -> str:
    return url if len(url) <= 120 else url[:117] + "..."
