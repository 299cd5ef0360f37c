"""frontend/multimodal: images from data:, http(s) and file:// URLs, against real images made with Pillow, a real
HTTP server on this machine (slow, missing and oversize routes) and real files and symlinks."""
from __future__ import annotations

import asyncio
import base64
import io
import os
import socket
import struct
import threading
import time
import zlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from PIL import Image

from pagedserve.common.errors import RequestError
from pagedserve.frontend.multimodal.media import MediaLimits, load_image, load_image_async

FIELD = "messages[0].content[1].image_url.url"
COLOUR = (200, 40, 10)


def encode(fmt: str, size: tuple[int, int] = (16, 12), mode: str = "RGB") -> bytes:
    out = io.BytesIO()
    Image.new(mode, size, COLOUR if mode == "RGB" else (*COLOUR, 128)).save(out, format=fmt)
    return out.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def _chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def png_header(width: int, height: int) -> bytes:
    """A valid PNG header claiming width x height, with the data of a few bytes: a size to read, and an image
    that fails to decode (truncated)."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", zlib.compress(b"\0" * 10))
            + _chunk(b"IEND", b""))


def refused(url: str, limits: MediaLimits | None = None) -> str:
    with pytest.raises(RequestError) as info:
        load_image(url, limits or MediaLimits(), FIELD)
    assert info.value.field == FIELD and info.value.message.startswith(FIELD + ": ")
    return info.value.message


# --- data: URLs ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt,mime", [("PNG", "image/png"), ("JPEG", "image/jpeg"), ("WEBP", "image/webp"),
                                      ("GIF", "image/gif"), ("BMP", "image/bmp")])
def test_a_data_url_of_each_supported_format_loads_as_rgb(fmt, mime):
    image = load_image(data_url(encode(fmt), mime), MediaLimits(), FIELD)
    assert (image.mode, image.size) == ("RGB", (16, 12))
    pixel = image.getpixel((3, 3))
    assert all(abs(a - b) <= 12 for a, b in zip(pixel, COLOUR)), pixel     # JPEG and GIF are lossy


def test_rgba_is_converted_to_rgb():
    image = load_image(data_url(encode("PNG", mode="RGBA")), MediaLimits(), FIELD)
    assert image.mode == "RGB" and image.getpixel((0, 0)) == COLOUR


@pytest.mark.parametrize("fmt", ["TIFF", "ICO"])
def test_a_format_pil_reads_but_we_do_not_accept_is_refused(fmt):
    assert "unsupported image format " + fmt in refused(data_url(encode(fmt), "image/" + fmt.lower()))


def test_broken_base64_is_refused():
    assert "is not valid base64" in refused("data:image/png;base64,iVBOR@@@not-base64")


def test_bytes_that_are_not_an_image_are_refused():
    message = refused(data_url(b"hello, I am not a picture"))
    assert "is not an image PIL can read: no image format PIL knows" in message


def test_a_truncated_image_is_refused_when_decoded():
    assert "is not an image PIL can read" in refused(data_url(encode("PNG", (64, 64))[:-30]))


def test_a_data_url_that_is_not_an_image_type_is_refused():
    assert "'text/plain', not image/" in refused(data_url(b"hello", "text/plain"))


def test_a_data_url_that_is_not_base64_is_refused():
    assert "only base64 data URLs" in refused("data:image/png,rawbytes")


@pytest.mark.parametrize("url,named", [("ftp://example.com/a.png", "'ftp'"), ("a.png", "without a scheme")])
def test_other_schemes_are_refused_naming_the_supported_ones(url, named):
    message = refused(url)
    assert named in message and "data:, http:, https:, file:" in message


# --- sizes ---------------------------------------------------------------------------------------------------


def test_encoded_bytes_over_the_limit_are_refused():
    data = encode("BMP")
    assert load_image(data_url(data, "image/bmp"), MediaLimits(max_image_bytes=len(data)), FIELD).size == (16, 12)
    assert f"over the limit of {len(data) - 1} bytes" in refused(data_url(data, "image/bmp"),
                                                                 MediaLimits(max_image_bytes=len(data) - 1))


def test_pixels_over_the_limit_are_refused():
    url = data_url(encode("PNG", (20, 10)))
    assert load_image(url, MediaLimits(max_image_pixels=200), FIELD).size == (20, 10)
    assert "20x10 = 200 pixels, over the limit of 199" in refused(url, MediaLimits(max_image_pixels=199))


def test_pixels_are_checked_from_the_header_before_any_decoding():
    # Decoding would fail (truncated): a pixel refusal proves the size was read first.
    assert "truncated" in refused(data_url(png_header(5000, 5000)))
    assert "over the limit of 1000000" in refused(data_url(png_header(5000, 5000)),
                                                  MediaLimits(max_image_pixels=1_000_000))


def test_without_a_pixel_limit_pil_s_bomb_limit_still_refuses():
    over_warning = Image.MAX_IMAGE_PIXELS + 1
    with pytest.warns(Image.DecompressionBombWarning):      # PIL only warns here; we refuse
        assert "over the limit of" in refused(data_url(png_header(over_warning, 1)))
    assert "is too large" in refused(data_url(png_header(50_000, 50_000)))      # PIL's DecompressionBombError


def test_the_fetch_timeout_defaults_to_vllm_s_variable(monkeypatch):
    monkeypatch.delenv("VLLM_IMAGE_FETCH_TIMEOUT", raising=False)
    assert MediaLimits().fetch_timeout_s == 5.0
    monkeypatch.setenv("VLLM_IMAGE_FETCH_TIMEOUT", "2.5")
    assert MediaLimits().fetch_timeout_s == 2.5


def test_limits_that_cannot_hold_are_an_operator_error():
    with pytest.raises(ValueError, match="fetch_timeout_s"):
        MediaLimits(fetch_timeout_s=0)
    with pytest.raises(ValueError, match="max_image_bytes"):
        MediaLimits(max_image_bytes=0)


# --- file:// URLs --------------------------------------------------------------------------------------------


@pytest.fixture
def folders(tmp_path: Path) -> tuple[Path, Path]:
    allowed, outside = tmp_path / "allowed", tmp_path / "outside"
    allowed.mkdir()
    outside.mkdir()
    (allowed / "in.png").write_bytes(encode("PNG"))
    (outside / "out.png").write_bytes(encode("PNG"))
    (allowed / "escape.png").symlink_to(outside / "out.png")
    return allowed, outside


def test_a_file_under_the_allowed_folder_loads(folders):
    allowed, _ = folders
    image = load_image((allowed / "in.png").as_uri(), MediaLimits(allowed_local_media_path=str(allowed)), FIELD)
    assert image.size == (16, 12)


def test_file_urls_are_refused_without_the_flag(folders):
    allowed, _ = folders
    message = refused((allowed / "in.png").as_uri())
    assert str(allowed / "in.png") in message and "--allowed-local-media-path" in message


@pytest.mark.parametrize("name", ["outside", "symlink", "dotdot"])
def test_a_file_outside_the_allowed_folder_is_refused(folders, name):
    allowed, outside = folders
    url = {"outside": (outside / "out.png").as_uri(), "symlink": (allowed / "escape.png").as_uri(),
           "dotdot": f"file://{allowed}/../outside/out.png"}[name]
    message = refused(url, MediaLimits(allowed_local_media_path=str(allowed)))
    assert "is outside --allowed-local-media-path" in message


def test_a_missing_file_is_refused_naming_it(folders):
    allowed, _ = folders
    message = refused((allowed / "nope.png").as_uri(), MediaLimits(allowed_local_media_path=str(allowed)))
    assert f"cannot read {allowed / 'nope.png'}" in message


def test_a_fifo_under_the_allowed_folder_is_refused_without_blocking(folders):
    allowed, _ = folders
    os.mkfifo(allowed / "pipe.png")         # nothing ever writes it: reading it would wait forever
    message = refused((allowed / "pipe.png").as_uri(), MediaLimits(allowed_local_media_path=str(allowed)))
    assert "not a regular file" in message


def test_a_file_over_the_byte_limit_is_refused(folders):
    allowed, _ = folders
    limits = MediaLimits(allowed_local_media_path=str(allowed), max_image_bytes=20)
    assert "over the limit of 20 bytes" in refused((allowed / "in.png").as_uri(), limits)


# --- http(s) URLs --------------------------------------------------------------------------------------------


class _Handler(BaseHTTPRequestHandler):
    server: "_Server"

    def do_GET(self) -> None:
        if self.path == "/drip-body":
            self.send_response(200)
            self.send_header("Content-Length", "1000000")
            self.end_headers()
            self._drip()
        elif self.path == "/drip-headers":
            self.wfile.write(b"HTTP/1.0 200 OK\r\nX-Slow: ")
            self._drip()
        elif self.path == "/redirect":
            self.send_response(302)
            self.send_header("Location", "/img.webp")
            self.end_headers()
        elif self.path in self.server.files:
            self.send_response(200)
            if self.path != "/big-undeclared":     # HTTP/1.0: the body ends when the connection does
                self.send_header("Content-Length", str(len(self.server.files[self.path])))
            self.end_headers()
            self.wfile.write(self.server.files[self.path])
        else:
            self.send_error(404)

    def _drip(self) -> None:
        try:
            while not self.server.stopping.is_set():
                self.wfile.write(b"a")
                self.server.stopping.wait(1.0)
        except OSError:
            pass            # the client gave up: what the test waits for

    def log_message(self, *args: object) -> None:
        pass


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    files: dict[str, bytes]
    stopping: threading.Event


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    httpd = _Server(("127.0.0.1", 0), _Handler)
    httpd.files = {"/img.png": encode("PNG"), "/img.webp": encode("WEBP"), "/big": b"x" * 5000,
                   "/big-undeclared": b"x" * 5000}
    httpd.stopping = threading.Event()
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.stopping.set()
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture(autouse=True)
def no_proxy(monkeypatch):
    # A proxy from the environment would stand between the client and the local server.
    for name in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(name, raising=False)


def test_an_http_image_loads(server):
    assert load_image(server + "/img.png", MediaLimits(), FIELD).size == (16, 12)


def test_a_redirect_is_followed(server):
    assert load_image(server + "/redirect", MediaLimits(), FIELD).size == (16, 12)


def test_a_404_is_refused_naming_the_url_and_status(server):
    message = refused(server + "/missing.png")
    assert f"{server}/missing.png" in message and "HTTP 404" in message


def test_a_refused_connection_is_refused_naming_the_url():
    with socket.socket() as sock:       # a port that was free a moment ago: nothing listens on it now
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}/img.png"
    message = refused(url)
    assert url in message and "refused" in message.lower()


def test_an_unresolvable_host_is_refused():
    assert "failed:" in refused("http://no-such-host.invalid/img.png", MediaLimits(fetch_timeout_s=3))


@pytest.mark.parametrize("path", ["/big", "/big-undeclared"])
def test_a_response_over_the_byte_limit_is_refused(server, path):
    assert "over the limit of 1000" in refused(server + path, MediaLimits(max_image_bytes=1000))


@pytest.mark.parametrize("path", ["/drip-body", "/drip-headers"])
def test_a_server_that_drips_a_byte_a_second_is_cut_off_at_the_deadline(server, path):
    start = time.monotonic()
    message = refused(server + path, MediaLimits(fetch_timeout_s=1))
    elapsed = time.monotonic() - start
    assert "timed out after 1 s" in message and server + path in message
    assert 0.9 < elapsed < 3.0, elapsed
    # The abandoned download's socket was shut: its thread ends now, not when the server stops.
    until = time.monotonic() + 2.0
    while any(t.name == "media-fetch" for t in threading.enumerate()) and time.monotonic() < until:
        time.sleep(0.05)
    assert not any(t.name == "media-fetch" for t in threading.enumerate())


# --- load_image_async ----------------------------------------------------------------------------------------


async def test_load_image_async_returns_the_image(server):
    assert (await load_image_async(server + "/img.png", MediaLimits(), FIELD)).size == (16, 12)
    with ThreadPoolExecutor(1) as pool:
        image = await load_image_async(data_url(encode("JPEG")), MediaLimits(), FIELD, executor=pool)
    assert image.mode == "RGB"


async def test_the_loop_keeps_running_while_a_slow_fetch_waits(server):
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    task = asyncio.create_task(ticker())
    start = time.monotonic()
    try:
        with pytest.raises(RequestError, match="timed out"):
            await load_image_async(server + "/drip-body", MediaLimits(fetch_timeout_s=1), FIELD)
    finally:
        task.cancel()
    assert time.monotonic() - start < 3.0
    assert ticks >= 20, ticks       # ~100 on an idle machine; a blocked loop would give 0 or 1
