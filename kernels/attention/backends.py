"""The attention backends, and the one place that picks one (get_attn_backend):

- CPU: a float cache read in place (kernels/attention/cpu_paged.py), decodes through the C kernel where it builds;
  the layers that path does not take (sliding window, soft-capping) attend through the reference.
- CPU_BATCH_INVARIANT: CPU, with every token's attention alone through the C kernel (--batch-invariant).
- TRITON: CUDA, one Triton launch for the whole mixed batch (kernels/attention/triton_paged.py); a step whose
  tokens see past themselves (AttentionMetadata.visible_until: a Gemma 3 image's prefill) attends through the
  reference.
- TORCH_REFERENCE: the gather-and-mask oracle (kernels/attention/reference.py): CUDA without Triton or with
  PAGEDSERVE_KERNELS=torch (A/B checks against the kernels), and any fp8 cache off CUDA.
"""
from __future__ import annotations

import torch

from pagedserve.kernels.attention import reference as attention_reference
from pagedserve.kernels.attention import cpu_paged as cpu_attention
from pagedserve.kernels.attention.interface import AttentionBackend, AttentionImpl, ScaledLayer
from pagedserve.kernels.attention.metadata import AttentionMetadata
from pagedserve.kernels.ops import triton_usable


class CpuAttentionImpl(AttentionImpl):
    # Every token alone through the C kernel (cpu_paged.row_native): 1.4-2.1x SDPA's time on 512-2048-token
    # prompts, so only where asked (CpuBatchInvariantAttentionImpl; docs/determinism.md).
    per_token = False

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if self.kv_cache_dtype.itemsize == 1:
            raise ValueError("the CPU attention backend takes float KV caches; an fp8 cache takes TORCH_REFERENCE")
        # The in-place path has no window or cap; such layers write in place and attend the plain way.
        self.in_place = self.sliding_window is None and self.logit_softcap is None

    def forward(self, layer: ScaledLayer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        cpu_attention.write_kv_cache(key, value, k_cache, v_cache, cpu_attention.write_plan(meta.slot_mapping, k_cache))
        if self.in_place:
            return cpu_attention.attend(query, k_cache, v_cache, meta, self.scale, self.per_token)
        return attention_reference.paged_attention(query, k_cache, v_cache, meta, self.scale, self.sliding_window,
                                                   self.logit_softcap)


class CpuAttentionBackend(AttentionBackend):
    name = "CPU"

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return CpuAttentionImpl


class CpuBatchInvariantAttentionImpl(CpuAttentionImpl):
    """A token's attention the same bits whatever the chunk or batch it comes in: each token alone."""
    per_token = True


class CpuBatchInvariantAttentionBackend(AttentionBackend):
    name = "CPU_BATCH_INVARIANT"

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return CpuBatchInvariantAttentionImpl


class TritonAttentionImpl(AttentionImpl):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        from pagedserve.kernels.attention import triton_paged as triton_attention
        from pagedserve.kernels.attention import triton_cache  # imports triton: CUDA only
        self._write, self._attend = triton_cache.write_kv_cache, triton_attention.paged_attention

    def forward(self, layer: ScaledLayer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        self._write(key, value, k_cache, v_cache, meta.slot_mapping, layer.k_scale, layer.v_scale)
        if meta.visible_until is not None:      # widened rows (a Gemma 3 image's prefill): the kernel has no path
            return attention_reference.paged_attention(query, k_cache, v_cache, meta, self.scale, self.sliding_window,
                                                       self.logit_softcap, layer.k_scale, layer.v_scale)
        return self._attend(query, k_cache, v_cache, meta, self.scale, window=self.sliding_window,
                            softcap=self.logit_softcap, k_scale=layer.k_scale, v_scale=layer.v_scale)


class TritonAttentionBackend(AttentionBackend):
    name = "TRITON"

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return TritonAttentionImpl


class ReferenceAttentionImpl(AttentionImpl):
    def forward(self, layer: ScaledLayer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        attention_reference.write_kv_cache(key, value, k_cache, v_cache, meta.slot_mapping, layer.k_scale,
                                           layer.v_scale)
        return attention_reference.paged_attention(query, k_cache, v_cache, meta, self.scale, self.sliding_window,
                                                   self.logit_softcap, layer.k_scale, layer.v_scale)


class TorchReferenceAttentionBackend(AttentionBackend):
    name = "TORCH_REFERENCE"

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return ReferenceAttentionImpl


def get_attn_backend(device: torch.device | str, kv_cache_dtype: torch.dtype,
                     batch_invariant: bool = False) -> type[AttentionBackend]:
    """The backend for caches of kv_cache_dtype on device: asked once per layer binding and once by the runner.
    batch_invariant (ModelConfig.batch_invariant): on CPU, the per-token one; CUDA has no invariant kernels yet."""
    device = torch.device(device)
    if device.type == "cuda":
        return TritonAttentionBackend if triton_usable() else TorchReferenceAttentionBackend
    if kv_cache_dtype.itemsize == 1:
        return TorchReferenceAttentionBackend
    return CpuBatchInvariantAttentionBackend if batch_invariant else CpuAttentionBackend
