"""`pagedserve chat` and `pagedserve complete`: interactive clients of a running OpenAI-compatible server,
as `vllm chat` / `vllm complete` (the openai client library, streamed output, -q for one question)."""
from __future__ import annotations

import argparse
import sys
from typing import Any

from pagedserve.common import envs
from pagedserve.frontend.bench import require


def add_query_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default="http://localhost:8000/v1", help="the server's API root (.../v1)")
    parser.add_argument("--model-name", default=None, help="default: the first model the server lists")
    parser.add_argument("--api-key", default=None, help="default: env OPENAI_API_KEY")


def add_chat_args(parser: argparse.ArgumentParser) -> None:
    add_query_args(parser)
    parser.add_argument("--system-prompt", default=None, help="a system message opening the conversation")
    parser.add_argument("-q", "--quick", metavar="MESSAGE", default=None,
                        help="send this one message, print the answer, exit")


def add_complete_args(parser: argparse.ArgumentParser) -> None:
    add_query_args(parser)
    parser.add_argument("-q", "--quick", metavar="PROMPT", default=None,
                        help="complete this one prompt, print the completion, exit")


def _connect(args: argparse.Namespace) -> tuple[str, Any]:
    openai = require("openai", "pagedserve chat/complete")
    client = openai.OpenAI(base_url=args.url, api_key=args.api_key or envs.OPENAI_API_KEY or "EMPTY")
    try:
        model = args.model_name or client.models.list().data[0].id
    except (openai.OpenAIError, IndexError) as exc:
        raise SystemExit(f"pagedserve: cannot list the models of {args.url}: {exc}") from None
    print(f"Using model: {model}", file=sys.stderr)
    return model, client


def _read(prompt_text: str) -> str | None:
    try:
        return input(prompt_text)
    except EOFError:
        return None


def _print_stream(stream: Any, chat: bool) -> str:
    pieces = []
    for chunk in stream:
        if not chunk.choices:
            continue
        text = chunk.choices[0].delta.content if chat else chunk.choices[0].text
        if text:
            pieces.append(text)
            print(text, end="", flush=True)
    print()
    return "".join(pieces)


def chat(args: argparse.Namespace) -> None:
    import openai
    model, client = _connect(args)
    conversation: list[dict[str, str]] = []
    if args.system_prompt is not None:
        conversation.append({"role": "system", "content": args.system_prompt})
    if args.quick is None:
        print("Please enter a message for the chat model:", file=sys.stderr)
    message = args.quick if args.quick is not None else _read("> ")
    while message is not None:
        conversation.append({"role": "user", "content": message})
        try:
            stream = client.chat.completions.create(model=model, messages=conversation, stream=True)
            conversation.append({"role": "assistant", "content": _print_stream(stream, chat=True)})
        except openai.OpenAIError as exc:
            raise SystemExit(f"pagedserve chat: {exc}") from None
        message = None if args.quick is not None else _read("> ")


def complete(args: argparse.Namespace) -> None:
    import openai
    model, client = _connect(args)
    if args.quick is None:
        print("Please enter prompt to complete:", file=sys.stderr)
    prompt = args.quick if args.quick is not None else _read("> ")
    while prompt is not None:
        try:
            _print_stream(client.completions.create(model=model, prompt=prompt, stream=True), chat=False)
        except openai.OpenAIError as exc:
            raise SystemExit(f"pagedserve complete: {exc}") from None
        prompt = None if args.quick is not None else _read("> ")
