"""worker_extension_cls: a user's class whose methods join the worker's, callable through collective_rpc
(vLLM's mechanism: TRL and verl put their weight-sync methods there)."""
from __future__ import annotations

import importlib
from typing import Any

import msgspec


def load_extension(qualname: str) -> type:
    """'package.module.Class' -> the class; ValueError naming the setting if it cannot be imported."""
    module_name, _, class_name = qualname.rpartition(".")
    if not module_name:
        raise ValueError(f"worker_extension_cls must be 'module.Class', got {qualname!r}")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"worker_extension_cls {qualname!r} cannot be imported: {exc}") from exc
    if not isinstance(cls, type):
        raise ValueError(f"worker_extension_cls {qualname!r} is not a class")
    return cls


def extend(worker_cls: type, qualname: str | None) -> type:
    """worker_cls itself, or a subclass that also inherits the extension (its methods win over none of the
    worker's: a name both define is refused, so an extension cannot silently replace the engine's own)."""
    if qualname is None:
        return worker_cls
    ext = load_extension(qualname)
    taken = set(dir(worker_cls)) | set(getattr(worker_cls, "RL_METHODS", ()))
    clash = sorted(n for n in public_methods(ext) if n in taken)
    if clash:
        raise ValueError(f"worker_extension_cls {qualname!r} redefines worker methods: {', '.join(clash)}")
    return type(f"{worker_cls.__name__}With{ext.__name__}", (worker_cls, ext), {"EXTENSION_METHODS":
                                                                                 public_methods(ext)})


def public_methods(cls: type) -> frozenset[str]:
    return frozenset(n for n in dir(cls) if not n.startswith("_") and callable(getattr(cls, n, None)))


def checked_result(method: str, result: Any) -> Any:
    """result as JSON-able data for the reply; ValueError naming the method if it is not (a tensor, say)."""
    try:
        return msgspec.to_builtins(result, str_keys=True)
    except (TypeError, msgspec.EncodeError) as exc:
        raise ValueError(f"collective_rpc {method!r}: its result cannot be sent back ({exc}); return JSON-able "
                         "data (numbers, strings, lists, dicts), never tensors") from None
