"""A log line for events a remote peer can trigger at will: logged once, then at most once per interval.

A peer that sends a million bad frames must not write a million log lines; the count of what was
held back goes out with the next line, so nothing is hidden.
"""
from __future__ import annotations

import logging
import threading
import time


class ThrottledLog:
    def __init__(self, logger: logging.Logger, interval_s: float = 10.0, level: int = logging.WARNING) -> None:
        self.logger = logger
        self.interval_s = interval_s
        self.level = level
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}

    def log(self, key: str, msg: str, *args: object) -> bool:
        """Log `msg % args` unless a line with this key went out less than interval_s ago; True if logged."""
        now = time.monotonic()
        with self._lock:
            last = self._last.get(key)
            if last is not None and now - last < self.interval_s:
                self._held[key] = self._held.get(key, 0) + 1
                return False
            self._last[key] = now
            held = self._held.pop(key, 0)
        suffix = f" ({held} more like this in the last {self.interval_s:.0f} s were not logged)" if held else ""
        self.logger.log(self.level, msg + suffix, *args)
        return True
