"""The model runner's side of pooling models: token type ids in, pooled vectors out (as raw float32 bytes in
ModelRunnerOutput.pooler_output; never pickle)."""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

from pagedserve.common.pooler_config import PoolerConfig
from pagedserve.executor.model.layers.pooler import classify_output, embed_output, pool
from pagedserve.executor.worker.request_state import CachedRequestState
from pagedserve.executor.worker.step_buffers import PreparedBatch
from pagedserve.ipc.messages import ModelRunnerOutput


def token_type_ids(model: nn.Module, batch: PreparedBatch, states: dict[str, CachedRequestState],
                   device: torch.device) -> dict[str, torch.Tensor]:
    """The model's extra forward argument for steps of a model that reads segment ids (BERT): each row's ids
    for its tokens of this step, 0 where the request brings none."""
    if not getattr(model, "uses_token_type_ids", False):
        return {}
    qsl, seq_lens = batch.meta.query_start_loc_cpu, batch.meta.seq_lens_cpu
    out = np.zeros(qsl[-1], dtype=np.int64)
    any_set = False
    for row, rid in enumerate(batch.req_ids):
        params = states[rid].pooling_params
        if params is not None and params.token_type_ids is not None:
            count = qsl[row + 1] - qsl[row]
            end = seq_lens[row]
            out[qsl[row]:qsl[row + 1]] = params.token_type_ids[end - count:end]
            any_set = True
    return {"token_type_ids": torch.from_numpy(out).to(device)} if any_set else {}


@torch.inference_mode()
def pooling_output(model: nn.Module, config: PoolerConfig, batch: PreparedBatch, hidden: torch.Tensor,
                   states: dict[str, CachedRequestState]) -> ModelRunnerOutput:
    """Pool the rows whose prompt is complete in this step (sample_rows); other rows (earlier chunks of a
    chunked decoder prompt) get None."""
    qsl = batch.meta.query_start_loc_cpu
    rows = batch.sample_rows
    pooled: list[bytes | None] = [None] * len(batch.req_ids)
    if rows:
        vectors = pool(hidden, [qsl[r] for r in rows], [qsl[r + 1] for r in rows], config.pooling_type)
        if config.task == "classify":
            vectors = model.classify(vectors.to(hidden.dtype)).float()
        vectors = vectors.cpu()        # one copy to the host for the step; the per-request shaping is small
        for k, row in enumerate(rows):
            params = states[batch.req_ids[row]].pooling_params
            shaped = (embed_output(vectors[k], params, config) if config.task == "embed"
                      else classify_output(vectors[k], params))
            pooled[row] = shaped.numpy().astype("<f4").tobytes()
    return ModelRunnerOutput(req_ids=batch.req_ids, sampled_token_ids=[-1] * len(batch.req_ids),
                             pooler_output=pooled)
