"""engine-serve processes shared across test modules, one per configuration (tests/conftest.py's
`server_pool`): a module asks for a configuration and gets the running server if one has it, so the suite
boots each shared configuration once instead of once per module.

The modules that share a server run one after another (`group_modules`), and the last of them stops it
(`last_users`): no shared server sits idle through unrelated modules, holding memory or showing up among
the test process's children. At most `max_alive` stay up regardless: asking for another stops the least
recently used one. Stopping checks it clean (no child process, no ipc file left). A server that exited is
an error for whoever asks next, not silently replaced: a test broke it. Tests that kill, stop or wedge
their server, or read counters that other modules' requests would move, boot their own `Server`."""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection
from typing import Any

import pytest

from pagedserve.tests.helpers.processes.server import Server

_Key = tuple[tuple[str, ...], tuple[tuple[str, Any], ...]]


def _key(extra: tuple[str, ...], options: dict[str, Any]) -> _Key:
    return tuple(extra), tuple(sorted(options.items()))


class ServerPool:
    def __init__(self, max_alive: int) -> None:
        if max_alive < 1:
            raise ValueError(f"max_alive must be >= 1, got {max_alive}")
        self.max_alive = max_alive
        self._servers: OrderedDict[_Key, Server] = OrderedDict()    # least recently used first

    def get(self, *extra: str, **options: Any) -> Server:
        """The server started as Server(*extra, **options), booting it if none is running."""
        key = _key(extra, options)
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

    def stop(self, *extra: str, **options: Any) -> None:
        """Stop the server of that configuration, if one runs (checked clean)."""
        server = self._servers.pop(_key(extra, options), None)
        if server is not None:
            server.stop_and_check_clean()

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


def _module_of(item: pytest.Item) -> str:
    module = item.getparent(pytest.Module)
    return module.nodeid if module is not None else item.nodeid


def group_modules(items: list[pytest.Item], shared: Collection[str]) -> None:
    """Reorder `items` in place so that the modules using a fixture in `shared` run right after the first
    module using it; every other module keeps its place and every module its own order."""
    modules: dict[str, list[pytest.Item]] = {}
    for item in items:
        modules.setdefault(_module_of(item), []).append(item)
    first: dict[str, int] = {}
    anchors: list[int] = []
    for index, module_items in enumerate(modules.values()):
        used = {name for item in module_items for name in item.fixturenames if name in shared}
        for name in used:
            first.setdefault(name, index)
        anchors.append(min((first[name] for name in used), default=index))
    order = sorted(range(len(modules)), key=lambda i: (anchors[i], i))
    groups = list(modules.values())
    items[:] = [item for i in order for item in groups[i]]


def last_users(items: list[pytest.Item], shared: Collection[str]) -> dict[str, str]:
    """Fixture name -> node id of the last module (in run order) whose tests use it."""
    last: dict[str, str] = {}
    for item in items:
        for name in item.fixturenames:
            if name in shared:
                last[name] = _module_of(item)
    return last
