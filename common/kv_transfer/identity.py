"""What a stored block's KV depends on besides its tokens, as one digest: the tier's namespace.

A block hash (core/block_hash.py) covers the tokens, the LoRA adapter's digest, the multimodal items and an
in-process weights version; across processes the KV also depends on the model's files, the dtypes, the
layout and the device. Two engines share stored blocks exactly when all of these agree."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Any

from pagedserve.common.config.engine_config import CacheConfig, ModelConfig, ParallelConfig
from pagedserve.common.kv_transfer.config import KVTransferConfig, check_kv_transfer_engine, parse_kv_transfer
from pagedserve.common.kv_transfer.layout import FORMAT_VERSION

# Files whose content is the weights: their size and modification time stand for their content (hashing
# gigabytes at every start would cost seconds; a rewritten file gets a new mtime, so it misses, never hits).
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")


def model_identity(model: ModelConfig) -> dict[str, Any]:
    path = model.source.path
    files = [path] if os.path.isfile(path) else sorted(
        os.path.join(path, name) for name in os.listdir(path) if name.endswith(_WEIGHT_SUFFIXES))
    stats = []
    for file in files:
        st = os.stat(file)
        stats.append([os.path.basename(file), st.st_size, st.st_mtime_ns])
    return {"path": os.path.abspath(path), "format": model.source.format, "files": stats,
            "config": json.dumps(model.hf_config.to_dict(), sort_keys=True, default=str),
            "dtype": model.dtype, "device": model.device, "quantization": repr(model.quantization)}


def kv_namespace(model: ModelConfig, draft: ModelConfig | None, speculative: Any, cache: CacheConfig,
                 parallel: ParallelConfig) -> str:
    """A hex digest of everything above; the tier keeps each namespace in a folder of its own."""
    parts = {"format": FORMAT_VERSION, "model": model_identity(model),
             "draft": model_identity(draft) if draft is not None else None,
             "speculative": repr(speculative) if draft is not None else None,
             "kv_cache_dtype": cache.cache_dtype, "block_size": cache.block_size,
             "tp": parallel.tensor_parallel_size, "pp": parallel.pipeline_parallel_size}
    return hashlib.blake2b(json.dumps(parts, sort_keys=True).encode(), digest_size=16).hexdigest()


def resolve_kv_transfer(args: Any, model: ModelConfig, draft: ModelConfig | None, speculative: Any,
                        cache: CacheConfig, parallel: ParallelConfig, pooling: bool) -> KVTransferConfig | None:
    """EngineArgs' connector settings (args: its kv_transfer_config and kv_offloading_* fields) resolved, with
    the namespace of this engine's blocks; None without a connector. ValueError naming the flag."""
    kv = parse_kv_transfer(args.kv_transfer_config, args.kv_offloading_backend, args.kv_offloading_size,
                           args.kv_offloading_path, model.device)
    if kv is None:
        return None
    check_kv_transfer_engine(parallel.world_size, pooling, cache.enable_prefix_caching)
    if draft is not None:      # its cache is filled by the proposer's passes, which a stored block does not track
        raise ValueError("kv_transfer_config: the KV connector runs without a speculative draft model or EAGLE "
                         "head for now (ngram speculation works)")
    return dataclasses.replace(kv, namespace=kv_namespace(model, draft, speculative, cache, parallel))
