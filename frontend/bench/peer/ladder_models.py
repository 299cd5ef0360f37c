"""The model ladder of `pagedserve bench ladder` (issue 25): SmolLM2-shaped Llama models with random weights,
written as HF folders, converted to bf16 GGUF by llama.cpp's own convert_hf_to_gguf.py and quantized by its
llama-quantize, so both engines read files made exactly as a user's would be. Also the machine's read
bandwidth and a file's weight bytes, which give the decode floor the benchmark compares against, and the
per-size workloads and their SIZE=VALUE flags. The report drawn from the results lines is ladder_report.py.

Files: CACHE/SIZE/hf/ -> CACHE/SIZE/SIZE-bf16.gguf -> CACHE/SIZE/SIZE-FMT.gguf. A step whose output exists
is skipped; every output is written under a temporary name and renamed when complete, so an interrupted
build is redone rather than trusted. The HF folder is deleted once its bf16 GGUF exists (disk).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from typing import Any

# SmolLM2's shapes (HF config.json of SmolLM2-135M/360M/1.7B); `tiny` is for smoke checks only.
SIZES: dict[str, dict[str, int]] = {
    "tiny": dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=512),
    "135m": dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                 intermediate_size=1536),
    "360m": dict(hidden_size=960, num_hidden_layers=32, num_attention_heads=15, num_key_value_heads=5,
                 intermediate_size=2560),
    "1.7b": dict(hidden_size=2048, num_hidden_layers=24, num_attention_heads=32, num_key_value_heads=32,
                 intermediate_size=8192),
}
DEFAULT_SIZES = ("135m", "360m", "1.7b")
# Shared by every size, as in SmolLM2's configs.
COMMON: dict[str, Any] = dict(vocab_size=49152, tie_word_embeddings=True, rms_norm_eps=1e-5, rope_theta=100000.0,
                              max_position_embeddings=8192, initializer_range=0.02, bos_token_id=1, eos_token_id=2)
# llama-quantize type names this benchmark accepts (pagedserve's loader decodes what they produce).
FORMATS = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K_M", "Q4_K_S", "Q5_K_M", "Q6_K")
DEFAULT_FORMATS = ("Q4_0", "Q8_0", "Q4_K_M")

GIB = 2**30


def gguf_path(cache: str, size: str, fmt: str) -> str:
    return os.path.join(cache, size, f"{size}-{fmt}.gguf")


def _log(msg: str) -> None:
    print(f"bench ladder: {msg}", file=sys.stderr, flush=True)


def make_hf(folder: str, size: str) -> None:
    """The random-weight bf16 HF folder of `size` (seed 0), with SmolLM2's tokenizer (the embedded model's:
    the converter reads it, and both engines take the same vocabulary)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from pagedserve.common.model.model_files import resolve_model, tokenizer_folder
    from pagedserve.frontend.client.tokenizer import load_tokenizer
    part = folder + ".part"
    shutil.rmtree(part, ignore_errors=True)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**COMMON, **SIZES[size]), dtype=torch.bfloat16)
    model.save_pretrained(part)
    load_tokenizer(tokenizer_folder(resolve_model(None))).save_pretrained(part)
    os.replace(part, folder)


def llama_tools(llama_server: str) -> tuple[str, str]:
    """(llama-quantize, llama.cpp's source folder) of build_llama_server.sh's build whose llama-server this is:
    the quantizer lies beside it and the converter in the sources the binaries were built from."""
    bin_dir = os.path.dirname(llama_server)
    return os.path.join(bin_dir, "llama-quantize"), os.path.join(bin_dir, "..", "..", "src")


def convert_bf16(src: str, hf: str, out: str) -> None:
    """llama.cpp's convert_hf_to_gguf.py from the same sources as the binaries (src: their CACHE/src)."""
    part = out + ".part"
    env = {**os.environ, "PYTHONPATH": os.path.join(src, "gguf-py")}
    cmd = [sys.executable, os.path.join(src, "convert_hf_to_gguf.py"), hf, "--outtype", "bf16", "--outfile", part]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode or not os.path.isfile(part):
        raise RuntimeError(f"convert_hf_to_gguf.py failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    os.replace(part, out)


def quantize(binary: str, src: str, out: str, fmt: str, threads: int) -> None:
    part = out + ".part"
    proc = subprocess.run([binary, src, part, fmt, str(threads)], capture_output=True, text=True)
    if proc.returncode or not os.path.isfile(part):
        raise RuntimeError(f"llama-quantize {fmt} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    os.replace(part, out)


def build(cache: str, size: str, formats: list[str], quantize_bin: str, llama_src: str, threads: int) -> dict[str, str]:
    """Makes what is missing of `size`'s files; {format: path}."""
    folder = os.path.join(cache, size)
    os.makedirs(folder, exist_ok=True)
    bf16 = gguf_path(cache, size, "bf16")
    wanted = {fmt: gguf_path(cache, size, fmt) for fmt in formats}
    if not os.path.isfile(bf16) and not all(os.path.isfile(p) for p in wanted.values()):
        hf = os.path.join(folder, "hf")
        if not os.path.isdir(hf):
            _timed(f"{size}: random HF weights", make_hf, hf, size)
        _timed(f"{size}: bf16 GGUF", convert_bf16, llama_src, hf, bf16)
    if os.path.isfile(bf16):
        shutil.rmtree(os.path.join(folder, "hf"), ignore_errors=True)
    for fmt, path in wanted.items():
        if not os.path.isfile(path):
            _timed(f"{size}: {fmt}", quantize, quantize_bin, bf16, path, fmt, threads)
    return wanted


def _timed(what: str, fn: Any, *args: Any) -> None:
    start = time.perf_counter()
    fn(*args)
    _log(f"built {what} in {time.perf_counter() - start:.0f} s")


def gguf_weight_bytes(path: str) -> int:
    """Bytes of every tensor as stored (quantized blocks included): what one decode step reads at least,
    since the tied embedding doubles as the output projection that every step reads whole."""
    from pagedserve.common.model.gguf_metadata import gguf_reader
    return int(sum(int(t.n_bytes) for t in gguf_reader(path).tensors))


def gguf_tensor_types(path: str) -> dict[str, int]:
    """How many tensors of each stored type (llama-quantize falls back for widths it cannot block)."""
    from pagedserve.common.model.gguf_metadata import gguf_reader
    counts: dict[str, int] = {}
    for t in gguf_reader(path).tensors:
        counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
    return counts


# Timed in its own process so OMP_NUM_THREADS applies, as it does to the pagedserve child.
_BANDWIDTH_CODE = """
import json, time, torch
x = torch.rand(2**28, dtype=torch.float32)      # distinct pages: a constant fill could be deduplicated
best = float("inf")
for _ in range(5):
    start = time.perf_counter()
    x.sum()
    best = min(best, time.perf_counter() - start)
print(json.dumps({"bytes": x.numel() * 4, "seconds": best, "threads": torch.get_num_threads()}))
"""


def measure_bandwidth(threads: int) -> dict[str, float]:
    """Read bandwidth in GiB/s: 1 GiB of float32 summed, best of 5, on `threads` threads."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    proc = subprocess.run([sys.executable, "-c", _BANDWIDTH_CODE], capture_output=True, text=True, env=env)
    if proc.returncode:
        raise RuntimeError(f"bandwidth probe failed:\n{proc.stderr[-2000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"bandwidth_gib_s": out["bytes"] / GIB / out["seconds"], "bandwidth_threads": out["threads"]}


def bound_ms(weight_bytes: int, bandwidth_gib_s: float) -> float:
    """The decode floor: ms to read every weight once at the measured bandwidth."""
    return weight_bytes / (bandwidth_gib_s * GIB) * 1e3


def bound_fraction(bound: float, s1_ms: float) -> float | None:
    """Share of the floor an engine reaches (1.0: at the floor); None for a time that is not positive."""
    return bound / s1_ms if s1_ms > 0 else None


# Per-size workloads: W1 requests offline, and bench serve's prompts and rates (slower models get fewer
# requests and lower rates, so every run ends in minutes and the server is not simply saturated).
NUM_REQUESTS = {"tiny": 4, "135m": 64, "360m": 64, "1.7b": 16}
SERVE_PROMPTS = {"tiny": 4, "135m": 32, "360m": 32, "1.7b": 8}
RATES = {"tiny": (2.0, 4.0), "135m": (0.5, 2.0), "360m": (0.25, 1.0), "1.7b": (0.05, 0.2)}


def parse_size_map(items: list[str], parse: Any, flag: str) -> dict[str, Any]:
    """["SIZE=VALUE", ...] -> {size: parse(VALUE)}; ValueError naming the flag and the bad item."""
    out: dict[str, Any] = {}
    for item in items:
        size, eq, value = item.partition("=")
        if not eq or size not in SIZES:
            raise ValueError(f"{flag}: {item!r} is not SIZE=VALUE with SIZE one of {', '.join(SIZES)}")
        try:
            out[size] = parse(value)
        except ValueError as exc:
            raise ValueError(f"{flag}: {item!r}: {exc}") from None
    return out


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError(f"{value} is not >= 1")
    return value


def rates(text: str) -> tuple[float, ...]:
    """"0.5,2" -> (0.5, 2.0); inf is allowed (every request at once), zero or less is not."""
    values = tuple(float(r) for r in text.split(",") if r.strip())
    if not values or any(v <= 0 for v in values):
        raise ValueError(f"rates must be > 0, got {text!r}")
    return values
