"""Incremental detokenization with stop strings, one request at a time."""
from __future__ import annotations

from typing import Any, Callable

# Context tokens decoded before the new ones, so that spacing and merges come out as in a full decode.
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Never emits a partial UTF-8 character (a "\\ufffd" at the end waits for the next token), and
    holds back the tail that could still be the start of a stop string.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], stop: list[str],
                 include_stop_str_in_output: bool, skip_special_tokens: bool) -> None:
        self.tokenizer = tokenizer
        self._decode_ids = fast_decoder(tokenizer)
        self.ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.stop = stop
        self.include_stop = include_stop_str_in_output
        self.skip_special = skip_special_tokens
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""            # all decoded output text (after truncation at a stop string)
        self.emitted = 0          # len of text already handed out as deltas
        self.stop_hit: str | None = None

    def _decode(self, ids: list[int]) -> str:
        return self._decode_ids(ids, self.skip_special)

    def add_tokens(self, token_ids: list[int]) -> int:
        """Returns how many of the ids it took: all, or up to the one that completed a stop string (a step
        that accepted speculative drafts brings several, and the ones after a stop are never output)."""
        for taken, token_id in enumerate(token_ids):
            if self.stop_hit is not None:
                return taken
            self.ids.append(token_id)
            prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
            full = self._decode(self.ids[self.prefix_offset:])
            if len(full) <= len(prefix) or full.endswith("\ufffd"):
                continue          # no complete character yet
            new = full[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            self._append_text(new)
        return len(token_ids)

    def _append_text(self, new: str) -> None:
        search_from = max(0, len(self.text) - self.hold)
        self.text += new
        for stop in self.stop:
            idx = self.text.find(stop, search_from)
            if idx >= 0:
                self.stop_hit = stop
                self.text = self.text[: idx + len(stop) if self.include_stop else idx]
                return

    def delta(self, finished: bool) -> str:
        """Text not yet handed out; keeps back a possible stop-string prefix unless finished."""
        end = len(self.text) if finished or self.stop_hit else max(self.emitted, len(self.text) - self.hold)
        out = self.text[self.emitted:end]
        self.emitted = end
        return out

    def decode_token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)


def fast_decoder(tokenizer: Any) -> Callable[[list[int], bool], str]:
    """(ids, skip_special_tokens) -> text, straight from the Rust tokenizer when that gives the same text
    as `tokenizer.decode`: transformers' wrapper costs ~5x the decode itself, twice per token per request.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    # transformers only post-processes a fast tokenizer's text by this clean-up, and ignores it for BPE.
    cleans_up = bool(getattr(tokenizer, "clean_up_tokenization_spaces", False)) and not (
        backend is not None and type(backend.model).__name__ == "BPE" and not getattr(
            tokenizer, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False))
    if backend is None or cleans_up:
        return lambda ids, skip: tokenizer.decode(ids, skip_special_tokens=skip)
    return lambda ids, skip: backend.decode(ids, skip_special_tokens=skip)
