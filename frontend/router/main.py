"""`pagedserve router --backend URL [--backend URL ...]`: the fleet router (docs/router.md)."""
from __future__ import annotations

from pagedserve.frontend.http.app_command import AppCommand
from pagedserve.frontend.router.args import RouterArgs

COMMAND = AppCommand(RouterArgs, "pagedserve.frontend.router.app:build_router_app")
