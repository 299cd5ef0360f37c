"""`python -m pagedserve.core.engine_core_main`: the engine core process's entry, fed a CoreLaunch on stdin.

A plain module run, not multiprocessing's spawn: the process never imports its launcher's __main__,
so `LLM(...)` works from a script without a main guard. No pickle crosses: the launch is JSON, and the
executor class travels as "module:qualname", imported here (the launcher still picks it; the core
never names one itself).
"""
from __future__ import annotations

import importlib
import logging
from typing import Any

import msgspec

from pagedserve.common.process_utils import exit_without_teardown, read_launch_payload
from pagedserve.core.engine_core_proc import CoreAddresses, run_engine_core

MODULE = "pagedserve.core.engine_core_main"


class CoreLaunch(msgspec.Struct, frozen=True):
    engine_args: dict[str, Any]      # EngineArgs fields
    executor: str                    # "module:qualname" of the executor class the launcher chose
    input: str
    output: str
    handshake: str
    token: str
    parent_pid: int
    log_level: int = logging.INFO
    ipc_root: str | None = None


def class_reference(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def resolve_class(reference: str) -> Any:
    module, _, qualname = reference.partition(":")
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def main() -> None:
    launch = msgspec.json.decode(read_launch_payload(), type=CoreLaunch)
    addresses = CoreAddresses(input=launch.input, output=launch.output, handshake=launch.handshake)
    try:
        run_engine_core(msgspec.json.encode(launch.engine_args), resolve_class(launch.executor), addresses,
                        launch.token, launch.parent_pid, launch.log_level, launch.ipc_root)
    except SystemExit as done:     # it returns only this way, its workers stopped and its sockets closed
        exit_without_teardown(done.code if isinstance(done.code, int) else 1)


if __name__ == "__main__":
    main()
