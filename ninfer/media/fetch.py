"""HTTP(S) media fetch: timeouts, a byte cap, a redirect limit and the SSRF guard on every hop.

Each hop's host is resolved once here, every resolved address is checked, and the connection goes
to the checked address itself (the Host header and TLS server name keep the original host), so a
resolver answering differently the second time cannot steer the fetch elsewhere. Environment
proxies are ignored for the same reason. Errors name the host, never the query string.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from urllib.parse import urljoin, urlsplit

import httpx

from ninfer.media.address_policy import AddressPolicy
from ninfer.media.errors import InvalidMedia, MediaBudgetExceeded, MediaFetchFailed, MediaFetchTimeout

# host, port → resolved address strings
Resolver = Callable[[str, int], Awaitable[list[str]]]

REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})
DEFAULT_PORTS = {"http": 80, "https": 443}


async def system_resolver(host: str, port: int) -> list[str]:
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(info[4][0] for info in infos))


@dataclass(frozen=True)
class FetchPolicy:
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 15.0  # longest wait for the next chunk of the body
    total_timeout_s: float = 60.0  # the whole fetch, redirects included
    max_bytes: int = 64 * 1024 * 1024
    max_redirects: int = 3
    addresses: AddressPolicy = field(default_factory=AddressPolicy)


@dataclass(frozen=True)
class _Hop:
    url: str  # as the client gave it or the redirect named it
    scheme: str
    host: str
    port: int
    target: str  # the same URL with the checked address in place of the host


def _parse(url: str) -> tuple[str, str, int, str]:
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        raise InvalidMedia("URL is malformed") from None
    scheme = parts.scheme.lower()
    if scheme not in DEFAULT_PORTS:
        raise InvalidMedia(f"URL scheme {scheme!r} is not http or https")
    if not parts.hostname:
        raise InvalidMedia("URL has no host")
    try:
        parts.hostname.encode("idna")  # what the resolver will do: a host it cannot encode is no host
    except UnicodeError:
        raise InvalidMedia("URL host is not a valid host name") from None
    if parts.username is not None or parts.password is not None:
        raise InvalidMedia("URL must not carry credentials")
    path = parts.path or "/"
    if parts.query:
        path += "?" + parts.query
    return scheme, parts.hostname, port or DEFAULT_PORTS[scheme], path


async def _resolve_checked(host: str, port: int, policy: FetchPolicy, resolver: Resolver) -> str:
    try:
        literal = ipaddress.ip_address(host)
        candidates = [str(literal)]
    except ValueError:
        try:
            candidates = await resolver(host, port)
        except OSError:
            raise MediaFetchFailed(f"host {host} did not resolve") from None
    if not candidates:
        raise MediaFetchFailed(f"host {host} did not resolve")
    # Every answer must pass: a mixed answer would let the connection pick the refused one.
    for text in candidates:
        reason = policy.addresses.refusal(ipaddress.ip_address(text.split("%")[0]))
        if reason is not None:
            raise MediaFetchFailed(f"host {host} resolves to {reason}, which media fetches may not reach")
    return candidates[0].split("%")[0]


async def _hop(url: str, policy: FetchPolicy, resolver: Resolver) -> _Hop:
    scheme, host, port, path = _parse(url)
    address = await _resolve_checked(host, port, policy, resolver)
    netloc = f"[{address}]" if ":" in address else address
    return _Hop(url, scheme, host, port, f"{scheme}://{netloc}:{port}{path}")


async def _fetch(url: str, policy: FetchPolicy, resolver: Resolver) -> bytes:
    timeout = httpx.Timeout(policy.read_timeout_s, connect=policy.connect_timeout_s)
    async with httpx.AsyncClient(timeout=timeout, follow_redirects=False, trust_env=False) as client:
        hop = await _hop(url, policy, resolver)
        for _ in range(policy.max_redirects + 1):
            host_name = f"[{hop.host}]" if ":" in hop.host else hop.host
            host_header = host_name if hop.port == DEFAULT_PORTS[hop.scheme] else f"{host_name}:{hop.port}"
            extensions = {"sni_hostname": hop.host} if hop.scheme == "https" else {}
            request = client.build_request("GET", hop.target, headers={"Host": host_header}, extensions=extensions)
            response = await client.send(request, stream=True)
            try:
                if response.status_code in REDIRECT_STATUSES:
                    location = response.headers.get("location")
                    if not location:
                        raise MediaFetchFailed(f"host {hop.host} answered a redirect without a location")
                    hop = await _hop(urljoin(hop.url, location), policy, resolver)
                    continue
                if response.status_code != 200:
                    raise MediaFetchFailed(f"host {hop.host} answered HTTP {response.status_code}")
                return await _read_capped(response, policy.max_bytes)
            finally:
                await response.aclose()
        raise MediaFetchFailed(f"more than {policy.max_redirects} redirects")


async def _read_capped(response: httpx.Response, max_bytes: int) -> bytes:
    declared = response.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise MediaBudgetExceeded(f"media is {declared} bytes, above the {max_bytes}-byte limit")
    chunks: list[bytes] = []
    received = 0
    async for chunk in response.aiter_bytes():
        received += len(chunk)
        if received > max_bytes:
            raise MediaBudgetExceeded(f"media is larger than the {max_bytes}-byte limit")
        chunks.append(chunk)
    if not received:
        raise InvalidMedia("remote media is empty")
    return b"".join(chunks)


async def fetch_media(url: str, policy: FetchPolicy, resolver: Resolver | None = None) -> bytes:
    """GET an http(s) URL under `policy`; raises MediaError subclasses only."""
    try:
        async with asyncio.timeout(policy.total_timeout_s):
            return await _fetch(url, policy, resolver or system_resolver)
    except TimeoutError:
        raise MediaFetchTimeout(f"fetch took longer than {policy.total_timeout_s:g} s") from None
    except httpx.TimeoutException as error:
        raise MediaFetchTimeout(f"fetch timed out ({type(error).__name__})") from None
    except httpx.HTTPError as error:
        raise MediaFetchFailed(f"fetch failed ({type(error).__name__})") from None
