"""README.md and docs/*.md stay true: every fenced block is run or checked as its mark says
(tests/helpers/doc_blocks.py), every relative link resolves, and the flag, environment-variable and metric
names the docs give exist. Blocks that need a server are run by tests/e2e/docs_and_tools/test_client_examples.py."""
from __future__ import annotations

import functools
import itertools
import os
import re
import shlex
import subprocess
import sys

import pytest

from pagedserve.common import envs
from pagedserve.frontend.cli import make_parser, parse_args
from pagedserve.tests.helpers.doc_blocks import REPO, Block, all_blocks, blocks_to_run, doc_files, problem, read

VENV_BIN = os.path.dirname(sys.executable)
# Links to files another change of issue 24 adds; drop an entry once its file is in the tree.


def test_every_block_is_marked():
    bad = [f"{b.id}: {why}" for b in all_blocks() if (why := problem(b)) is not None]
    assert bad == []


def test_the_marks_are_used():
    # The parser must find at least one block of each kind this file runs (a broken parser would find none).
    for kind in ("python", "bash", "flags"):
        assert blocks_to_run(kind), kind


# ---------------------------------------------------------------- links


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"\s", "-", re.sub(r"[^\w\s-]", "", text))


def _anchors(path: str) -> set[str]:
    text = re.sub(r"```.*?```", "", read(path), flags=re.S)
    return {_slug(m) for m in re.findall(r"^#{1,6}\s+(.*)$", text, flags=re.M)}


def _links(path: str) -> list[str]:
    text = re.sub(r"```.*?```", "", read(path), flags=re.S)
    return [t for t in re.findall(r"\]\(([^)\s]+)\)", text) if not re.match(r"[a-z]+://|mailto:", t)]


@pytest.mark.parametrize("path", doc_files())
def test_links_resolve(path):
    bad = []
    for target in _links(path):
        file, _, anchor = target.partition("#")
        resolved = os.path.normpath(os.path.join(os.path.dirname(path), file)) if file else path
        if not os.path.exists(os.path.join(REPO, resolved)):
            bad.append(f"{target}: no file {resolved}")
        elif anchor and resolved.endswith(".md") and anchor not in _anchors(resolved):
            bad.append(f"{target}: no heading #{anchor} in {resolved}")
    assert bad == []


# ---------------------------------------------------------------- names the docs give


def _parser_flags() -> dict[str, str]:
    """Every option string of engine-serve -> the first long spelling of its flag."""
    flags = {}
    for action in make_parser()._actions:
        longs = [o for o in action.option_strings if o.startswith("--")]
        for option in action.option_strings:
            flags[option] = longs[0] if longs else option
    return flags


def test_configuration_lists_exactly_the_parser_flags():
    text = read("docs/configuration.md")
    named = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*|-tp|-q)(?![\w-])", text))
    flags = _parser_flags()
    unknown = sorted(f for f in named if f not in flags)
    missing = sorted({first for option, first in flags.items() if option != "--help"} - named)
    assert (unknown, missing) == ([], [])


def test_operations_lists_every_environment_variable():
    text = read("docs/operations.md")
    assert [v for v in envs.environment_variables if f"`{v}`" not in text] == []
    named = {v for path in doc_files() for v in re.findall(r"PAGEDSERVE_[A-Z_]+", read(path))}
    assert sorted(named - set(envs.environment_variables)) == []


# A path the docs name in code spans, from one of the repository's own folders (a bare file name is relative to
# the folder the sentence is about, and is not checked).
_FOLDERS = r"(?:common|core|executor|frontend|ipc|kernels|tests|scripts|docs|benchmarks)"
_REPO_PATH = re.compile(rf"`({_FOLDERS}/[\w./-]*\w)(?::[\w.]+)?`")
# Inside code (spans and fenced blocks), a word that names a path: REV:PATH is that path as of a commit (a script
# since deleted, quoted where its figures are: `d12b9c3:scripts/bench_lora.py`), checked in git; a plain .py or .sh
# (a command's program) must be in the tree. Other plain words may name files a command writes.
_CODE_PATH = re.compile(rf"(?<![^\s(=`])(?:([0-9a-f]{{7,40}}):)?({_FOLDERS}/[\w./-]*\w)")
_FENCED = re.compile(r"^(```+|~~~+).*?^\1[ \t]*$", re.S | re.M)
_CODE_SPAN = re.compile(r"`((?:[^`\n]|\n(?![ \t]*\n))+)`")        # a span may wrap, but not across a blank line


def _in_git(revision: str, path: str) -> bool:
    return subprocess.run(["git", "cat-file", "-e", f"{revision}:{path}"], cwd=REPO, capture_output=True,
                          timeout=60).returncode == 0


def missing_paths(text: str) -> list[str]:
    """The repository paths `text` names that are neither in the tree nor, written REV:PATH, in REV."""
    missing = {p for p in _REPO_PATH.findall(text) if not os.path.exists(os.path.join(REPO, p))}
    code = [m.group(0) for m in _FENCED.finditer(text)] + _CODE_SPAN.findall(_FENCED.sub("", text))
    for chunk in code:
        for revision, path in _CODE_PATH.findall(chunk):
            if revision and not _in_git(revision, path):
                missing.add(f"{revision}:{path}")
            elif not revision and path.endswith((".py", ".sh")) and not os.path.exists(os.path.join(REPO, path)):
                missing.add(path)
    return sorted(missing)


@pytest.mark.parametrize("path", [*doc_files(), "benchmarks/README.md"])
def test_every_repository_path_named_exists(path):
    """File and folder names in prose drift when code moves; links are checked above, these here."""
    assert missing_paths(read(path)) == []


def test_a_deleted_file_is_named_with_its_revision():
    # ced632f's scripts/bench_cpu_compile.py is in git history only (a retired experiment).
    assert missing_paths("`git show ced632f:scripts/bench_cpu_compile.py`") == []
    assert missing_paths("measured with `ced632f:scripts/bench_cpu_compile.py --x 1`") == []
    assert missing_paths("`scripts/bench_cpu_compile.py`") == ["scripts/bench_cpu_compile.py"]
    assert missing_paths("`python scripts/bench_cpu_compile.py --x 1`") == ["scripts/bench_cpu_compile.py"]
    assert missing_paths("```bash\npython scripts/bench_cpu_compile.py\n```\n") == ["scripts/bench_cpu_compile.py"]
    assert missing_paths("(`python\nscripts/bench_cpu_compile.py`)") == ["scripts/bench_cpu_compile.py"]   # wrapped
    assert missing_paths("`ced632f:scripts/no_such_file.py`") == ["ced632f:scripts/no_such_file.py"]
    assert missing_paths("`scripts/soak.py --out benchmarks/new.md`, `tests/e2e`") == []   # what a run writes


def test_every_metric_named_is_exported():
    source = read("frontend/http/metrics.py")
    exported = set(re.findall(r'"((?:vllm|pagedserve):[a-z_]+)"', source))
    named = {m for path in doc_files() for m in re.findall(r"(?:vllm|pagedserve):[a-z_]+[a-z]", read(path))}
    # Prometheus adds _total to counters; _bucket, _sum and _count to histograms.
    unknown = sorted(m for m in named if re.sub(r"_(total|bucket|sum|count)$", "", m) not in exported
                     and m not in exported)
    assert unknown == []


# ---------------------------------------------------------------- flags blocks


def commands(code: str) -> list[list[str]]:
    """The commands of a bash block: continuations joined, comments dropped, split at ; && || |."""
    found = []
    for line in code.replace("\\\n", " ").splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
        lexer.whitespace_split = True
        lexer.commenters = "#"
        current: list[str] = []
        for token in lexer:
            if token in (";", "&&", "||", "|", "&"):
                found.append(current)
                current = []
            else:
                current.append(token)
        found.append(current)
    return [c for c in found if c]


@functools.lru_cache(maxsize=None)
def _help(*program: str) -> str:
    run = subprocess.run([*program, "--help"], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert run.returncode == 0, f"{' '.join(program)} --help failed: {run.stderr[-2000:]}"
    return run.stdout


def _check_in_help(program: tuple[str, ...], args: list[str]) -> list[str]:
    text = _help(*program)
    flags = [a.split("=", 1)[0] for a in args if re.match(r"-{1,2}[A-Za-z]", a)]
    return [f"{' '.join(program)}: {f} is not in its --help" for f in flags
            if not re.search(rf"(?<![\w-]){re.escape(f)}(?![\w-])", text)]


def _python(program: str) -> bool:
    return os.path.basename(program) in ("python", "python3")


def check_command(argv: list[str]) -> list[str]:
    """What is wrong with one documented command's flags (nothing is started)."""
    program = os.path.basename(argv[0])
    if program == "pagedserve" and argv[1:2] == ["serve"]:
        return check_command(["engine-serve", *argv[2:]])     # the same parser (frontend/pagedserve_cli.py)
    if program == "pagedserve":
        words = list(itertools.takewhile(lambda a: not a.startswith("-"), argv[1:]))
        return _check_in_help((sys.executable, "-m", "pagedserve.frontend.pagedserve_cli", *words),
                              argv[1 + len(words):])
    if program == "engine-serve" or (_python(argv[0]) and argv[1:3] == ["-m", "pagedserve.frontend.cli"]):
        rest = argv[1:] if program == "engine-serve" else argv[3:]
        try:
            engine, _ = parse_args(rest)       # ServerArgs validates itself
            engine.validate()
        except SystemExit:
            return [f"engine-serve refused {shlex.join(rest)} (see the usage message above)"]
        except ValueError as exc:
            return [f"engine-serve {shlex.join(rest)}: {exc}"]
        return []
    if _python(argv[0]) and argv[1] == "-m":
        return _check_in_help((sys.executable, "-m", argv[2]), argv[3:])
    if _python(argv[0]) and argv[1].endswith(".py"):
        return _check_in_help((sys.executable, argv[1]), argv[2:])
    if program == "torchrun":
        script = next(i for i, a in enumerate(argv) if a.endswith(".py"))
        return (_check_in_help((sys.executable, "-m", "torch.distributed.run"), argv[1:script])
                + _check_in_help((sys.executable, argv[script]), argv[script + 1:]))
    if program == "bash" and argv[1].endswith(".sh"):
        return [] if os.path.isfile(os.path.join(REPO, argv[1])) else [f"no script {argv[1]}"]
    return [f"no flag checker for {argv[0]!r}: mark the block another way"]


@pytest.mark.parametrize("block", blocks_to_run("flags"), ids=lambda b: b.id)
def test_documented_command_flags(block: Block, monkeypatch):
    for name in ("PAGEDSERVE_API_KEY", "PAGEDSERVE_ENGINE_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    assert block.language == "bash"
    problems = [p for argv in commands(block.code) for p in check_command(argv)]
    assert problems == []


# ---------------------------------------------------------------- blocks run as written


def _env() -> dict[str, str]:
    # The test's own interpreter stands for .venv/bin (the same folder in CI), first on PATH.
    return dict(os.environ, PATH=VENV_BIN + os.pathsep + os.environ.get("PATH", ""))


@pytest.mark.parametrize("block", blocks_to_run("bash"), ids=lambda b: b.id)
def test_documented_bash_runs(block: Block):
    code = block.code.replace(".venv/bin/", VENV_BIN + "/")
    run = subprocess.run(["bash", "-euo", "pipefail", "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=REPO, env=_env())
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip(), run.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("block", blocks_to_run("python"), ids=lambda b: b.id)
def test_documented_python_runs(block: Block, tmp_path):
    assert block.language == "python"
    run = subprocess.run([sys.executable, "-c", block.code], capture_output=True, text=True, timeout=300,
                         cwd=tmp_path, env=_env())
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip(), run.stderr[-3000:]
