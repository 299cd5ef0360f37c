"""The prompt's logprobs in HTTP bodies: completions' echo (OpenAI legacy shape) and vLLM's prompt_logprobs field.

Evaluation harnesses (lm-eval's local-completions) score a text by sending it with echo=true, logprobs=k and
reading `token_logprobs` / `top_logprobs` over the prompt's positions; the first prompt token has nothing before
it, so its entries are null.
"""
from __future__ import annotations

from typing import Any, Optional

from pagedserve.frontend.client.outputs import Logprob

PromptLogprobs = list[Optional[dict[int, Logprob]]]


def top_alternatives(entry: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    """The top-k of one position, best first. Every entry's rank is 1-based over the whole vocabulary, so the
    chosen token (kept in the dict even when it ranks lower) belongs to the top-k exactly when its rank <= k."""
    return sorted(((tid, lp) for tid, lp in entry.items() if (lp.rank or 0) <= k), key=lambda kv: kv[1].rank or 0)


def echo_logprobs(prompt_token_ids: list[int], first_token_text: str, scored: PromptLogprobs,
                  k: int) -> dict[str, list[Any]]:
    """Completions' logprobs columns over the prompt: tokens, token_logprobs, top_logprobs, text_offset."""
    tokens, token_lps, tops, offsets = [first_token_text], [None], [None], [0]
    offset = len(first_token_text)
    for token_id, entry in zip(prompt_token_ids[1:], scored[1:]):
        chosen = entry.get(token_id) if entry else None
        text = chosen.decoded_token if chosen and chosen.decoded_token is not None else ""
        tokens.append(text)
        token_lps.append(chosen.logprob if chosen else None)
        tops.append({(lp.decoded_token or ""): lp.logprob for _, lp in top_alternatives(entry or {}, k)})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def prompt_logprobs_json(scored: PromptLogprobs) -> list[Optional[dict[str, dict[str, Any]]]]:
    """vLLM's `prompt_logprobs` response field: null, then {token_id: {logprob, rank, decoded_token}} per token."""
    return [None if entry is None else
            {str(tid): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
             for tid, lp in entry.items()} for entry in scored]
