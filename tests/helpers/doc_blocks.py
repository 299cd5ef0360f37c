"""The fenced code blocks of README.md and docs/*.md, with the mark that says how a test checks each.

A mark is an HTML comment on the last non-blank line before a block's opening fence:

- `<!-- client-example: NAME -->`  README's client examples (tests/e2e/docs_and_tools/test_client_examples.py, request counts);
- `<!-- run: python -->`           Python run as written in a fresh interpreter (the embedded model);
- `<!-- run: python-client -->`    Python run against a real engine-serve; only its address, engine address
                                   and engine token are rewritten (client_rewrites);
- `<!-- run: bash -->`             bash run as written in the repository root;
- `<!-- run: bash-client -->`      bash (curl) against a real engine-serve, its address rewritten;
- `<!-- run: flags -->`            each command's flags checked by that program's own parser (tests/e2e/docs_and_tools/test_docs.py);
- `<!-- not-run: REASON -->`       not runnable here, and why (a GPU, two machines, the whole suite, ...).

Blocks in `text` (diagrams, sample output) need no mark; every other block needs one, and a language.
README's first block, the two set-up commands, is the exception: its first lines stay exactly as CI and users run
them, so it carries no comment, and its commands get the `flags` check (CI runs both lines: .ci/run).
"""
from __future__ import annotations

import glob
import os
import re
from dataclasses import dataclass

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RUN_KINDS = ("python", "python-client", "bash", "bash-client", "flags")
UNMARKED_LANGUAGES = ("text",)
# What the documented examples name, and what a test rewrites it to (client_rewrites).
DOC_URL = "http://127.0.0.1:8000"
DOC_ENGINE_ADDRESS = "tcp://127.0.0.1:5555"
DOC_ENGINE_TOKEN = "SECRET"

_FENCE = re.compile(r"^(```+|~~~+)\s*([\w+-]*)\s*$")
_MARK = re.compile(r"^<!--\s*(client-example|run|not-run):\s*(.*?)\s*-->$")


@dataclass(frozen=True)
class Block:
    path: str           # relative to the repository root
    line: int           # 1-based line of the opening fence
    language: str       # "" when the fence names none
    code: str
    mark: str | None    # "client-example", "run", "not-run" or None
    argument: str       # the client-example name, the run kind, or the not-run reason

    @property
    def id(self) -> str:
        return f"{self.path}:{self.line}"


def doc_files() -> list[str]:
    """README.md and every page under docs/, relative to the repository root."""
    pages = sorted(os.path.relpath(p, REPO) for p in glob.glob(os.path.join(REPO, "docs", "*.md")))
    return ["README.md", *pages]


def read(path: str) -> str:
    with open(os.path.join(REPO, path), encoding="utf-8") as f:
        return f.read()


def fenced_blocks(path: str) -> list[Block]:
    lines = read(path).splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if opening is None:
            i += 1
            continue
        fence, language = opening.group(1), opening.group(2)
        end = i + 1
        while end < len(lines) and lines[end].strip() != fence:
            end += 1
        mark, argument = _mark_before(lines, i)
        if path == "README.md" and not blocks and mark is None:
            mark, argument = "run", "flags"
        blocks.append(Block(path, i + 1, language, "\n".join(lines[i + 1:end]) + "\n", mark, argument))
        i = end + 1
    return blocks


def _mark_before(lines: list[str], fence_index: int) -> tuple[str | None, str]:
    j = fence_index - 1
    while j >= 0 and not lines[j].strip():
        j -= 1
    found = _MARK.match(lines[j].strip()) if j >= 0 else None
    return (found.group(1), found.group(2)) if found else (None, "")


def all_blocks() -> list[Block]:
    return [b for path in doc_files() for b in fenced_blocks(path)]


def blocks_to_run(kind: str) -> list[Block]:
    return [b for b in all_blocks() if b.mark == "run" and b.argument == kind]


def problem(block: Block) -> str | None:
    """Why a block's mark is missing or wrong, or None."""
    if not block.language:
        return "the fence names no language (`text` for diagrams and sample output)"
    if block.language in UNMARKED_LANGUAGES:
        return None
    if block.mark is None:
        return ("no mark: put `<!-- run: KIND -->` (KIND one of " + ", ".join(RUN_KINDS) +
                ") or `<!-- not-run: REASON -->` on the line before the fence")
    if block.mark == "run" and block.argument not in RUN_KINDS:
        return f"unknown run kind {block.argument!r} (one of {', '.join(RUN_KINDS)})"
    if block.mark == "not-run" and len(block.argument.split()) < 2:
        return "a not-run mark needs its reason, in words"
    if block.mark == "client-example" and block.path != "README.md":
        return "client-example marks belong to README.md (elsewhere: run: python-client)"
    return None


def client_rewrites(code: str, url: str, engine_address: str, engine_token: str) -> str:
    """A documented client example pointed at a test server: only the addresses and the token change."""
    return (code.replace(DOC_URL, url).replace(DOC_ENGINE_ADDRESS, engine_address)
            .replace(f'"{DOC_ENGINE_TOKEN}"', f'"{engine_token}"'))
