"""Quantization methods: what `--quantization` may say, what a checkpoint's `quantization_config` says, and
which of the two is used (vLLM's rule: the checkpoint's own method unless the flag names another)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# The CLI values; the flag left unset (None) means "whatever the checkpoint is".
QUANTIZATION_CHOICES = ("none", "gguf", "int8", "fp8", "awq", "gptq")
# Methods a checkpoint's quantization_config may name (the others are applied at load or are file formats).
CHECKPOINT_METHODS = ("awq", "gptq", "fp8")
_SPEC_METHODS = ("gguf", "int8", "fp8", "awq", "gptq")
# Methods whose weights run in the weight-only int4/int8 kernels (kernels/weights/weight_only.py).
WEIGHT_ONLY_METHODS = ("gguf", "int8", "awq", "gptq")
_BITS = {"awq": (4,), "gptq": (4, 8), "int8": (8,), "fp8": (8,)}
_GPTQ_FORMATS = ("gptq", "gptq_v2")


@dataclass(frozen=True)
class QuantSpec:
    """How a model's linear weights are (or are to be) quantized.

    group_size: weights sharing one scale/zero along the input dimension; -1 is one group per output row
    (per-channel), GPTQ's own convention. For "gguf" bits/group_size mean nothing: each tensor says its type.
    """
    method: str
    bits: int = 4
    group_size: int = 128
    zero_point: bool = True
    desc_act: bool = False
    sym: bool = True
    checkpoint_format: str = "gptq"                 # gptq: "gptq" stores zero - 1, "gptq_v2" stores zero
    activation_scheme: str = "dynamic"              # fp8 checkpoints: "dynamic" | "static" input scales
    weight_block_size: tuple[int, int] | None = None  # fp8 checkpoints: [out, in] blocks sharing a scale
    modules_to_not_convert: tuple[str, ...] = ()    # module names the checkpoint left unquantized

    def __post_init__(self) -> None:
        if self.method not in _SPEC_METHODS:
            raise ValueError(f"quantization method must be one of {', '.join(_SPEC_METHODS)}, got {self.method!r}")
        if self.method in _BITS and self.bits not in _BITS[self.method]:
            raise ValueError(f"{self.method} bits must be one of {_BITS[self.method]}, got {self.bits}")
        if self.group_size != -1 and self.group_size <= 0:
            raise ValueError(f"{self.method} group_size must be positive or -1 (per channel), got {self.group_size}")
        if self.checkpoint_format not in _GPTQ_FORMATS:
            raise ValueError(f"gptq checkpoint_format must be one of {_GPTQ_FORMATS}, got {self.checkpoint_format!r}")
        if self.activation_scheme not in ("dynamic", "static"):
            raise ValueError(f"fp8 activation_scheme must be 'dynamic' or 'static', got {self.activation_scheme!r}")

    def is_quantized_module(self, module_name: str) -> bool:
        """False for a module the checkpoint kept in float (`modules_to_not_convert`, e.g. lm_head)."""
        return not any(skip in module_name for skip in self.modules_to_not_convert)


def _as_dict(config: Any) -> dict[str, Any]:
    if isinstance(config, dict):
        return config
    if hasattr(config, "to_dict"):
        return config.to_dict()
    return dict(vars(config))


def _pick(cfg: dict[str, Any], keys: tuple[str, ...], default: Any) -> Any:
    """The first of `keys` present and not None (checkpoint writers disagree on names, e.g. w_bit / bits)."""
    for key in keys:
        if cfg.get(key) is not None:
            return cfg[key]
    return default


def _method_name(value: Any) -> str:
    # transformers' QuantizationMethod is a str Enum: its value is the name written to config.json.
    return str(getattr(value, "value", value)).lower()


def checkpoint_quant_spec(hf_config: Any) -> QuantSpec | None:
    """The QuantSpec a checkpoint's `quantization_config` (dict or transformers object) describes, or None."""
    raw = getattr(hf_config, "quantization_config", None)
    if raw is None and isinstance(hf_config, dict):
        raw = hf_config.get("quantization_config")
    if raw is None:
        return None
    cfg = _as_dict(raw)
    method = _method_name(cfg.get("quant_method"))
    skip = tuple(_pick(cfg, ("modules_to_not_convert",), None) or ())
    if method == "awq":
        return _awq_spec(cfg, skip)
    if method == "gptq":
        return _gptq_spec(cfg, skip)
    if method == "fp8":
        return _fp8_spec(cfg, skip)
    raise ValueError(f"checkpoint quantization_config.quant_method {method!r} is not supported "
                     f"(supported: {', '.join(CHECKPOINT_METHODS)})")


def _awq_spec(cfg: dict[str, Any], skip: tuple[str, ...]) -> QuantSpec:
    version = str(_pick(cfg, ("version", "format"), "gemm")).lower()
    if version != "gemm":
        raise ValueError(f"awq quantization_config.version {version!r} is not supported (only 'gemm')")
    zero_point = bool(_pick(cfg, ("zero_point",), True))
    if not zero_point:
        raise ValueError("awq quantization_config.zero_point false is not supported (only zero_point true)")
    return QuantSpec("awq", bits=int(_pick(cfg, ("bits", "w_bit"), 4)),
                     group_size=int(_pick(cfg, ("group_size", "q_group_size"), 128)), zero_point=True,
                     modules_to_not_convert=skip)


def _gptq_spec(cfg: dict[str, Any], skip: tuple[str, ...]) -> QuantSpec:
    if cfg.get("dynamic"):
        # GPTQModel's per-module overrides (other bits / group sizes, skipped modules) would decode wrongly.
        raise ValueError("gptq quantization_config.dynamic (per-module overrides) is not supported")
    fmt = str(_pick(cfg, ("checkpoint_format", "format"), "gptq")).lower()
    if fmt not in _GPTQ_FORMATS:
        raise ValueError(f"gptq quantization_config.checkpoint_format {fmt!r} is not supported "
                         f"(supported: {', '.join(_GPTQ_FORMATS)})")
    return QuantSpec("gptq", bits=int(_pick(cfg, ("bits",), 4)), group_size=int(_pick(cfg, ("group_size",), 128)),
                     desc_act=bool(_pick(cfg, ("desc_act",), False)), sym=bool(_pick(cfg, ("sym",), True)),
                     checkpoint_format=fmt, modules_to_not_convert=skip)


def _fp8_spec(cfg: dict[str, Any], skip: tuple[str, ...]) -> QuantSpec:
    block = cfg.get("weight_block_size")
    if block is not None and len(block) != 2:
        raise ValueError(f"fp8 quantization_config.weight_block_size must be [out, in], got {block!r}")
    return QuantSpec("fp8", bits=8, group_size=-1, zero_point=False,
                     activation_scheme=str(_pick(cfg, ("activation_scheme",), "dynamic")),
                     weight_block_size=tuple(int(b) for b in block) if block is not None else None,
                     modules_to_not_convert=skip)


def resolve_quantization(requested: str | None, checkpoint: QuantSpec | None, is_gguf: bool) -> QuantSpec | None:
    """The quantization to run with, or None for plain float weights.

    - unset: the checkpoint's own method (GGUF files: "gguf", their blocks kept quantized);
    - a flag naming the checkpoint's own method: the checkpoint's spec; one naming another: ValueError;
    - "int8" / "fp8" on a float checkpoint or a GGUF file: quantized at load (per output channel);
    - "none": on a GGUF file the blocks are dequantized at load (our extension); on a float checkpoint,
      nothing to do.
    """
    if requested is not None and requested not in QUANTIZATION_CHOICES:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_CHOICES)}, got {requested!r}")
    if checkpoint is not None:
        if requested is None or requested == checkpoint.method:
            return checkpoint
        raise ValueError(f"quantization {requested!r} contradicts the checkpoint's quantization_config "
                         f"({checkpoint.method!r}): leave --quantization unset or pass {checkpoint.method!r}")
    if requested in ("int8", "fp8"):
        return _load_time_spec(requested)
    if is_gguf:
        if requested in (None, "gguf"):
            return QuantSpec("gguf")
        if requested == "none":
            return None
        raise ValueError(f"quantization {requested!r} needs a {requested.upper()} checkpoint, not a GGUF file")
    if requested in (None, "none"):
        return None
    if requested == "gguf":
        raise ValueError("quantization 'gguf' needs a .gguf model file")
    raise ValueError(f"quantization {requested!r} needs a checkpoint quantized with it, but this one has no "
                     f"quantization_config (int8 and fp8 quantize a float checkpoint at load)")


def _load_time_spec(method: str) -> QuantSpec:
    # Weight-only per-output-channel scales, symmetric: what the int8 CPU op and _scaled_mm take.
    return QuantSpec(method, bits=8, group_size=-1, zero_point=False, sym=True)
