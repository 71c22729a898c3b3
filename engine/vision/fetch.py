"""Images fetched from http(s) URLs, as a server inside a private network must fetch them: a size cap, a time
limit, a redirect limit, and no private, loopback or link-local address unless allowed (a URL chosen by a
client must not reach the worker's own network). The check runs in the connector's resolver, on every address
the host resolves to, for the first request and each redirect alike, so the address checked is the address
connected to."""
from __future__ import annotations

import asyncio
import ipaddress
import socket
from urllib.parse import urljoin, urlsplit

import aiohttp
from aiohttp.abc import AbstractResolver
from aiohttp.resolver import ThreadedResolver

from engine.vision.images import ImageError, MediaLimits, at_detail, decode_data_url, decode_image


def _public(address: str) -> bool:
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_global and not ip.is_multicast


class _CheckingResolver(AbstractResolver):
    """The default resolver, refusing a host any of whose addresses is not public."""

    def __init__(self):
        self._inner = ThreadedResolver()

    async def resolve(self, host: str, port: int = 0, family: int = socket.AF_INET):
        infos = await self._inner.resolve(host, port, family)
        for info in infos:
            if not _public(info["host"]):
                raise ImageError(f"the image URL's host {host} resolves to a private, loopback or link-local "
                                 f"address ({info['host']}), which the worker does not fetch from")
        return infos

    async def close(self) -> None:
        await self._inner.close()


def _check_url(url: str, limits: MediaLimits) -> None:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ImageError("an image URL must be an http(s) URL or a data: URL")
    host = parts.hostname.lower().rstrip(".")
    if limits.allowed_domains is not None and not any(host == d or host.endswith("." + d)
                                                      for d in limits.allowed_domains):
        raise ImageError(f"the image URL's host {host} is not in ALLOWED_MEDIA_DOMAINS")
    try:
        literal = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return
    if not limits.allow_private and not _public(str(literal)):
        raise ImageError(f"the image URL's address {host} is private, loopback or link-local, which the worker "
                         f"does not fetch from")


async def fetch_image_bytes(url: str, limits: MediaLimits) -> bytes:
    """The body at `url`, following at most `max_redirects` redirects, within the size and time limits (the time
    limit covers the whole fetch, redirects included)."""
    try:
        return await asyncio.wait_for(_fetch(url, limits), limits.fetch_timeout)
    except asyncio.TimeoutError:
        raise ImageError(f"fetching the image took longer than {limits.fetch_timeout:g} s") from None


async def _fetch(url: str, limits: MediaLimits) -> bytes:
    resolver = None if limits.allow_private else _CheckingResolver()
    connector = aiohttp.TCPConnector(resolver=resolver, force_close=True)
    try:
        async with aiohttp.ClientSession(connector=connector, trust_env=False) as session:
            for _ in range(limits.max_redirects + 1):
                _check_url(url, limits)
                async with session.get(url, allow_redirects=False) as response:
                    if response.status in (301, 302, 303, 307, 308) and "Location" in response.headers:
                        url = urljoin(url, response.headers["Location"])
                        continue
                    if response.status != 200:
                        raise ImageError(f"fetching the image failed: HTTP {response.status}")
                    length = response.content_length
                    if length is not None and length > limits.max_image_bytes:
                        raise ImageError(f"the image is larger than the limit of {limits.max_image_bytes} bytes")
                    body = bytearray()
                    async for chunk in response.content.iter_chunked(65536):
                        body += chunk
                        if len(body) > limits.max_image_bytes:
                            raise ImageError(f"the image is larger than the limit of {limits.max_image_bytes} "
                                             f"bytes")
                    return bytes(body)
            raise ImageError(f"fetching the image took more than {limits.max_redirects} redirects")
    except aiohttp.ClientConnectorError as exc:
        if isinstance(exc.os_error, ImageError):
            raise exc.os_error from None
        raise ImageError(f"fetching the image failed: {exc}") from None
    except aiohttp.ClientError as exc:
        raise ImageError(f"fetching the image failed: {exc}") from None


async def load_image(url: str, limits: MediaLimits, detail: str | None = None):
    """The picture a `data:` or http(s) URL names, at the `detail` level asked for (images.at_detail); decoding
    runs off the event loop."""
    if url.startswith("data:"):
        return await asyncio.to_thread(lambda: at_detail(decode_data_url(url, limits), detail))
    data = await fetch_image_bytes(url, limits)
    return await asyncio.to_thread(lambda: at_detail(decode_image(data, limits), detail))
