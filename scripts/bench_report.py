"""The one way benchmark scripts hand out their result: printed, and appended to a markdown file if asked."""
from __future__ import annotations


def emit(table: str, out: str | None) -> None:
    print(table)
    if out:
        with open(out, "a") as f:
            f.write(table + "\n")
