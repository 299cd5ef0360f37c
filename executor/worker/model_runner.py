"""Runs one scheduled step: update the persistent batch, prepare inputs, forward, sample."""
from __future__ import annotations

import logging
import math
import mmap
import threading
import time
from typing import Protocol

import torch
from torch import nn

from pagedserve.common.config.engine_args import EngineConfig
from pagedserve.executor.kv_connector.offloading import make_worker_connector
from pagedserve.executor.model.parallel_state import PPGroup
from pagedserve.executor.worker.cuda_graphs import CudaGraphRunner, capture_sizes
from pagedserve.executor.worker.spec_decode.draft_proposer import DraftModelProposer, bind_draft_cache
from pagedserve.executor.worker.spec_decode.eagle_proposer import EagleProposer
from pagedserve.executor.worker.sample.grammar_mask import grammar_rows
from pagedserve.executor.worker.input_prep import prepare_inputs
from pagedserve.executor.worker.lora.manager import LoRAManager
from pagedserve.executor.worker.multimodal.encoder_runner import EncoderRunner
from pagedserve.executor.worker.multimodal.item_bounds import visible_until
from pagedserve.executor.worker.multimodal.mrope import MRopeRows, rope_positions
from pagedserve.executor.worker.pooling_step import pooling_output, token_type_ids
from pagedserve.executor.worker.sample.prompt_logprobs import compute_prompt_logprobs
from pagedserve.executor.worker.spec_decode.rejection_sampler import verify_drafts
from pagedserve.executor.worker.request_state import CachedRequestState
from pagedserve.executor.worker.sample.sampler import Sampler
from pagedserve.executor.worker.sample.sampling_inputs import build_sampling_metadata
from pagedserve.executor.worker.step_buffers import PreparedBatch, StepBuffers
from pagedserve.executor.worker.step_output import PendingStep, PinnedPool
from pagedserve.ipc.messages import GrammarBitmask, ModelRunnerOutput, SchedulerOutput
from pagedserve.kernels.attention.backends import get_attn_backend
from pagedserve.kernels.attention.kv_quant import kv_cache_torch_dtype
from pagedserve.kernels.attention.metadata import AttentionMetadata

logger = logging.getLogger(__name__)

class DecodeStep(Protocol):
    """A model's whole-decoder step: hidden states for the steps it takes, None for the rest. Built once the KV
    cache is bound (the model's make_decode_step), e.g. the C step of quantized CPU Llama models. lora_slots:
    each token's adapter slot (int32, -1: none), or None for a step without adapter tokens."""

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                 lora_slots: torch.Tensor | None = None) -> torch.Tensor | None: ...


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed KV cache. On CPU an anonymous mapping: the OS guarantees its pages read as zero and makes them
    resident only when first written, so the cache holds memory for the blocks in use, not the whole
    --kv-cache-memory at start (torch.zeros writes every page: 2 GiB of resident memory from the first
    request on)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype, count=math.prod(shape)).view(shape)


class ModelRunner:
    def __init__(self, config: EngineConfig, model: nn.Module, device: torch.device, dtype: torch.dtype,
                 draft_model: nn.Module | None = None, pp: PPGroup = PPGroup()) -> None:
        self.config = config
        self.model = model
        self.pp = pp
        self._sends: list = []          # this stage's activations still being sent to the next
        self.device = device
        self.dtype = dtype
        self.kv_dtype = kv_cache_torch_dtype(config.cache.cache_dtype, dtype)
        self.block_size = config.cache.block_size
        self.vocab_size = config.model.vocab_size
        self.eos_token_ids = config.model.eos_token_ids
        self.sampler = Sampler()
        self.states: dict[str, CachedRequestState] = {}
        self.kv_caches: list[torch.Tensor] = []
        # One attention backend for every layer (one device, one cache dtype): its impls are bound with the
        # caches, its builder makes each step's metadata.
        self.attn_backend = get_attn_backend(device, self.kv_dtype, config.model.batch_invariant)
        logger.info("attention backend: %s", self.attn_backend.name)
        sched = config.scheduler
        self.buffers = StepBuffers(max(sched.max_num_batched_tokens, sched.max_num_seqs), sched.max_num_seqs,
                                   -(-config.model.max_model_len // self.block_size), device,
                                   self.attn_backend.get_builder_cls()(self.attn_backend))
        self.graphs: CudaGraphRunner | None = None
        self.decode_step: DecodeStep | None = None
        spec = config.speculative
        self.drafter: DraftModelProposer | EagleProposer | None = None
        if draft_model is not None:
            kind = EagleProposer if spec.is_eagle else DraftModelProposer
            extra = (model,) if spec.is_eagle else ()
            self.drafter = kind(draft_model, *extra, spec.num_speculative_tokens, config.model.max_model_len,
                                self.block_size)
        self.draft_caches: list[torch.Tensor] = []
        # Guards the request states between launch() and a PendingStep.result() taken on another thread.
        self._lock = threading.RLock()
        self._pinned = PinnedPool(sched.max_num_seqs, device)
        self.lora = LoRAManager(model, config.lora, dtype, device) if config.lora is not None else None
        multimodal = config.multimodal is not None and pp.is_first
        self.encoder = EncoderRunner(model, device) if multimodal else None
        self.mrope = hasattr(model, "mrope_positions")       # M-RoPE (Qwen2-VL): positions per request
        # Gemma 3: an item's tokens attend to each other both ways (item_bounds.py)
        self.bidirectional_items = multimodal and config.multimodal.bidirectional_items
        self.kv_connector = make_worker_connector(config.kv_transfer)   # --kv-transfer-config: loads, saves

    def initialize_kv_cache(self, num_blocks: int) -> None:
        layers = self.model.attention_layers()
        if not layers:                     # an encoder (BERT): no KV cache; blocks are the scheduler's bookkeeping
            return
        shape = (2, num_blocks, layers[0].num_kv_heads, self.block_size, layers[0].head_dim)
        self.kv_caches = []        # let a previous (profiling) cache go before the new one is allocated
        # Zeros, not empty: attention reads whole blocks and masks the tail, and a masked NaN in V
        # still poisons the output (0 * NaN).
        self.kv_caches = [_zeros(shape, self.kv_dtype, self.device) for _ in layers]
        for layer, cache in zip(layers, self.kv_caches):
            layer.bind_kv_cache(cache, self.attn_backend)
        if self.kv_connector is not None:
            self.kv_connector.register_kv_caches(self.kv_caches)
        if self.drafter is not None:       # the draft's own cache, indexed by the same block ids
            draft_layers = self.drafter.model.attention_layers()
            shape = (2, num_blocks, draft_layers[0].num_kv_heads, self.block_size, draft_layers[0].head_dim)
            self.draft_caches = []
            self.draft_caches = [_zeros(shape, self.kv_dtype, self.device) for _ in draft_layers]
            bind_draft_cache(self.drafter.model, self.draft_caches, self.attn_backend)
            if isinstance(self.drafter, DraftModelProposer):     # its passes take its own C step, where it has one
                self.drafter.build_decode_step()
        self._build_decode_step()

    def _build_decode_step(self) -> None:
        make_step = None if self._needs_aux_hidden else getattr(self.model, "make_decode_step", None)
        self.decode_step = make_step() if make_step is not None else None
        logger.debug("whole-decoder decode step: %s", type(self.decode_step).__name__ if self.decode_step else None)

    def rebind_weights(self) -> None:
        """After a weight update gave some weights new tensors (a quantized layer whose form changed): the C
        decode step and the CUDA graphs, which hold the old addresses, are built again."""
        if self.kv_caches:
            self._build_decode_step()
        if self.graphs is not None:
            self.capture_cuda_graphs()

    def capture_cuda_graphs(self) -> int:
        """Capture decode graphs (CUDA only); returns the bytes their memory pool took."""
        if self.config.pooler is not None:
            logger.info("no CUDA graphs: a pooling model runs prompts, never decodes")
            return 0
        if self._needs_aux_hidden or self.pp.size > 1:
            logger.info("no CUDA graphs: %s", "pipeline stages pass activations between them" if self.pp.size > 1
                        else "EAGLE-3 reads the model's inner layers, which a replay does not keep")
            return 0
        self.graphs = CudaGraphRunner(self.model, self.buffers, capture_sizes(self.config.scheduler.max_num_seqs))
        self.graphs.capture()
        return self.graphs.pool_bytes

    @property
    def _needs_aux_hidden(self) -> bool:
        return isinstance(self.drafter, EagleProposer) and self.drafter.needs_aux_hidden

    def _update_states(self, sched: SchedulerOutput) -> None:
        for rid in sched.finished_req_ids:
            self.states.pop(rid, None)
        for data in sched.scheduled_new_reqs:
            state = self.states[data.req_id] = CachedRequestState.from_new(data)
            if self.mrope:
                state.mrope = MRopeRows.of(self.model, state.num_prompt_tokens, state.mm_features)
        cached = sched.scheduled_cached_reqs
        for rid, new_blocks, num_computed in zip(cached.req_ids, cached.new_block_ids, cached.num_computed_tokens):
            state = self.states[rid]
            state.block_ids.extend(new_blocks)
            state.num_computed_tokens = num_computed
        if cached.new_token_ids and not self.pp.is_last:     # the last stage sampled them itself
            for rid, num_computed, ids in zip(cached.req_ids, cached.num_computed_tokens, cached.new_token_ids):
                state = self.states[rid]
                del state.token_ids[num_computed:]
                state.token_ids.extend(ids)

    def _forward(self, sched: SchedulerOutput) -> tuple[PreparedBatch, torch.Tensor]:
        with self._lock:
            host = prepare_inputs(self.states, sched.num_scheduled_tokens, self.block_size,
                                  sched.scheduled_spec_decode_tokens)
        # Steps with adapter tokens replay no CUDA graph; the whole-decoder step takes them where it holds the
        # adapter slots (the C step), else the layers apply them.
        plain = self.lora is None or not self.lora.prepare(host.req_ids, self.states, host.query_start_loc)
        mm = self.encoder.gather(host, self.states) if self.encoder is not None else None
        # M-RoPE: host.positions shifted to the rotary's; [3, T] where a row covers vision tokens
        rope3 = (rope_positions(host.positions, host.query_start_loc, [self.states[r].mrope for r in host.req_ids])
                 if self.mrope else None)
        decode_only = host.num_decodes == host.num_seqs and mm is None and rope3 is None
        size = self.graphs.padded_size(host.num_seqs) if self.graphs is not None and decode_only and plain else None
        batch = self.buffers.commit(host, pad_to=size)
        if self.bidirectional_items and mm is not None:
            until = visible_until(host, self.states)
            if until is not None:
                batch.meta.visible_until = torch.from_numpy(until).to(self.device)
        if host.pending_inputs:
            self.buffers.apply_pending(batch.input_ids, host.pending_inputs)
        if size is not None:
            return batch, self.graphs.replay(size)
        positions = batch.positions if rope3 is None else torch.from_numpy(rope3).to(self.device)
        if mm is not None:          # placeholder tokens take the encoder's rows: no whole-decoder C step
            embeds = self.model.embed_input_ids(batch.input_ids)
            embeds[mm[0]] = mm[1].to(embeds.dtype)
            return batch, self.model(batch.input_ids, positions, batch.meta, inputs_embeds=embeds)
        lora_slots = None if plain else self.lora.context.row_slots
        if self.decode_step is not None and rope3 is None and (plain or lora_slots is not None):
            hidden = self.decode_step(batch.input_ids, batch.positions, batch.meta, lora_slots)
            if hidden is not None:
                return batch, hidden
        if self.pp.size > 1:
            intermediate = None if self.pp.is_first else self.pp.recv(
                (len(batch.input_ids), self.config.model.hf_config.hidden_size), self.dtype, self.device, 2)
            return batch, self.model(batch.input_ids, positions, batch.meta, intermediate)
        extra = token_type_ids(self.model, batch, self.states, self.device) if self.config.pooler else {}
        return batch, self.model(batch.input_ids, positions, batch.meta, **extra)

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self.launch(sched).result()

    @torch.inference_mode()
    def launch(self, sched: SchedulerOutput) -> PendingStep:
        """The step, with the KV connector's loads before it and its saves after it (docs/kv_tiers.md)."""
        kv = self.kv_connector
        if kv is None:
            return self._launch(sched)
        kv.bind_connector_metadata(sched.kv_connector_metadata)
        kv.start_load_kv()              # loads fill blocks of requests that run in a later step
        step = self._launch(sched)
        for i, cache in enumerate(self.kv_caches):
            kv.save_kv_layer(i, cache)  # after the forward (the layers' own hooks: not yet, docs/kv_tiers.md)
        kv.wait_for_save()
        step.kv_connector_output = kv.get_finished(sched.finished_req_ids)
        kv.clear_connector_metadata()
        return step

    def _launch(self, sched: SchedulerOutput) -> PendingStep:
        """Queue the step on the device and return before its sampled ids reach the host. A request whose
        sampling reads its earlier ids (penalties, bad words) waits for them; drafts and a draft model
        need the ids on the host, so those steps finish here."""
        self._update_states(sched)
        if self.encoder is not None:
            self.encoder.run(sched)
        if sched.total_num_scheduled_tokens == 0:
            return PendingStep.ready(ModelRunnerOutput(req_ids=[], sampled_token_ids=[]))
        if not sched.time_forward:
            return self._after_forward(sched, *self._forward(sched))
        # A traced request is in the step (--collect-detailed-traces): its forward, timed to the device's end.
        self._sync()
        start = time.perf_counter()
        batch, hidden = self._forward(sched)
        self._sync()
        forward_s = time.perf_counter() - start
        step = self._after_forward(sched, batch, hidden)
        step.forward_time = forward_s
        return step

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _after_forward(self, sched: SchedulerOutput, batch: PreparedBatch, hidden: torch.Tensor) -> PendingStep:
        """The step past its forward: pooling, the next stage's send, or the logits and sampling."""
        if self.config.pooler is not None:     # every request of a pooling model pools; none samples
            return PendingStep.ready(pooling_output(self.model, self.config.pooler, batch, hidden, self.states))
        if not self.pp.is_last:
            self._send(hidden)
            return PendingStep.ready(ModelRunnerOutput(req_ids=batch.req_ids,
                                                       sampled_token_ids=[-1] * len(batch.req_ids)))
        prompt_logprobs = compute_prompt_logprobs(self.model, hidden, batch.req_ids, self.states,
                                                  batch.meta.query_start_loc_cpu, batch.meta.seq_lens_cpu)
        step = PendingStep(batch.req_ids, self._lock, self._pinned, prompt_logprobs)
        drafts = sched.scheduled_spec_decode_tokens
        plain = [j for j, row in enumerate(batch.sample_rows) if batch.req_ids[row] not in drafts]
        if plain:
            rows = [batch.sample_rows[j] for j in plain]
            states = [self.states[batch.req_ids[i]] for i in rows]
            self._settle(states)
            indices = batch.logits_indices if len(plain) == len(batch.sample_rows) else batch.logits_indices[plain]
            logits = self.model.compute_logits(hidden[indices])
            meta = build_sampling_metadata(states, self.eos_token_ids, self.device)
            meta.grammar = grammar_rows(sched.grammar_bitmask, [batch.req_ids[i] for i in rows], self.device)
            out = self.sampler(logits, meta)
            with self._lock:
                step.record(rows, states, out)
        if not drafts and self.drafter is None:
            return step
        result = step.result()
        if drafts:
            self._verify(batch, hidden, drafts, result, sched.grammar_bitmask)
        if self.drafter is not None:
            self._propose(batch, hidden, result, sched.num_draft_tokens_to_propose)
        return PendingStep.ready(result)

    def _send(self, activations: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Hand (hidden, residual) to the next stage; the previous step's sends finish first, so at most one
        step's activations are held."""
        for work in self._sends:
            work.wait()
        self._sends = self.pp.send(activations)

    def _settle(self, states: list[CachedRequestState]) -> None:
        """Take the outputs of the steps whose ids these requests' sampling reads (see needs_token_values)."""
        with self._lock:        # another thread may be filling these states' pending ids
            steps = {id(step): step for state in states if state.pending and state.needs_token_values
                     for step, _ in state.pending.values()}
        for step in steps.values():
            step.result()       # outside the lock: result() waits on the device, then takes it

    def _propose(self, batch: PreparedBatch, hidden: torch.Tensor, result: ModelRunnerOutput,
                 asked: dict[str, int]) -> None:
        """The draft model or head runs the step's tokens, then drafts for the rows that sampled and that the
        core asked proposals of, as many as it asked (its next plan would verify no more)."""
        k = self.config.speculative.num_speculative_tokens
        rows = [row for row in batch.sample_rows if asked.get(batch.req_ids[row], 0) > 0]
        lengths = [min(asked[batch.req_ids[row]], k) for row in rows]
        drafts = self.drafter.propose(batch, hidden, self.states, rows, lengths, self.buffers)
        result.draft_token_ids = [[] for _ in batch.req_ids]
        for row, draft in zip(rows, drafts):
            result.draft_token_ids[row] = draft

    def _verify(self, batch: PreparedBatch, hidden: torch.Tensor, drafts: dict[str, list[int]],
                result: ModelRunnerOutput, grammar: GrammarBitmask | None) -> None:
        """Rows with drafts: logits at each of their k + 1 positions, the rejection sampler's verdict, the
        accepted tokens appended (the core rolls back the rejected ones' KV slots)."""
        rows = [row for row in batch.sample_rows if batch.req_ids[row] in drafts]
        ends = [batch.meta.query_start_loc_cpu[row + 1] for row in rows]
        row_drafts = [drafts[batch.req_ids[row]] for row in rows]
        indices = torch.tensor([i for end, d in zip(ends, row_drafts) for i in range(end - len(d) - 1, end)],
                               device=hidden.device)
        states = [self.states[batch.req_ids[row]] for row in rows]
        positions = [batch.req_ids[row] for row, d in zip(rows, row_drafts) for _ in range(len(d) + 1)]
        verdicts = verify_drafts(self.model.compute_logits(hidden[indices]), states, row_drafts,
                                 self.eos_token_ids, self.device, grammar_rows(grammar, positions, self.device))
        result.spec_token_ids = [[] for _ in batch.req_ids]
        result.spec_logprobs = [None] * len(batch.req_ids)
        for row, state, verdict in zip(rows, states, verdicts):
            for token in (*verdict.accepted, verdict.token):
                state.append(token)
            result.sampled_token_ids[row] = verdict.token
            result.spec_token_ids[row] = verdict.accepted
            if verdict.entries is not None:
                if result.logprobs is None:
                    result.logprobs = [None] * len(batch.req_ids)
                result.spec_logprobs[row] = verdict.entries[:-1]
                result.logprobs[row] = verdict.entries[-1]
