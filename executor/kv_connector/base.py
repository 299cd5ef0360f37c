"""The workers' side of a KV connector, shaped as vLLM's KVConnectorBase_V1 (its worker-role methods).

Each step the model runner binds the scheduler's KVConnectorMetadata, lets the connector load before the
forward (start_load_kv, then wait_for_layer_load per layer), hands it each layer's cache after the forward
(save_kv_layer), waits until the step's blocks are copied out (wait_for_save), and sends what finished
(get_finished) back with the step's output."""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from pagedserve.ipc.messages import KVConnectorMetadata, KVConnectorOutput


class KVConnectorWorker(ABC):
    _metadata: KVConnectorMetadata | None = None

    @abstractmethod
    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        """The caches the model runner bound (one [2, num_blocks, kv_heads, block_size, head_dim] per layer)."""

    def bind_connector_metadata(self, metadata: KVConnectorMetadata | None) -> None:
        self._metadata = metadata

    def clear_connector_metadata(self) -> None:
        self._metadata = None

    @abstractmethod
    def start_load_kv(self) -> None:
        """Begin this step's loads (they fill blocks of requests that run in a later step)."""

    @abstractmethod
    def wait_for_layer_load(self, layer_index: int) -> None:
        """Return once layer layer_index's loads are in its cache."""

    @abstractmethod
    def save_kv_layer(self, layer_index: int, kv_layer: torch.Tensor) -> None:
        """A layer's cache after the forward wrote this step's K and V: take the step's blocks to save."""

    @abstractmethod
    def wait_for_save(self) -> None:
        """Return once the step's blocks are copied out of the cache (the pool may then reuse them); the
        writes to the store may go on."""

    @abstractmethod
    def get_finished(self, finished_req_ids: list[str]) -> KVConnectorOutput | None:
        """Loads done and saves stored since the last call (vLLM's finished_recving / finished_sending); None
        when there is nothing to report."""

    def close(self) -> None:
        """At shutdown: finish what was handed over, within reason."""
