"""RL weight updates (issue 30): a trainer in its own process pushes new weights over a gloo group and the
engine then answers as HF does with those weights; reloads from another checkpoint; bad updates change
nothing; collective_rpc and worker extensions."""
from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedserve.frontend.offline.llm import LLM
from pagedserve.tests.helpers.parity import hf_model
from pagedserve.tests.helpers.rl.rl_trainer import trainer_main
from pagedserve.tests.helpers.processes.server import free_port
from pagedserve.tests.helpers.models.tiny_models import hf_greedy
from pagedserve.tests.helpers.rl.weight_update_cases import NEW_TOKENS, PROMPTS, greedy

ROUNDS = 3
EXTENSION = "pagedserve.tests.helpers.rl.rl_extension.Probe"


def rl_rounds(llm: LLM, path: str, tp: int) -> list[list[int]]:
    """ROUNDS of generate -> train -> push -> generate; each round's answers are HF's under the new weights.
    Returns the last round's answers."""
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    port = free_port()
    trainer = ctx.Process(target=trainer_main, args=(path, "127.0.0.1", port, 1 + tp, PROMPTS, NEW_TOKENS,
                                                      inbox, outbox))
    trainer.start()
    try:
        ranks = llm.collective_rpc("init_weight_update_group", args=("127.0.0.1", port, 1, 1 + tp))
        assert ranks == list(range(1, 1 + tp)) and outbox.get(timeout=60) == "joined"
        answers = greedy(llm)
        for _ in range(ROUNDS):
            inbox.put([p + a for p, a in zip(PROMPTS, answers)])
            names, dtypes, shapes, oracle = outbox.get(timeout=120)
            applied = llm.collective_rpc("update_weights_from_distributed", args=(names, dtypes, shapes))
            assert applied == [len(names)] * tp
            new = greedy(llm)
            assert new == oracle
            assert new != answers, "the update changed no answer: the test would not see a stale engine"
            answers = new
        # A name the model does not know: every tensor is still received (the trainer is not left hanging),
        # the error names it, and no weight changed.
        inbox.put("again")
        names, dtypes, shapes, _ = outbox.get(timeout=120)
        names[1] = "model.layers.0.mlp.surprise.weight"
        with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.surprise\.weight"):
            llm.collective_rpc("update_weights_from_distributed", args=(names, dtypes, shapes))
        assert greedy(llm) == answers
        inbox.put(None)
        assert outbox.get(timeout=60) == "done"
    finally:
        trainer.join(30)
        if trainer.is_alive():
            trainer.kill()
    assert trainer.exitcode == 0
    return answers


def test_rl_loop_tp1_equals_hf_each_round(update_checkpoints) -> None:
    with LLM(update_checkpoints[0], dtype="float32") as llm:
        rl_rounds(llm, update_checkpoints[0], tp=1)


def test_rl_loop_tp2_with_worker_extension(update_checkpoints) -> None:
    with LLM(update_checkpoints[0], dtype="float32", tensor_parallel_size=2, worker_extension_cls=EXTENSION,
             enable_sleep_mode=True) as llm:
        ranks = llm.collective_rpc("describe_rank", kwargs={"tag": "t"})
        assert ranks == [{"rank": r, "tp_rank": r, "rows": 64, "tag": "t"} for r in (0, 1)]  # (4 + 2*2) * 16 / 2
        with pytest.raises(ValueError, match="weight_tensor"):
            llm.collective_rpc("weight_tensor")              # a tensor is not sent back
        with pytest.raises(ValueError, match="no_such_method"):
            llm.collective_rpc("no_such_method")
        answers = rl_rounds(llm, update_checkpoints[0], tp=2)      # the ranks still serve after refused calls
        llm.sleep(level=1)                                  # both worker processes release their KV caches
        llm.wake_up()
        assert greedy(llm) == answers


def _bad_copy(src: str, dst: str, change: str) -> str:
    """src's checkpoint with one tensor widened ("shape") or one unknown tensor added ("name")."""
    os.makedirs(dst)
    for f in os.listdir(src):
        if not f.endswith(".safetensors"):
            os.symlink(os.path.join(src, f), os.path.join(dst, f))
    tensors = load_file(os.path.join(src, "model.safetensors"))
    if change == "shape":
        t = tensors["model.layers.1.mlp.down_proj.weight"]
        tensors["model.layers.1.mlp.down_proj.weight"] = torch.cat((t, t[:, :8]), 1)
    else:
        tensors["model.layers.1.mlp.surprise.weight"] = torch.zeros(4, 4)
    save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_reload_from_another_checkpoint_and_bad_checkpoints_change_nothing(update_checkpoints, tmp_path) -> None:
    a, b = update_checkpoints
    with LLM(a, dtype="float32") as llm:
        before = greedy(llm)
        assert before == hf_greedy(hf_model(a), PROMPTS, NEW_TOKENS)
        llm.reload_weights(weights_path=b)
        assert greedy(llm) == hf_greedy(hf_model(b), PROMPTS, NEW_TOKENS) != before
        llm.reload_weights()                                 # the model's own path again
        assert greedy(llm) == before
        for change, named in (("shape", r"model\.layers\.1\.mlp\.down_proj\.weight.*\(64, 136\).*\(64, 128\)"),
                              ("name", r"model\.layers\.1\.mlp\.surprise\.weight")):
            with pytest.raises(ValueError, match=named):
                llm.reload_weights(weights_path=_bad_copy(b, str(tmp_path / change), change))
            assert greedy(llm) == before                     # all or nothing: a's weights, untouched
