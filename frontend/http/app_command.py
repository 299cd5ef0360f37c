"""A `pagedserve` subcommand that serves one HTTP app built from one frozen settings dataclass (the router,
the disaggregation proxy): its flags come from the dataclass's fields, a setting it cannot start with is a
usage error naming the flag, and the app runs under uvicorn on uvloop."""
from __future__ import annotations

import argparse
import importlib
import logging
from dataclasses import dataclass
from typing import Any

from pagedserve.common.config.arg_utils import add_dataclass_args, dataclass_from


@dataclass(frozen=True)
class AppCommand:
    settings_cls: type            # a frozen dataclass with host, port and log_level among its fields
    app_factory: str              # "module:function": settings -> ASGI app, imported only when the command runs

    def add_cli_args(self, parser: argparse.ArgumentParser) -> None:
        add_dataclass_args(parser, self.settings_cls)

    def check_args(self, args: argparse.Namespace) -> None:
        """ValueError naming the flag for settings the app cannot start with."""
        dataclass_from(args, self.settings_cls)

    def main(self, args: argparse.Namespace) -> None:
        import uvicorn

        settings: Any = dataclass_from(args, self.settings_cls)
        module, function = self.app_factory.split(":")
        build = getattr(importlib.import_module(module), function)
        logging.basicConfig(level=getattr(logging, settings.log_level.upper()),
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        uvicorn.run(build(settings), host=settings.host, port=settings.port, log_level=settings.log_level,
                    loop="uvloop", timeout_graceful_shutdown=10)
