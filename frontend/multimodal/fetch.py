"""HTTP(S) downloads of request media, held to one total deadline and a byte cap.

A socket timeout alone bounds each recv, not the download: a server that drips a byte a second (in the headers
or the body) would keep it alive forever, and DNS resolution takes no timeout at all. So the download runs on a
worker thread that the caller waits on for the deadline; past it, the caller gives up and shuts the worker's
sockets, so the worker ends soon after instead of at the server's pleasure.
"""
from __future__ import annotations

import http.client
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any, Optional

from pagedserve.common.errors import RequestError
from pagedserve.common.version import __version__

_CHUNK_BYTES = 64 * 1024
_MAX_SHOWN_URL = 200        # a URL named in an error is cut to this many characters (it is echoed to the client)


def shown_url(url: str) -> str:
    """`url` as an error message names it."""
    return url if len(url) <= _MAX_SHOWN_URL else url[:_MAX_SHOWN_URL] + "..."


def fetch_url(url: str, timeout_s: float, max_bytes: Optional[int], field: str) -> bytes:
    """The body of `url` (http or https), or a RequestError at `field` naming the URL and the reason. Returns or
    raises within `timeout_s` seconds, whatever the server or the resolver does."""
    download = _Download(url, time.monotonic() + timeout_s, max_bytes)
    worker = threading.Thread(target=download.run, name="media-fetch", daemon=True)
    worker.start()
    worker.join(timeout_s)
    late = worker.is_alive()
    if late:
        download.abort()     # the shut socket may end the worker with a short body: `late` stands, not that
    if late or download.timed_out:
        raise RequestError.at(field, f"fetching {shown_url(url)} timed out after {timeout_s:g} s")
    if download.error is not None:
        raise RequestError.at(field, f"fetching {shown_url(url)} failed: {download.error}")
    return download.body


class _Download:
    """One download on its worker thread: what it got (`body`) or why not (`error`, a reason for the user)."""

    def __init__(self, url: str, deadline: float, max_bytes: Optional[int]) -> None:
        self.url = url
        self.deadline = deadline
        self.max_bytes = max_bytes
        self.body = b""
        self.error: Optional[str] = None
        # Its own socket timeout or deadline check may fire a moment before the caller's wait ends: the same event.
        self.timed_out = False
        self._lock = threading.Lock()
        self._aborted = False
        self._sockets: list[socket.socket] = []

    def run(self) -> None:
        try:
            self.body = self._get()
        except TimeoutError:
            self.timed_out = True
        except urllib.error.HTTPError as exc:
            self.error = f"HTTP {exc.code} {exc.reason}"
            exc.close()
        except urllib.error.URLError as exc:
            self.timed_out = isinstance(exc.reason, TimeoutError)
            self.error = str(exc.reason)
        except _TooLarge as exc:
            self.error = str(exc)
        except (OSError, http.client.HTTPException, ValueError) as exc:
            self.error = str(exc) or type(exc).__name__
        finally:
            self._forget_sockets()

    def _get(self) -> bytes:
        opener = _opener(self)
        request = urllib.request.Request(self.url, headers={"User-Agent": f"pagedserve/{__version__}"})
        with opener.open(request, timeout=self._remaining()) as response:
            declared = response.headers.get("Content-Length", "")
            if self.max_bytes is not None and declared.isdigit() and int(declared) > self.max_bytes:
                raise _TooLarge(f"the response declares {declared} bytes, over the limit of {self.max_bytes}")
            return self._read(response)

    def _read(self, response: Any) -> bytes:
        chunks: list[bytes] = []
        size = 0
        while chunk := response.read1(_CHUNK_BYTES):
            size += len(chunk)
            if self.max_bytes is not None and size > self.max_bytes:
                raise _TooLarge(f"the response is over the limit of {self.max_bytes} bytes")
            if time.monotonic() > self.deadline or self._aborted:
                raise TimeoutError("timed out")
            chunks.append(chunk)
        return b"".join(chunks)

    def _remaining(self) -> float:
        return max(self.deadline - time.monotonic(), 0.001)

    def watch(self, sock: socket.socket) -> None:
        """A connection's socket, to shut if the caller gives up (at once if it already has)."""
        with self._lock:
            self._sockets.append(sock)
            aborted = self._aborted
        if aborted:
            _shut(sock)

    def abort(self) -> None:
        with self._lock:
            self._aborted = True
            sockets = list(self._sockets)
        for sock in sockets:
            _shut(sock)

    def _forget_sockets(self) -> None:
        # Closed by now (the response or urllib closed them): nothing left for abort to shut.
        with self._lock:
            self._sockets.clear()


def _opener(download: _Download) -> urllib.request.OpenerDirector:
    """urllib's default opener without its ftp: and file: handlers: a redirect may lead only to http(s)."""
    opener = urllib.request.OpenerDirector()
    for handler in (urllib.request.ProxyHandler(), _HTTPHandler(download), _HTTPSHandler(download),
                    urllib.request.HTTPDefaultErrorHandler(), urllib.request.HTTPRedirectHandler(),
                    urllib.request.HTTPErrorProcessor()):
        opener.add_handler(handler)
    return opener


class _TooLarge(Exception):
    pass


def _shut(sock: socket.socket) -> None:
    # shutdown, not close: it wakes a recv blocked on another thread, and the fd stays the worker's to close.
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass        # already closed, or never connected


class _WatchedHTTPConnection(http.client.HTTPConnection):
    def __init__(self, host: str, *, download: _Download, **kwargs: Any) -> None:
        super().__init__(host, **kwargs)
        self._download = download

    def connect(self) -> None:
        super().connect()
        self._download.watch(self.sock)


class _WatchedHTTPSConnection(_WatchedHTTPConnection, http.client.HTTPSConnection):
    """TLS on top: the socket watched is the wrapped one, once the handshake is done."""


class _HTTPHandler(urllib.request.HTTPHandler):
    def __init__(self, download: _Download) -> None:
        super().__init__()
        self._download = download

    def http_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(_connection(_WatchedHTTPConnection, self._download), req)


class _HTTPSHandler(urllib.request.HTTPSHandler):
    def __init__(self, download: _Download) -> None:
        super().__init__()
        self._download = download

    def https_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(_connection(_WatchedHTTPSConnection, self._download), req, context=self._context)


def _connection(cls: type[_WatchedHTTPConnection], download: _Download) -> Callable[..., _WatchedHTTPConnection]:
    """The connection class urllib's do_open calls, with `download` bound (do_open passes host and options)."""
    def make(host: str, **kwargs: Any) -> _WatchedHTTPConnection:
        return cls(host, download=download, **kwargs)
    return make
