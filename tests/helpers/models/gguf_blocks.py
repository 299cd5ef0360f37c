"""GGUF blocks for tests: the gguf package has no K-quant quantizer, so K-quant blocks are built byte by byte;
the others come from its quantizer."""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as T


def random_f16(rng: np.random.Generator, n: int) -> np.ndarray:
    """Finite positive block scales spanning a few decades, as f16 bytes [n, 2]."""
    return (10.0 ** rng.uniform(-4, 0, (n, 1))).astype(np.float16).view(np.uint8)


def random_k_blocks(qtype: T, n: int, seed: int) -> np.ndarray:
    """K-quant blocks with every code/scale byte random (the gguf package has no K-quant quantizer)."""
    rng = np.random.default_rng(seed)
    raw = lambda k: rng.integers(0, 256, (n, k), dtype=np.uint8)   # noqa: E731
    if qtype == T.Q4_K:        # d | dmin | scales | qs
        return np.concatenate([random_f16(rng, n), random_f16(rng, n), raw(12), raw(128)], axis=1)
    if qtype == T.Q5_K:        # d | dmin | scales | qh | qs
        return np.concatenate([random_f16(rng, n), random_f16(rng, n), raw(12), raw(32), raw(128)], axis=1)
    return np.concatenate([raw(128), raw(64), raw(16), random_f16(rng, n)], axis=1)   # Q6_K: ql|qh|sc|d


def random_gguf_weight(qtype: T, rows: int, cols: int):
    """A [rows, cols] weight in qtype, decoded to the loader's group-affine form: random K-quant bytes, or a
    gguf-quantized normal matrix (seeded by the type)."""
    from gguf.quants import quantize

    from pagedserve.executor.model.quant.gguf_blocks import decode_gguf_tensor
    if qtype in (T.Q4_K, T.Q5_K, T.Q6_K):
        blocks = random_k_blocks(qtype, rows * cols // 256, seed=int(qtype)).reshape(rows, -1)
    else:
        rng = np.random.default_rng(int(qtype))
        blocks = quantize(rng.standard_normal((rows, cols)).astype(np.float32) * 0.05, qtype)
    return decode_gguf_tensor(blocks, qtype, (rows, cols))
