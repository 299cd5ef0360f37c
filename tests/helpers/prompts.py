"""A fixed English text whose mean per-token logprob the quantized-model tests compare across runs."""
from __future__ import annotations

LIGHTHOUSE_TEXT = (
    "The old lighthouse stood at the edge of the cliff, its white paint peeling after decades of storms. "
    "Every evening the keeper climbed the narrow stairs to light the lamp, and every morning he wrote a "
    "few lines in a worn leather book: the weather, the ships he had seen, and sometimes a thought about "
    "the sea. When he retired, the town kept the book in its small library, where children still read it "
    "on rainy afternoons and wonder what the keeper would have written about their own time.")
