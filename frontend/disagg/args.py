"""`pagedserve proxy`'s settings; each field is also a flag (common/config/arg_utils.py)."""
from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

from pagedserve.common.config.arg_utils import check_choices, setting
from pagedserve.frontend.server_args import LOG_LEVELS


@dataclass(frozen=True)
class DisaggProxyArgs:
    """Made with bad values it raises ValueError naming the flag."""
    host: str = setting("127.0.0.1", help="address the proxy listens on")
    port: int = setting(8000, help="port the proxy listens on")
    prefill: tuple[str, ...] = setting(
        (), append=True, help="a prefill instance's base URL (an engine-serve with kv_role kv_producer on the "
                              "shared folder); repeat for several, taken in turn")
    decode: tuple[str, ...] = setting(
        (), append=True, help="a decode instance's base URL (an engine-serve with kv_role kv_consumer on the "
                              "same folder); repeat for several, taken in turn")
    api_key: str | None = setting(
        None, help="require 'Authorization: Bearer KEY' of clients on every route but /health; the client's "
                   "Authorization passes through to the instances when unset")
    backend_api_key: str | None = setting(None, help="the API key the proxy presents to every instance")
    request_timeout: float = setting(
        600.0, help="seconds an instance may take to connect or stay silent mid-response before the request fails")
    max_body_bytes: int = setting(8 << 20, help="larger request bodies get HTTP 413")
    log_level: str = setting("info", choices=LOG_LEVELS, help="log messages of this level and above")

    def __post_init__(self) -> None:
        for name in ("prefill", "decode"):
            if isinstance(getattr(self, name), list):       # DisaggProxyArgs(...) from Python code
                object.__setattr__(self, name, tuple(getattr(self, name)))
        self.validate()

    def validate(self) -> None:
        check_choices(self, as_flags=True)
        for flag, urls in (("--prefill", self.prefill), ("--decode", self.decode)):
            if not urls:
                raise ValueError(f"give at least one {flag} URL")
            for url in urls:
                parts = urlsplit(url)
                if parts.scheme not in ("http", "https") or not parts.netloc:
                    raise ValueError(f"{flag} must be an http(s)://HOST:PORT URL, got {url!r}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in [0, 65535], got {self.port}")
        if not self.request_timeout > 0:
            raise ValueError(f"--request-timeout must be positive, got {self.request_timeout}")
        if self.max_body_bytes <= 0:
            raise ValueError(f"--max-body-bytes must be a positive integer, got {self.max_body_bytes}")
