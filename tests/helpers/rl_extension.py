"""A worker extension for the tests (worker_extension_cls="pagedserve.tests.helpers.rl_extension.Probe"): its
methods join the worker's and collective_rpc reaches them on every rank."""
from __future__ import annotations

from typing import Any


class Probe:
    def describe_rank(self, tag: str = "") -> dict[str, Any]:
        """Which rank answered, its tensor-parallel slice of one weight, and the caller's tag back."""
        qkv = self.runner.model.model.layers[0].self_attn.qkv_proj.weight
        return {"rank": self.rank, "tp_rank": self.tp.rank, "rows": qkv.shape[0], "tag": tag}

    def weight_tensor(self) -> Any:
        """A tensor: not JSON-able, so collective_rpc refuses to send it back."""
        return self.runner.model.model.norm.weight
