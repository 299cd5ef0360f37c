"""The scheduler's side of a KV connector, shaped as vLLM's KVConnectorBase_V1 (its scheduler-role methods).

A connector is a store of KV blocks beside the pool (a disk tier, another instance). Per step the scheduler
asks it how many tokens past the prefix cache it holds for a waiting request, allocates blocks for them,
and sends the workers' side what to load and what to save in the step's SchedulerOutput. The workers report
back in the ModelRunnerOutput; a request counts its loaded tokens as computed only once they arrived.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from typing import Any

from pagedserve.core.request import Request
from pagedserve.ipc.messages import KVConnectorMetadata, KVConnectorOutput, KVTransferStats, SchedulerOutput


class KVConnectorScheduler(ABC):
    # Totals since start, in tokens (vllm:external_prefix_cache_queries / _hits).
    queries: int = 0
    hits: int = 0

    def transfer_stats(self) -> KVTransferStats | None:
        """The tier's totals for /metrics' kv_transfer section; None: a connector without a tier of its own."""
        return None

    @abstractmethod
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens past num_computed_tokens (the prefix cache's hit) the connector can provide, and whether
        they arrive asynchronously (the request then waits for them, outside the batch)."""

    @abstractmethod
    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        """The request's blocks (all of them, in order) once the scheduler allocated room for the external
        tokens: the connector plans their loads."""

    @abstractmethod
    def build_connector_meta(self, scheduler_output: SchedulerOutput, requests: Mapping[str, Request],
                             block_ids: Callable[[str], list[int]]) -> KVConnectorMetadata | None:
        """This step's loads and saves, for the workers (None: nothing). Called once the step is scheduled:
        each scheduled request's num_computed_tokens already counts its tokens of this step. Unlike vLLM the
        scheduler hands over its requests and block tables instead of the connector tracking them itself."""

    @abstractmethod
    def update_connector_output(self, output: KVConnectorOutput) -> dict[str, int]:
        """The workers' report; returns the requests whose loads finished, each with its computed tokens (the
        prefix cache's hit plus the blocks that arrived intact)."""

    @abstractmethod
    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """The request ended; (whether its blocks must outlive it until the connector is done with them,
        kv_transfer_params for the client). Saves copy blocks out within their step, so no: (False, None)."""

    def request_preempted(self, request: Request) -> None:
        """Ours (vLLM's scheduler recomputes a preempted request): the request lost its blocks in the pool and
        will resume from what the prefix cache and the connector still hold (docs/kv_tiers.md: swap)."""
