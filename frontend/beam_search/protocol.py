"""vLLM's beam search fields of completions and chat requests, and the one rule of what combines with them.

use_beam_search runs frontend/beam_search/search.py: n is the beam width (and the choices returned, best first),
max_tokens, ignore_eos, length_penalty, early_stopping (HF's True/False/"never") and include_stop_str_in_output
shape the search, temperature is accepted as vLLM accepts it (beams rank by raw logprobs). A field that would
change how tokens are picked or what a choice carries, and that the search cannot honour, is a 400 naming it
(vLLM ignores most of them silently; a client setting one expects it to act).
"""
from __future__ import annotations

from typing import Literal, Optional, Union

from pagedserve.common.params.beam_search_params import BeamSearchParams
from pagedserve.common.errors import RequestError
from pagedserve.frontend.http.protocol_extras import StrictModel

# Refused with use_beam_search unless left at their defaults.
_REFUSED = ("stream", "logprobs", "top_logprobs", "echo", "prompt_logprobs", "best_of", "suffix", "top_p", "top_k",
            "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens", "stop",
            "stop_token_ids", "logit_bias", "allowed_token_ids", "bad_words", "truncate_prompt_tokens")
_WHY = {"stream": "beams are only known once the search ends; send stream=false"}


class BeamSearchFields(StrictModel):
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: Union[bool, Literal["never"]] = False

    def to_beam_search_params(self, max_tokens: Optional[int], max_model_len: int) -> BeamSearchParams:
        """The search this request asks for; RequestError naming a field it cannot combine with.
        max_tokens None: as many as the prompt leaves (the search caps it at max_model_len)."""
        fields = type(self).model_fields
        for name in _REFUSED:
            if name in fields and getattr(self, name) != fields[name].default:
                raise RequestError.at(name, _WHY.get(name, "not supported with use_beam_search"))
        source = self.structured_outputs_source()       # type: ignore[attr-defined]
        if source is not None:
            raise RequestError.at(source, "structured outputs are not supported with use_beam_search")
        params = BeamSearchParams(
            beam_width=self.n, max_tokens=max_model_len if max_tokens is None else max_tokens,   # type: ignore
            ignore_eos=self.ignore_eos, temperature=0.0 if self.temperature is None else self.temperature,  # type: ignore
            length_penalty=self.length_penalty, early_stopping=self.early_stopping,
            include_stop_str_in_output=self.include_stop_str_in_output)   # type: ignore[attr-defined]
        return params


def check_beam_params(params: BeamSearchParams, num_eos: int) -> None:
    """params.validate, its error naming the request's field: n for beam_width."""
    try:
        params.validate(num_eos)
    except RequestError as exc:
        if exc.field != "beam_width":
            raise
        raise RequestError("n", exc.message.replace("beam_width", "n (the beam width)", 1)) from None
