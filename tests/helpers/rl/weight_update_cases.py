"""What the weight-update tests (tests/executor/worker/rl/test_weight_updates.py, test_quantized_weight_updates.py) compare
engines by: two tiny checkpoints of one shape with different weights, prompts, and greedy answers."""
from __future__ import annotations

import os

from pagedserve.common.params.sampling_params import SamplingParams
from pagedserve.frontend.offline.llm import LLM
from pagedserve.tests.helpers.models.tiny_models import make_tiny_model, random_prompts

NEW_TOKENS = 6
# Longer than a KV block (16): a stale prefix cache would serve blocks cached under the old weights after an
# update.
PROMPTS = random_prompts(7, [21, 37], vocab=512)


def checkpoint_pair(root: str) -> tuple[str, str]:
    """Checkpoints a (seed 0) and b (seed 1) under root: the same tiny model with different weights."""
    return make_tiny_model(os.path.join(root, "a"), seed=0), make_tiny_model(os.path.join(root, "b"), seed=1)


def greedy(llm: LLM, prompts: list[list[int]] = PROMPTS) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=NEW_TOKENS,
                        temperature=0.0, ignore_eos=True), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]
