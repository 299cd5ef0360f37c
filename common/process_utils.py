"""Small helpers every child process of the engine uses: a name, death with the parent, error text."""
from __future__ import annotations

import atexit
import ctypes
import logging
import os
import signal
import site
import subprocess
import sys
import threading
import traceback
import weakref
from collections.abc import Callable

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


def _child_env() -> dict[str, str]:
    """This process's environment, plus the folder pagedserve was imported from when it is a source
    checkout found through sys.path (a script's folder, cwd): the child must import the same code."""
    env = dict(os.environ)
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))      # the package folder
    parent = os.path.dirname(here)
    installed = {os.path.abspath(p) for p in [*site.getsitepackages(), site.getusersitepackages()]}
    # A folder not named pagedserve was found by an import hook (an editable install) the child has too.
    if os.path.basename(here) == "pagedserve" and parent not in installed:
        paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        if parent not in [os.path.abspath(p) for p in paths]:
            env["PYTHONPATH"] = os.pathsep.join([parent, *paths])
    return env


class ModuleProcess:
    """A child started as `python -m module`: it never imports the caller's __main__ (multiprocessing's
    spawn does, which breaks scripts without a main guard), and it gets its inputs as one payload on
    stdin (secrets stay out of argv, which other users can read in ps).

    Shaped like multiprocessing.Process where the engine used it: pid, is_alive, exitcode (negative:
    killed by that signal), terminate/kill/join, and a `sentinel` fd that becomes readable when the
    child exits (a pidfd), usable with zmq.Poller and multiprocessing.connection.wait.
    """

    def __init__(self, module: str, payload: bytes, name: str, args: tuple[str, ...] = ()) -> None:
        self.name = name
        self._popen = subprocess.Popen([sys.executable, "-m", module, *args], stdin=subprocess.PIPE,
                                       env=_child_env(), close_fds=True)
        self.pid = self._popen.pid
        try:
            self.sentinel = os.pidfd_open(self.pid)
        except OSError:              # a kernel before 5.3: no child may outlive its handle
            self._popen.kill()
            self._popen.wait()
            raise
        try:
            assert self._popen.stdin is not None
            self._popen.stdin.write(payload)
            self._popen.stdin.close()
        except BrokenPipeError:     # it died before reading: is_alive/exitcode tell the caller
            pass

    @property
    def exitcode(self) -> int | None:
        return self._popen.poll()

    def is_alive(self) -> bool:
        return self._popen.poll() is None

    def join(self, timeout: float | None = None) -> None:
        try:
            self._popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def terminate(self) -> None:
        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        self._signal(signal.SIGKILL)

    def _signal(self, sig: int) -> None:
        if self._popen.poll() is None:
            try:
                self._popen.send_signal(sig)
            except ProcessLookupError:
                pass

    def close(self) -> None:
        """Release the sentinel fd (after the child is reaped)."""
        if self.sentinel >= 0:
            os.close(self.sentinel)
            self.sentinel = -1


def read_launch_payload() -> bytes:
    """Child side of ModuleProcess: the whole payload its parent wrote to stdin."""
    return sys.stdin.buffer.read()


def stop_at_exit(owner: object, stop: Callable[[object], None]) -> Callable[[], None]:
    """Run stop(owner) at interpreter exit if owner is still alive then, so a script that never shuts
    its engine down still ends promptly and leaves no process behind. Holds owner weakly (it can be
    collected before exit). Returns a function that cancels the hook (call it from the owner's shutdown)."""
    ref = weakref.ref(owner)

    def hook() -> None:
        target = ref()
        if target is not None:
            stop(target)
    atexit.register(hook)
    return lambda: atexit.unregister(hook)


def exit_without_teardown(code: int) -> None:
    """End a child process that has said everything and closed its sockets, skipping the interpreter's
    teardown: finalizing torch (OpenMP pools, process groups) took seconds per process on a busy host,
    and every script ending with an engine waited for it."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
