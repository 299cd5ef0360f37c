"""engine-serve processes shared across test modules, one per configuration (tests/conftest.py's
`server_pool`): a module asks for a configuration and gets the running server if one has it, so the suite
boots each shared configuration once instead of once per module.

An idle server keeps its processes and KV cache, so at most `max_alive` stay up: asking for another stops
the least recently used one (checked clean: no child process, no ipc file left). A server that exited is an
error for whoever asks next, not silently replaced: a test broke it. Tests that kill, stop or wedge their
server, or read counters that other modules' requests would move, boot their own `Server` instead."""
from __future__ import annotations

from collections import OrderedDict
from typing import Any

from pagedserve.tests.helpers.server import Server

_Key = tuple[tuple[str, ...], tuple[tuple[str, Any], ...]]


class ServerPool:
    def __init__(self, max_alive: int) -> None:
        if max_alive < 1:
            raise ValueError(f"max_alive must be >= 1, got {max_alive}")
        self.max_alive = max_alive
        self._servers: OrderedDict[_Key, Server] = OrderedDict()    # least recently used first

    def get(self, *extra: str, **options: Any) -> Server:
        """The server started as Server(*extra, **options), booting it if none is running."""
        key = (tuple(extra), tuple(sorted(options.items())))
        server = self._servers.get(key)
        if server is not None:
            if server.proc.poll() is not None:
                del self._servers[key]
                raise RuntimeError(f"the shared engine-serve {extra} {options} exited (code "
                                   f"{server.proc.returncode}): {server.output()[-3000:]}")
            self._servers.move_to_end(key)
            return server
        while len(self._servers) >= self.max_alive:
            _, oldest = self._servers.popitem(last=False)
            oldest.stop_and_check_clean()
        server = Server(*extra, **options)
        self._servers[key] = server
        return server

    def close(self) -> None:
        """Stop every server; then raise the first failed clean-up check, if any."""
        errors: list[AssertionError] = []
        while self._servers:
            _, server = self._servers.popitem(last=False)
            try:
                server.stop_and_check_clean()
            except AssertionError as err:
                errors.append(err)
        if errors:
            raise errors[0]
