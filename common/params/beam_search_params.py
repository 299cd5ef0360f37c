"""BeamSearchParams: how wide and how long a beam search runs, and how it ranks finished beams (vLLM's fields,
plus HF transformers' early_stopping). The search itself is frontend/beam_search/search.py."""
from __future__ import annotations

from typing import Literal, Union

import msgspec

from pagedserve.common.params.sampling_params import check_field, is_int, is_number

# Each step asks the engine for the top (beam_width + number of EOS ids) logprobs of every live beam, and the
# engine returns at most this many per position (SamplingParams.logprobs' bound).
MAX_STEP_LOGPROBS = 20

EarlyStopping = Union[bool, Literal["never"]]


class BeamSearchParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    """beam_width: beams kept (and sequences returned); max_tokens: most tokens generated per beam.
    length_penalty: a finished beam scores cum_logprob / generated_tokens ** length_penalty (HF's rule);
    early_stopping: HF's: True stops once beam_width beams finished, False stops when no running beam can
    still beat the worst finished one (judged at its current length), "never" judges at max_tokens.
    temperature: accepted as vLLM does; beams are ranked by the model's raw logprobs, which it does not change.
    include_stop_str_in_output: HTTP texts keep the EOS token's text of a beam that ended with it."""
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    early_stopping: EarlyStopping = False

    def validate(self, num_eos: int = 1) -> None:
        """RequestError naming the first field at fault. num_eos: the model's EOS ids (each step needs
        beam_width + num_eos logprobs of every beam)."""
        check_field(is_int(self.beam_width) and self.beam_width >= 1, "beam_width",
               f"must be an integer >= 1, got {self.beam_width!r}")
        widest = MAX_STEP_LOGPROBS - (0 if self.ignore_eos else num_eos)
        check_field(self.beam_width <= widest, "beam_width",
               f"must be at most {widest} (each step reads beam_width + EOS ids <= {MAX_STEP_LOGPROBS} logprobs "
               f"of every beam), got {self.beam_width}")
        check_field(is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens",
               f"must be an integer >= 1, got {self.max_tokens!r}")
        check_field(is_number(self.temperature) and self.temperature >= 0, "temperature",
               f"must be >= 0, got {self.temperature!r}")
        check_field(is_number(self.length_penalty), "length_penalty", f"must be a number, got {self.length_penalty!r}")
        check_field(isinstance(self.early_stopping, bool) or self.early_stopping == "never", "early_stopping",
               f"must be true, false or \"never\", got {self.early_stopping!r}")

    def step_logprobs(self, num_eos: int) -> int:
        """Logprobs each one-token step needs per beam: the best beam_width continuations that do not end the
        beam are always among its best beam_width + num_eos tokens (at most num_eos of them are EOS)."""
        return self.beam_width + (0 if self.ignore_eos else num_eos)

