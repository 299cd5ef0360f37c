"""The KV connector's settings: --kv-transfer-config (vLLM's JSON keys) or its shorthand --kv-offloading-*,
resolved once into a frozen KVTransferConfig that travels with the EngineConfig to every process."""
from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from typing import Any

# The connectors there are (vLLM's names): OffloadingConnector moves blocks to a tier below the pool;
# SharedStorageConnector carries blocks between instances through a folder they share (disaggregated prefill:
# a kv_producer prefills, a kv_consumer decodes), looking each block up on disk, not in an index of its own.
KV_CONNECTORS = ("OffloadingConnector", "SharedStorageConnector")
# vLLM's roles: a producer only saves, a consumer only loads, kv_both does both.
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
# The tiers an OffloadingConnector may use (vLLM's --kv-offloading-backend). vLLM's "native" host tier is a
# choice so that asking for it gets its reason (_refuse_native), not argparse's "invalid choice".
KV_OFFLOADING_BACKENDS = ("disk", "native")
_TOP_KEYS = ("kv_connector", "kv_role", "kv_connector_extra_config")
# kv_connector_extra_config's keys per connector (vLLM's SharedStorageConnector takes shared_storage_path).
_EXTRA_KEYS = {"OffloadingConnector": ("backend", "path", "size_gib"),
               "SharedStorageConnector": ("shared_storage_path", "size_gib")}
_GIB = 1 << 30
_PROBE_BYTES = 4096


@dataclass(frozen=True)
class KVTransferConfig:
    kv_connector: str           # one of KV_CONNECTORS
    kv_role: str                # one of KV_ROLES
    backend: str                # one of KV_OFFLOADING_BACKENDS
    path: str                   # the tier's folder, absolute; the blocks live in path/<namespace>/
    size_bytes: int | None      # least recently used blocks are deleted beyond this; None: never (shared storage)
    # Everything the KV of a block depends on besides its tokens (model files, weights, dtypes, layout):
    # common/kv_transfer/identity.py. A tier never hands one namespace's blocks to another.
    namespace: str

    @property
    def namespace_dir(self) -> str:
        return os.path.join(self.path, self.namespace)

    @property
    def shared(self) -> bool:
        """Other instances write the folder while this one runs: a lookup asks the disk, not only the index,
        and a save reaches the disk before the step's output (the request's answer) leaves the engine."""
        return self.kv_connector == "SharedStorageConnector"

    @property
    def can_load(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @property
    def can_save(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")


def parse_kv_transfer(transfer: dict[str, Any] | None, backend: str | None, size_gib: float | None,
                      path: str | None, device: str = "cpu") -> KVTransferConfig | None:
    """The connector asked for, checked (its folder exists and is writable); ValueError naming the flag. Its
    namespace is left empty: the caller fills it in once the model is resolved (identity.kv_namespace).
    device: the model's ("cpu", "cuda"), which decides what a host-memory tier would be."""
    if backend is None:
        if size_gib is not None or path is not None:
            raise ValueError("kv_offloading_size / kv_offloading_path: set --kv-offloading-backend too")
        return None if transfer is None else _from_json(transfer, device)
    if transfer is not None:
        raise ValueError("kv_offloading_backend: give it or --kv-transfer-config, not both (the backend is "
                         "shorthand for an OffloadingConnector)")
    if backend not in KV_OFFLOADING_BACKENDS:
        raise ValueError(f"kv_offloading_backend must be one of {', '.join(KV_OFFLOADING_BACKENDS)}, got {backend!r}")
    if backend == "native":
        _refuse_native("--kv-offloading-backend native", device)
    return KVTransferConfig("OffloadingConnector", "kv_both", backend, _check_folder(path, "--kv-offloading-path"),
                            _size_bytes(size_gib, "--kv-offloading-size"), namespace="")


def _from_json(transfer: dict[str, Any], device: str) -> KVTransferConfig:
    where = "kv_transfer_config"
    if not isinstance(transfer, dict):
        raise ValueError(f"{where} must be a JSON object, got {transfer!r}")
    _known_keys(transfer, _TOP_KEYS, where)
    connector = transfer.get("kv_connector")
    if connector not in KV_CONNECTORS:
        raise ValueError(f"{where}.kv_connector must be one of {', '.join(KV_CONNECTORS)}, got {connector!r}")
    role = transfer.get("kv_role", "kv_both")
    if role not in KV_ROLES:
        raise ValueError(f"{where}.kv_role must be one of {', '.join(KV_ROLES)}, got {role!r}")
    extra = transfer.get("kv_connector_extra_config") or {}
    where = f"{where}.kv_connector_extra_config"
    if not isinstance(extra, dict):
        raise ValueError(f"{where} must be a JSON object, got {extra!r}")
    _known_keys(extra, _EXTRA_KEYS[connector], where)
    if connector == "SharedStorageConnector":
        size = extra.get("size_gib")
        return KVTransferConfig(connector, role, "disk", _check_folder(extra.get("shared_storage_path"),
                                                                       f"{where}.shared_storage_path"),
                                None if size is None else _size_bytes(size, f"{where}.size_gib"), namespace="")
    backend = extra.get("backend", "disk")
    if backend not in KV_OFFLOADING_BACKENDS:
        raise ValueError(f"{where}.backend must be one of {', '.join(KV_OFFLOADING_BACKENDS)}, got {backend!r}")
    if backend == "native":
        _refuse_native(f"{where}.backend native", device)
    return KVTransferConfig(connector, role, backend, _check_folder(extra.get("path"), f"{where}.path"),
                            _size_bytes(extra.get("size_gib"), f"{where}.size_gib"), namespace="")


def _refuse_native(flag: str, device: str) -> None:
    """vLLM's host-memory tier, decided against on CPU (docs/kv_tiers.md, the host tier): there the pool
    already is host memory, so the tier would be a second copy of blocks in the same RAM, and a compact form
    (fp8, int8) would change greedy output. The same RAM given to the pool holds more blocks at no copy cost."""
    if device == "cpu":
        raise ValueError(f"{flag}: on CPU the KV cache pool already lives in host memory, so a host tier would "
                         "only copy blocks within the same RAM; give that memory to the pool instead "
                         "(a larger --kv-cache-memory), or use --kv-offloading-backend disk")
    raise ValueError(f"{flag}: the host-memory tier for {device} is not built yet; use --kv-offloading-backend "
                     "disk (docs/kv_tiers.md)")


def _known_keys(obj: dict[str, Any], allowed: tuple[str, ...], where: str) -> None:
    unknown = sorted(set(obj) - set(allowed))
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {', '.join(unknown)} (allowed: {', '.join(allowed)})")


def _size_bytes(size_gib: Any, flag: str) -> int:
    if size_gib is None:
        raise ValueError(f"{flag}: the tier's size in GiB is required")
    if isinstance(size_gib, bool) or not isinstance(size_gib, (int, float)) or not 0 < size_gib < float("inf"):
        raise ValueError(f"{flag} must be a size in GiB above 0, got {size_gib!r}")
    return int(size_gib * _GIB)


def _check_folder(path: Any, flag: str) -> str:
    """An existing folder this process can create files in: refused at start, not at the first save."""
    if not isinstance(path, str) or not path:
        raise ValueError(f"{flag}: the disk tier needs a folder")
    folder = os.path.abspath(os.path.expanduser(path))
    if not os.path.isdir(folder):
        raise ValueError(f"{flag}: {folder} does not exist or is not a folder")
    probe = None
    try:        # os.access says yes for root on a read-only bind mount: only a real file tells; an empty
        # file fits on a full disk (it takes an inode, no block), so the probe writes a page's worth
        fd, probe = tempfile.mkstemp(prefix=".pagedserve-probe-", dir=folder)
        try:
            os.write(fd, bytes(_PROBE_BYTES))
        finally:
            os.close(fd)
    except OSError as exc:
        raise ValueError(f"{flag}: {folder} is not writable (or full): {exc.strerror or exc}") from None
    finally:
        if probe is not None:
            try:
                os.unlink(probe)
            except OSError:
                pass
    return folder


def check_kv_transfer_engine(world_size: int, pooling: bool, prefix_caching: bool) -> None:
    """What this slice of the connector runs with (docs/kv_tiers.md: what is not done yet)."""
    if not prefix_caching:
        raise ValueError("kv_transfer_config: the KV connector keys blocks by their prefix hashes: it needs "
                         "enable_prefix_caching")
    if world_size > 1:
        raise ValueError("kv_transfer_config: the KV connector runs with one rank for now (tensor_parallel_size "
                         "and pipeline_parallel_size 1)")
    if pooling:
        raise ValueError("kv_transfer_config: the KV connector serves generating models (not --runner pooling)")
