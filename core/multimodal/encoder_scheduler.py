"""The scheduler's multimodal part: a prompt chunk runs only with the encoder outputs of the items it touches.

Each step has an encoder budget (tokens of new encoder outputs). A chunk that reaches an item whose output is
neither cached nor affordable this step stops before that item; a chunk that starts inside an item (a prefix
hit, or the item split by chunked prefill) needs the whole item's output, which stays cached while any request
is part-way through it.

A family that attends both ways among an item's tokens (MultiModalConfig.bidirectional_items: Gemma 3) runs
each item whole: a chunk that would end inside an item stops before it, and a prefix hit that would end inside
one is cut back to its start (cut_hit), so the chunk that runs an item's tokens holds all of them and each can
see its item's last token. The engine refuses to start where --max-num-batched-tokens cannot hold one item
(common/multimodal/config.py).
"""
from __future__ import annotations

from pagedserve.common.multimodal.config import MultiModalConfig
from pagedserve.core.multimodal.encoder_cache import EncoderCacheManager, encoder_input
from pagedserve.core.request import Request
from pagedserve.ipc.messages import EncoderInput, MultiModalFeature


def _touched(request: Request, start: int, num_new: int) -> list[MultiModalFeature]:
    end = start + num_new
    return [f for f in request.mm_features if f.offset < end and f.offset + f.length > start]


class EncoderScheduler:
    def __init__(self, config: MultiModalConfig) -> None:
        self.cache = EncoderCacheManager(config.encoder_cache_size)
        self.budget = config.encoder_budget
        self.whole_items = config.bidirectional_items
        self.step_budget = 0
        self.step_inputs: list[EncoderInput] = []
        self._step_new: dict[str, list[str]] = {}     # request -> entries it added this step

    def begin_step(self) -> None:
        self.step_budget, self.step_inputs, self._step_new = self.budget, [], {}

    def fit(self, request: Request, start: int, num_new: int, can_cut: bool) -> int:
        """num_new, cut before the first item whose output cannot be had this step (0: none of the chunk
        runs). can_cut False (no chunked prefill): all of it or nothing."""
        if not request.mm_features or start >= request.num_prompt_tokens:
            return num_new
        if self.whole_items:
            num_new = self._before_split_item(request, start, num_new)
        budget, extra = self.step_budget, 0
        keep: set[str] = set()          # cached entries the chunk so far reads: never evicted for it
        planned: set[str] = set()
        for item in _touched(request, start, num_new):
            h = item.mm_hash
            if h in planned:
                continue
            if self.cache.has(h):
                fits = self.cache.can_fit(extra, keep | {h})      # room for the new ones with this one kept
            else:
                fits = item.length <= budget and self.cache.can_fit(extra + item.length, keep)
            if not fits:
                return max(item.offset - start, 0) if can_cut else 0
            if self.cache.has(h):
                keep.add(h)
                continue
            budget -= item.length
            extra += item.length
            planned.add(h)
        return num_new

    @staticmethod
    def _before_split_item(request: Request, start: int, num_new: int) -> int:
        """num_new, cut before the first item the chunk would end inside (0: the chunk starts at it)."""
        end = start + num_new
        for item in _touched(request, start, num_new):
            if item.offset + item.length > end:
                return max(item.offset - start, 0)
        return num_new

    def cut_hit(self, request: Request, num_hit: int) -> int:
        """The prefix hit's length, cut back to the start of an item it would end inside (whole-item families);
        the KV manager rounds it down to whole blocks."""
        if self.whole_items:
            for item in request.mm_features:
                if item.offset < num_hit < item.offset + item.length:
                    return item.offset
        return num_hit

    def commit(self, request: Request, start: int, num_new: int) -> None:
        """The chunk [start, start + num_new) is scheduled: its items are referenced, new ones computed."""
        if not request.mm_features or start >= request.num_prompt_tokens:
            return
        rid = request.request_id
        items = _touched(request, start, num_new)
        for item in items:              # the cached ones first: referenced, they are out of eviction's reach
            if self.cache.has(item.mm_hash):
                self.cache.acquire(item.mm_hash, rid)
        for item in items:
            if self.cache.has(item.mm_hash):
                continue
            self.cache.add(item.mm_hash, item.length, rid)
            self.step_inputs.append(encoder_input(item))
            self.step_budget -= item.length
            self._step_new.setdefault(rid, []).append(item.mm_hash)

    def take_back(self, request: Request) -> None:
        """A request scheduled this step was preempted before the step left: its new entries are dropped
        unless another request of the step reads them too."""
        for mm_hash in self._step_new.pop(request.request_id, []):
            self.cache.release(mm_hash, request.request_id)
            if not self.cache.refs.get(mm_hash):
                self.cache.forget(mm_hash)
                self.step_inputs = [i for i in self.step_inputs if i.mm_hash != mm_hash]
                self.step_budget += next(f.length for f in request.mm_features if f.mm_hash == mm_hash)
        self.release_all(request)

    def release_done(self, request: Request) -> None:
        """Items the request's computed tokens have passed: it no longer reads them."""
        for item in request.mm_features:
            if item.offset + item.length <= request.num_computed_tokens:
                self.cache.release(item.mm_hash, request.request_id)

    def release_all(self, request: Request) -> None:
        for item in request.mm_features:
            self.cache.release(item.mm_hash, request.request_id)

    def take_freed(self) -> list[str]:
        return self.cache.take_freed()
