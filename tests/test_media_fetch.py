"""MediaFetcher and resolve_image against a real aiohttp server on 127.0.0.1."""

from __future__ import annotations

import asyncio
import base64
import io
import socket
import struct
import zlib
from collections import Counter
from urllib.parse import quote_from_bytes

import pytest
from aiohttp import web
from blake3 import blake3
from PIL import Image, ImageOps

from mmroute.errors import RouterError
from mmroute.media.errors import MediaError
from mmroute.media.fetch import AddressPolicy, MediaFetcher, is_forbidden
from mmroute.media.resolve import ImageRef, decode_data_url, resolve_image
from mmroute.models.base import ImageInput

LOCAL = ["127.0.0.1"]  # the test server's address, allowed explicitly


def png(size=(64, 48), color=(10, 120, 200)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, "PNG")
    return buf.getvalue()


def jpeg_rotated() -> bytes:
    im = Image.new("RGB", (80, 30))
    exif = im.getexif()
    exif[0x0112] = 6
    buf = io.BytesIO()
    im.save(buf, "JPEG", exif=exif)
    return buf.getvalue()


def bomb_png() -> bytes:
    def chunk(t, b):
        return struct.pack(">I", len(b)) + t + b + struct.pack(">I", zlib.crc32(t + b))

    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 100000, 100000, 8, 2, 0, 0, 0)) + chunk(b"IEND", b"")


class ImageServer:
    def __init__(self):
        self.hits: Counter[str] = Counter()
        self.files = {"a.png": png(), "b.png": png((10, 10), (1, 2, 3)), "rot.jpg": jpeg_rotated(), "bomb.png": bomb_png(),
                      "noise.bin": bytes(range(256)) * 4}
        self.never = asyncio.Event()
        self.runner: web.AppRunner | None = None
        self.port = 0

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/img/{name}", self.image)
        app.router.add_get("/hang", self.hang)
        app.router.add_get("/big", self.big)
        app.router.add_get("/stream", self.stream)
        app.router.add_get("/text", self.text)
        app.router.add_get("/redirect", self.redirect)
        app.router.add_get("/loop", self.loop)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        self.never.set()  # release handlers a timed-out client left behind
        if self.runner is not None:
            await self.runner.cleanup()

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}{path}"

    async def image(self, request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        self.hits[name] += 1
        if name not in self.files:
            return web.Response(status=404, text="no such image")
        return web.Response(body=self.files[name], content_type="application/octet-stream")

    async def hang(self, request: web.Request) -> web.StreamResponse:
        self.hits["hang"] += 1
        await self.never.wait()
        return web.Response(text="too late")

    async def big(self, request: web.Request) -> web.StreamResponse:
        self.hits["big"] += 1
        return web.Response(body=b"\x00" * 5000)

    async def stream(self, request: web.Request) -> web.StreamResponse:
        self.hits["stream"] += 1
        resp = web.StreamResponse()
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        for _ in range(10):
            await resp.write(b"\x89" * 1000)
        await resp.write_eof()
        return resp

    async def text(self, request: web.Request) -> web.StreamResponse:
        return web.Response(text="just some text", content_type="text/plain")

    async def redirect(self, request: web.Request) -> web.StreamResponse:
        self.hits["redirect"] += 1
        raise web.HTTPFound(request.query["to"])

    async def loop(self, request: web.Request) -> web.StreamResponse:
        self.hits["loop"] += 1
        raise web.HTTPFound("/loop")


@pytest.fixture
async def server():
    srv = ImageServer()
    await srv.start()
    yield srv
    await srv.stop()


@pytest.fixture
async def fetcher():
    f = MediaFetcher(allow_hosts=LOCAL, timeout=30.0)
    yield f
    await f.close()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


async def expect_error(coro, code: str) -> MediaError:
    with pytest.raises(MediaError) as ei:
        await coro
    err = ei.value
    assert isinstance(err, RouterError) and err.status == 400 and err.code == code, (err.code, err.message)
    assert err.body()["error"]["type"] == "BadRequestError"
    return err


# ---- identity, sizes, resolve ----------------------------------------------------------


async def test_same_picture_same_identifier(server, fetcher):
    data = server.files["a.png"]
    via_data = await resolve_image(data_url(data), fetcher)
    via_http = await resolve_image(server.url("/img/a.png"), fetcher)
    pct = "data:image/png," + quote_from_bytes(data)
    via_pct = await resolve_image(pct, fetcher)
    assert via_data.identifier == via_http.identifier == via_pct.identifier == blake3(data).hexdigest()
    assert (via_http.width, via_http.height, via_http.format, via_http.mime) == (64, 48, "PNG", "image/png")
    assert via_http.data == data
    assert via_http.to_input() == ImageInput(via_http.identifier, 64, 48)
    other = await resolve_image(server.url("/img/b.png"), fetcher)
    assert other.identifier != via_http.identifier


async def test_exif_rotated_size_over_http(server, fetcher):
    ref = await resolve_image(server.url("/img/rot.jpg"), fetcher)
    with Image.open(io.BytesIO(server.files["rot.jpg"])) as im:
        assert (ref.width, ref.height) == ImageOps.exif_transpose(im).size == (30, 80)


async def test_decoded_content_errors(server, fetcher):
    await expect_error(resolve_image(server.url("/text"), fetcher), "invalid_image")
    await expect_error(resolve_image(server.url("/img/noise.bin"), fetcher), "invalid_image")
    err = await expect_error(resolve_image(server.url("/img/bomb.png"), fetcher), "image_too_large")
    assert "100000x100000" in err.message
    small = await resolve_image(server.url("/img/a.png"), fetcher, max_pixels=64 * 48)
    assert small.width == 64
    await expect_error(resolve_image(server.url("/img/a.png"), fetcher, max_pixels=64 * 48 - 1), "image_too_large")


async def test_data_url_errors():
    data = png()
    await expect_error(resolve_image("data:text/plain;base64," + base64.b64encode(data).decode(), None), "invalid_image_url")
    await expect_error(resolve_image("data:;base64," + base64.b64encode(data).decode(), None), "invalid_image_url")
    await expect_error(resolve_image("data:image/png;base64,@@notbase64@@", None), "invalid_image_url")
    await expect_error(resolve_image("data:image/png;base64,iVBORw0KGgo", None), "invalid_image_url")  # bad padding
    b64 = base64.b64encode(data).decode()
    await expect_error(resolve_image(f"data:image/png;base64,{b64[:40]}\n{b64[40:]}", None), "invalid_image_url")
    await expect_error(resolve_image("data:image/png;base64" + b64, None), "invalid_image_url")  # no comma
    await expect_error(resolve_image("data:image/png;base64,", None), "invalid_image")
    await expect_error(resolve_image(data_url(b"GIF89a" + b"\x00" * 7), None), "invalid_image")  # truncated
    await expect_error(resolve_image(data_url(data), None, max_bytes=100), "media_too_large")
    ok = await resolve_image(data_url(data, "IMAGE/PNG"), None)
    assert ok.width == 64
    # the declared type need not match the bytes (the engine sniffs them, as we do)
    assert (await resolve_image(data_url(data, "image/jpeg"), None)).format == "PNG"
    assert decode_data_url("data:image/png;name=x.png;base64," + b64) == data


@pytest.mark.parametrize("url", ["file:///etc/passwd", "ftp://example.com/a.png", "gopher://x", "javascript:alert(1)", "", "/img/a.png"])
async def test_other_schemes_refused(url):
    await expect_error(resolve_image(url, MediaFetcher()), "invalid_image_url")


async def test_http_disabled_without_fetcher():
    await expect_error(resolve_image("http://example.com/a.png", None), "invalid_image_url")


# ---- fetcher: cache and de-duplication -------------------------------------------------


async def test_second_fetch_is_cached(server, fetcher):
    url = server.url("/img/a.png")
    first = await fetcher.fetch(url)
    second = await fetcher.fetch(url)
    assert first == second == server.files["a.png"]
    assert server.hits["a.png"] == 1 and fetcher.downloads == 1


async def test_concurrent_fetches_share_one_download(server, fetcher):
    url = server.url("/img/b.png")
    results = await asyncio.gather(*(fetcher.fetch(url) for _ in range(8)))
    assert all(r == server.files["b.png"] for r in results)
    assert server.hits["b.png"] == 1 and fetcher.downloads == 1


async def test_cache_is_bounded_by_bytes(server):
    a, b = server.files["a.png"], server.files["b.png"]
    async with MediaFetcher(allow_hosts=LOCAL, cache_bytes=max(len(a), len(b)) + 10) as f:
        await f.fetch(server.url("/img/a.png"))
        await f.fetch(server.url("/img/b.png"))  # evicts a.png
        assert f.cache.size <= max(len(a), len(b)) + 10 and len(f.cache) == 1
        await f.fetch(server.url("/img/b.png"))
        await f.fetch(server.url("/img/a.png"))
        assert server.hits["a.png"] == 2 and server.hits["b.png"] == 1


async def test_cache_entries_expire(server):
    now = [1000.0]
    async with MediaFetcher(allow_hosts=LOCAL, cache_ttl=60.0, clock=lambda: now[0]) as f:
        url = server.url("/img/a.png")
        await f.fetch(url)
        now[0] += 59.0
        await f.fetch(url)
        assert server.hits["a.png"] == 1
        now[0] += 2.0
        await f.fetch(url)
        assert server.hits["a.png"] == 2


async def test_failures_are_not_cached(server, fetcher):
    url = server.url("/img/missing.png")
    for _ in range(2):
        err = await expect_error(fetcher.fetch(url), "image_http_error")
        assert "HTTP 404" in err.message
    assert server.hits["missing.png"] == 2


# ---- fetcher: limits and failures ------------------------------------------------------


async def test_oversize_payloads(server):
    async with MediaFetcher(allow_hosts=LOCAL, max_bytes=1000) as f:
        err = await expect_error(f.fetch(server.url("/big")), "media_too_large")
        assert "1000 bytes" in err.message
        await expect_error(f.fetch(server.url("/stream")), "media_too_large")  # chunked: no length up front
    async with MediaFetcher(allow_hosts=LOCAL, max_bytes=10_000) as f:
        assert len(await f.fetch(server.url("/stream"))) == 10_000


async def test_unreachable_port():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now: connection refused
    async with MediaFetcher(allow_hosts=LOCAL, timeout=60.0) as f:
        err = await expect_error(f.fetch(f"http://127.0.0.1:{port}/x.png"), "image_unreachable")
        assert "cannot connect" in err.message


async def test_timeout_when_the_server_never_answers(server):
    async with MediaFetcher(allow_hosts=LOCAL, timeout=0.2) as f:
        err = await expect_error(f.fetch(server.url("/hang")), "image_timeout")
        assert "timed out" in err.message
    assert server.hits["hang"] == 1


async def test_too_many_redirects(server, fetcher):
    err = await expect_error(fetcher.fetch(server.url("/loop")), "image_fetch_failed")
    assert "redirects" in err.message


async def test_redirect_to_allowed_target(server, fetcher):
    target = server.url("/img/a.png")
    assert await fetcher.fetch(server.url(f"/redirect?to={target}")) == server.files["a.png"]
    assert server.hits["redirect"] == 1 and server.hits["a.png"] == 1


@pytest.mark.parametrize("bad", ["http://127.0.0", "http://", "http://host:99999/a.png", "http:///a.png"])
async def test_invalid_urls(bad, fetcher):
    with pytest.raises(MediaError) as ei:
        await fetcher.fetch(bad)
    assert ei.value.status == 400 and ei.value.code in ("invalid_url", "image_fetch_failed")


# ---- SSRF guard ------------------------------------------------------------------------


async def test_loopback_refused_by_default(server):
    async with MediaFetcher(timeout=30.0) as f:
        for host in ("127.0.0.1", "localhost", "[::1]", "[::ffff:127.0.0.1]"):
            err = await expect_error(f.fetch(server.url("/img/a.png", host)), "forbidden_address")
            assert "not allowed" in err.message
        # yarl refuses non-canonical numeric hosts before any lookup
        await expect_error(f.fetch(server.url("/img/a.png", "2130706433")), "invalid_url")
    assert server.hits["a.png"] == 0


@pytest.mark.parametrize(
    "target",
    ["http://169.254.169.254/latest/meta-data/", "http://10.1.2.3/x.png", "http://192.168.1.1/", "http://[fd00:ec2::254]/",
     "http://0.0.0.0/", "http://224.0.0.1/", "http://100.64.0.1/", "http://[fe80::1]/", "http://172.16.0.1/"],
)
async def test_private_targets_refused_without_connecting(target):
    async with MediaFetcher(timeout=30.0) as f:
        await expect_error(f.fetch(target), "forbidden_address")


@pytest.mark.parametrize("allow", [["127.0.0.1"], ["127.0.0.0/8"], ["localhost"]])
async def test_allow_hosts(server, allow):
    host = "localhost" if allow == ["localhost"] else "127.0.0.1"
    async with MediaFetcher(allow_hosts=allow, timeout=30.0) as f:
        assert await f.fetch(server.url("/img/a.png", host)) == server.files["a.png"]


async def test_redirect_to_private_address_refused(server, fetcher):
    for target in ("http://10.1.2.3/secret.png", "http://169.254.169.254/latest/meta-data/",
                   f"http://[::1]:{server.port}/img/a.png"):
        # the first hop (127.0.0.1) is allowed; the hop it redirects to is not
        err = await expect_error(fetcher.fetch(server.url(f"/redirect?to={target}")), "forbidden_address")
        assert "resolves to" in err.message
    assert server.hits["a.png"] == 0
    # only the name "localhost" is allowed: a redirect to the bare loopback address is not
    async with MediaFetcher(allow_hosts=["localhost"], timeout=30.0) as f:
        target = server.url("/img/a.png")
        await expect_error(f.fetch(server.url(f"/redirect?to={target}", "localhost")), "forbidden_address")
    assert server.hits["a.png"] == 0 and server.hits["redirect"] == 4


def test_address_classification():
    import ipaddress

    forbidden = ["127.0.0.1", "10.0.0.1", "172.31.255.255", "192.168.0.1", "169.254.169.254", "0.0.0.0", "224.0.0.251",
                 "240.0.0.1", "100.64.1.1", "::1", "::", "fe80::1", "fc00::1", "fd00:ec2::254", "ff02::1",
                 "::ffff:10.0.0.1", "2002:7f00:1::", "64:ff9b::7f00:1", "192.0.2.1", "198.18.0.1"]
    allowed = ["93.184.216.34", "8.8.8.8", "2606:4700:4700::1111", "1.1.1.1"]
    assert all(is_forbidden(ipaddress.ip_address(a)) for a in forbidden)
    assert not any(is_forbidden(ipaddress.ip_address(a)) for a in allowed)
    policy = AddressPolicy(["10.0.0.0/8", "Internal.Example.", "::1"])
    policy.check("x", "10.9.8.7")
    policy.check("internal.example", "192.168.1.1")
    policy.check("x", "::1")
    with pytest.raises(MediaError):
        policy.check("x", "192.168.1.1")


def test_imageref_repr_hides_bytes():
    ref = ImageRef("id", 1, 2, "PNG", b"\x00" * 10_000)
    assert "data" not in repr(ref) and ref.mime == "image/png"
