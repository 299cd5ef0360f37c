"""Run one lm-eval model on the repository's tiny_mc task and write its per-item loglikelihoods as JSON.

A script, run as a subprocess by tests/e2e/docs_and_tools/test_lm_eval.py: lm-eval and `datasets` read their offline and cache
settings from the environment when they are imported, so each run gets a fresh interpreter with that
environment. Usage: python -m pagedserve.tests.helpers.lm_eval_run MODEL MODEL_ARGS_JSON OUT_JSON
(working directory: the repository root, where the task's data_files path is relative to).
"""
from __future__ import annotations

import json
import os
import sys


def main(model: str, model_args: dict, out_path: str) -> None:
    import lm_eval
    from lm_eval.tasks import TaskManager

    tasks = TaskManager(include_path=os.path.join(os.getcwd(), "tests", "data"))
    results = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=["tiny_mc"], task_manager=tasks,
                                      num_fewshot=0, batch_size=1, log_samples=True, device="cpu")
    samples = sorted(results["samples"]["tiny_mc"], key=lambda s: s["doc_id"])
    # resps: one [loglikelihood, is_greedy] list per choice
    lls = [[float(r[0][0]) for r in s["resps"]] for s in samples]
    with open(out_path, "w") as f:
        json.dump({"acc": results["results"]["tiny_mc"]["acc,none"], "loglikelihoods": lls}, f)


if __name__ == "__main__":
    main(sys.argv[1], json.loads(sys.argv[2]), sys.argv[3])
