"""Small helpers every child process of the engine uses: a name, death with the parent, error text."""
from __future__ import annotations

import ctypes
import logging
import os
import signal
import threading
import traceback

logger = logging.getLogger(__name__)
_PR_SET_NAME = 15
_PR_SET_PDEATHSIG = 1


def setup_child_process(name: str, parent_pid: int, death_signal: int = signal.SIGTERM) -> None:
    """Name the process (visible in ps/top) and make it exit when its parent dies."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_NAME, name.encode()[:15])
        libc.prctl(_PR_SET_PDEATHSIG, death_signal)
    except OSError:   # not Linux: the watchdog below still works
        pass

    def watch() -> None:
        while True:
            threading.Event().wait(1.0)
            if os.getppid() != parent_pid:
                logger.error("parent process %d is gone; %s exits", parent_pid, name)
                os._exit(1)
    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()


def describe_exception(exc: BaseException) -> str:
    """One line for a remote caller: type, message and where it was raised."""
    tb = traceback.extract_tb(exc.__traceback__)
    where = f" (at {os.path.basename(tb[-1].filename)}:{tb[-1].lineno})" if tb else ""
    return f"{type(exc).__name__}: {exc}{where}"
