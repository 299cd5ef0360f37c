"""The workers' M-RoPE positions per step: rows over text or past the prompt keep 1-D positions, shifted to the
rotary's (the table inside the prompt, index + delta past it); only a step whose rows cover vision tokens
gets [3, T] positions; slot mappings stay those of the token indices."""
from __future__ import annotations

import numpy as np

from pagedserve.common.params.sampling_params import SamplingParams
from pagedserve.executor.model.layers.mrope import mrope_positions
from pagedserve.executor.worker.input_prep import prepare_inputs
from pagedserve.executor.worker.multimodal.mrope import MRopeRows, rope_positions
from pagedserve.executor.worker.request_state import CachedRequestState

# a prompt of 3 text tokens, a 1 x 4 x 6 image (6 tokens after 2 x 2 merging), 4 text tokens
PROMPT = 13
ITEM = (3, 6, (1, 4, 6), 1.0)


def state(rid: str, computed: int, outputs: int = 0, mrope: bool = True) -> CachedRequestState:
    s = CachedRequestState(req_id=rid, token_ids=list(range(PROMPT + outputs)), num_prompt_tokens=PROMPT,
                           output_token_ids=list(range(outputs)), sampling_params=SamplingParams(),
                           block_ids=[0, 1, 2, 3], num_computed_tokens=computed)
    if mrope:
        positions, delta = mrope_positions(PROMPT, [ITEM], 2)
        vision = np.zeros(PROMPT, dtype=bool)
        vision[3:9] = True
        s.mrope = MRopeRows(positions, delta, vision)
    return s


def test_the_table_and_the_delta():
    positions, delta = mrope_positions(PROMPT, [ITEM], 2)
    assert positions[:, :3].tolist() == [[0, 1, 2]] * 3
    assert positions[:, 3:9].tolist() == [[3] * 6, [3, 3, 3, 4, 4, 4], [3, 4, 5, 3, 4, 5]]
    assert positions[0, 9:].tolist() == [6, 7, 8, 9]            # text goes on max(2, 3) past the image's start
    assert delta == 10 - PROMPT


def test_a_chunk_over_the_image_gets_three_rows_and_the_rest_one_shifted():
    states = {"a": state("a", 2), "b": state("b", 9), "c": state("c", PROMPT, outputs=2), "t": state("t", 4,
                                                                                                     mrope=False)}
    host = prepare_inputs(states, {"a": 5, "b": 4, "c": 1, "t": 3}, 4)
    slots = host.slot_mapping.copy()
    three = rope_positions(host.positions, host.query_start_loc, [states[r].mrope for r in host.req_ids])
    assert np.array_equal(host.slot_mapping, slots)
    rows = dict(zip(host.req_ids, np.split(np.arange(len(host.positions)), host.query_start_loc[1:-1])))
    table, delta = states["a"].mrope.positions, states["a"].mrope.delta
    assert three[:, rows["a"]].tolist() == table[:, 2:7].tolist()            # text, then the image's first 4
    assert (three[:, rows["b"]] == table[0, 9:13]).all()                     # text after the image
    assert (three[:, rows["c"]] == PROMPT + delta).all()                     # the first token past the prompt
    assert (three[:, rows["t"]] == [4, 5, 6]).all()                          # a request without images
    assert host.positions[rows["b"]].tolist() == table[0, 9:13].tolist()


def test_a_step_without_vision_tokens_keeps_the_1d_path():
    states = {"b": state("b", 9), "c": state("c", PROMPT + 2, outputs=3)}
    host = prepare_inputs(states, {"b": 4, "c": 1}, 4)
    assert rope_positions(host.positions, host.query_start_loc, [states[r].mrope for r in host.req_ids]) is None
    delta = states["c"].mrope.delta
    assert host.positions.tolist() == [PROMPT + 2 + delta, 6, 7, 8, 9]      # decodes first


def test_the_c_steps_context_lengths_are_the_token_indices_plus_one():
    """The C decode step reads each row's context length from the metadata: for unshifted positions it is
    the position + 1 it used to be given, for decodes, a verify pass's rows and a short prefill alike."""
    import torch

    from pagedserve.executor.model.models.llama_cpu_step import row_tables_and_lengths
    from pagedserve.kernels.attention.metadata import AttentionMetadata
    states = {"d": state("d", 10, mrope=False), "p": state("p", 0, mrope=False), "v": state("v", 4, mrope=False)}
    for scheduled in ({"d": 1}, {"d": 1, "p": 5}, {"v": 3, "p": 2}):
        host = prepare_inputs(states, scheduled, 4)
        tables = torch.from_numpy(host.block_tables).to(torch.int32)
        meta = AttentionMetadata(torch.from_numpy(host.slot_mapping), torch.from_numpy(host.query_start_loc),
                                 torch.from_numpy(host.seq_lens).to(torch.int32), tables, host.num_decodes, 5,
                                 int(host.seq_lens.max()), host.query_start_loc.tolist(), host.seq_lens.tolist())
        rows = len(host.positions)
        row_tables, lengths = row_tables_and_lengths(meta, rows)
        assert lengths.tolist() == (host.positions + 1).tolist() and len(row_tables) == rows
