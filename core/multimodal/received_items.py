"""The core's side of the processed-item mirror (ipc/mm_mirror.py): one ItemMirror per client, applied to
every request as it comes off the socket, before anything may refuse it, so that the core takes in each item
exactly when the client counted it as sent."""
from __future__ import annotations

from collections.abc import Collection

import msgspec

from pagedserve.common.errors import RequestError
from pagedserve.ipc.messages import EngineCoreRequest
from pagedserve.ipc.mm_mirror import MISSING_ITEM, ItemMirror


class ReceivedItems:
    def __init__(self, cache_gb: float) -> None:
        self.cache_gb = cache_gb
        self._mirrors: dict[bytes, ItemMirror] = {}

    def take(self, client: bytes, req: EngineCoreRequest, live_clients: Collection[bytes]) -> EngineCoreRequest:
        """The request with every item's tensors; RequestError naming the first item it sent bare that this
        client's mirror lacks (the mirror then starts over, as the client's does when it sees the refusal)."""
        if not req.mm_features or self.cache_gb <= 0:
            return req
        mirror = self._mirrors.get(client)
        if mirror is None:
            for gone in [c for c in self._mirrors if c not in live_clients]:   # expired clients' copies
                del self._mirrors[gone]
            mirror = self._mirrors[client] = ItemMirror.of_gb(self.cache_gb, keep_data=True)
        features, missing = mirror.fill(req.mm_features)
        if missing is not None:
            mirror.clear()
            raise RequestError.at(f"mm_features[{missing}].data", MISSING_ITEM)
        return msgspec.structs.replace(req, mm_features=features)
