"""Building the manager from the engine config, and the cheap checks that run in add_request."""
from __future__ import annotations

import json
from typing import Any

from pagedserve.common.config.engine_args import EngineConfig
from pagedserve.common.errors import RequestError
from pagedserve.common.model.model_files import tokenizer_folder
from pagedserve.common.params.structured_outputs import StructuredOutputsParams
from pagedserve.core.structured_output import StructuredOutputManager


def make_structured_output_manager(config: EngineConfig) -> StructuredOutputManager:
    model = config.model
    # model_files caches the folder (a GGUF vocabulary is converted once), so resolving it here is cheap
    # after the first start; the tokenizer itself loads in the pool, on the first structured request.
    return StructuredOutputManager(
        lambda: tokenizer_folder(model.source, model.tokenizer), model.vocab_size, list(model.eos_token_ids),
        config.structured_outputs)


def check_structured_outputs(params: StructuredOutputsParams) -> None:
    """What can be refused at once, before any compile: a JSON Schema that is not one (ValueError naming
    structured_outputs.json). Regexes and grammars are checked by their compile, in the pool."""
    if params.json is None:
        return
    schema: Any = json.loads(params.json) if isinstance(params.json, str) else params.json
    if not isinstance(schema, dict):
        raise RequestError("structured_outputs.json", "structured_outputs.json must be a JSON Schema object")
    try:
        import jsonschema
    except ImportError:      # optional: the compile catches what it would have
        return
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.path)
        raise RequestError("structured_outputs.json", f"structured_outputs.json is not a valid JSON Schema: "
                           f"{exc.message}" + (f" (at {where})" if where else "")) from None
