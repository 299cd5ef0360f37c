"""The adapters a server serves by name (vLLM's shapes): `--lora-modules` at start, `POST /v1/load_lora_adapter`
and `/v1/unload_lora_adapter` at runtime, a request's `model` choosing one, `/v1/models` listing them.

The engine core checks and holds the adapters (core/lora/registry.py); this table only maps names to the ids it
gave them. A load the core refuses is a 400 with its reason, and nothing else changes.
"""
from __future__ import annotations

import itertools
import json
from typing import Any

import msgspec

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

from pagedserve.common import envs
from pagedserve.common.errors import RequestError
from pagedserve.common.lora import LORA_LOAD_TIMEOUT_S
from pagedserve.frontend.http.errors import ModelNotFoundError


class LoRAModule(msgspec.Struct, frozen=True):
    """One --lora-modules entry: `name=path`, or vLLM's JSON form with an optional base_model_name."""
    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_modules(values: tuple[str, ...]) -> list[LoRAModule]:
    """ValueError naming --lora-modules for an entry of neither form, or a name given twice."""
    modules = []
    for value in values:
        if value.lstrip().startswith("{"):
            try:
                module = msgspec.convert(json.loads(value), LoRAModule)
            except (ValueError, msgspec.ValidationError) as exc:
                raise ValueError(f"--lora-modules {value!r}: not a JSON object with name and path ({exc})") from None
        else:
            name, sep, path = value.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"--lora-modules {value!r}: expected name=path or a JSON object")
            module = LoRAModule(name, path)
        modules.append(module)
    names = [m.name for m in modules]
    if len(set(names)) != len(names):
        raise ValueError(f"--lora-modules names an adapter twice: {names}")
    return modules


class LoRANotFoundError(ModelNotFoundError):
    pass


class LoRAModels:
    def __init__(self, engine: Any, base_name: str) -> None:
        self.engine = engine
        self.base_name = base_name
        self.adapters: dict[str, tuple[int, LoRAModule]] = {}
        self._ids = itertools.count(1)

    async def load(self, module: LoRAModule) -> None:
        """RequestError (HTTP 400) with the reason when the name is taken or the core refuses the adapter."""
        if module.name == self.base_name or module.name in self.adapters:
            raise RequestError("lora_name", f"The lora adapter '{module.name}' has already been loaded.")
        int_id = next(self._ids)
        try:
            await self.engine.call_utility("add_lora", module.name, int_id, module.path, timeout_s=LORA_LOAD_TIMEOUT_S)
        except ValueError as exc:
            raise RequestError("lora_path", f"Failed to load LoRA adapter '{module.name}': {exc}") from None
        self.adapters[module.name] = (int_id, module)

    async def unload(self, name: str) -> None:
        if name not in self.adapters:
            raise LoRANotFoundError(f"The lora adapter '{name}' cannot be found.")
        int_id, _ = self.adapters.pop(name)
        await self.engine.call_utility("remove_lora", int_id)

    def lora_id(self, model: str | None) -> int | None:
        """The adapter id a request's `model` names (0: the base model), or None for a name served here not at all."""
        if model is None or model == self.base_name:
            return 0
        found = self.adapters.get(model)
        return found[0] if found is not None else None

    def cards(self) -> list[tuple[str, str, str]]:
        """(id, root, parent) of each adapter, for /v1/models."""
        return [(name, module.path, module.base_model_name or self.base_name)
                for name, (_, module) in self.adapters.items()]


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_int_id: int | None = None        # vLLM's field; adapters are found by name here


def add_lora_routes(app: FastAPI, loras: LoRAModels, allow_runtime: bool) -> None:
    """The runtime routes, which exist only when allowed, as in vLLM (--lora-modules load in the app's
    lifespan: api_server.build_app)."""
    if not (allow_runtime or envs.VLLM_ALLOW_RUNTIME_LORA_UPDATING):
        return

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> PlainTextResponse:
        await loras.load(LoRAModule(body.lora_name, body.lora_path))
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> PlainTextResponse:
        await loras.unload(body.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
