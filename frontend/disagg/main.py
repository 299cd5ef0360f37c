"""`pagedserve proxy --prefill URL --decode URL`: disaggregated prefill/decode over a shared KV folder
(docs/kv_tiers.md). Each request is prefilled on a prefill instance with max_tokens=1, whose KV reaches the
shared folder, then generated on a decode instance, which loads the prompt's KV from there."""
from __future__ import annotations

from pagedserve.frontend.disagg.args import DisaggProxyArgs
from pagedserve.frontend.http.app_command import AppCommand

COMMAND = AppCommand(DisaggProxyArgs, "pagedserve.frontend.disagg.app:build_proxy_app")
