"""Speculative methods eagle and eagle3: EAGLE heads loaded from checkpoints laid out as the published ones.

The oracle for the drafts: HF transformers runs the model over the whole sequence so far (its hidden states:
the final one for EAGLE-1, the residual streams entering three layers for EAGLE-3), and a dense re-implementation
of the head here, with HF's rotary embedding, drafts k tokens from scratch. After every engine step the
request's proposals must equal it, across chunked prefill, accepted and rejected drafts. Greedy output with
a head must equal the output without one.
"""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from pagedserve import LLM, SamplingParams
from pagedserve.common.config.engine_args import EngineArgs
from pagedserve.core.engine_core import EngineCore
from pagedserve.executor.procs.uniproc_executor import UniProcExecutor
from pagedserve.ipc.messages import EngineCoreRequest
from pagedserve.tests.helpers.spec_costs import FixedStepCosts
from pagedserve.tests.helpers.models.tiny_models import make_tiny_eagle_head, make_tiny_model, random_prompts

K = 3


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> str:
    # Eight layers: EAGLE-3 reads layers 2, 4 and 5.
    return make_tiny_model(str(tmp_path_factory.mktemp("eagle_target")), arch="llama", tokenizer="synthetic",
                           num_hidden_layers=8)


@pytest.fixture(scope="module")
def bigram_dir(tmp_path_factory) -> str:
    """A model whose next token depends on the current one alone (attention and MLP outputs zeroed, final norm
    weight one): an EAGLE-1 head that reads the next token's embedding drafts it exactly (see head_dir)."""
    from safetensors.torch import save_file
    path = make_tiny_model(str(tmp_path_factory.mktemp("bigram_target")), arch="llama", tokenizer="synthetic",
                           num_hidden_layers=8, seed=3)
    file = os.path.join(path, "model.safetensors")
    w = load_file(file)
    for name in w:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            w[name] = torch.zeros_like(w[name])
    w["model.norm.weight"] = torch.ones_like(w["model.norm.weight"])
    save_file(w, file, metadata={"format": "pt"})
    return path


def head_dir(tmp_path_factory, target: str, method: str, predictive: bool = False) -> str:
    """A random head; predictive (EAGLE-1, for bigram_dir): fc passes the next token's embedding through and
    the layer adds a little, so the LM head reads ~that embedding and drafts the bigram's next token, mostly."""
    path = make_tiny_eagle_head(str(tmp_path_factory.mktemp(f"{method}_head")), target, method,
                                draft_vocab_size=300 if method == "eagle3" else None)
    if predictive:
        from safetensors.torch import save_file
        file = os.path.join(path, "model.safetensors")
        w = load_file(file)
        h = w["fc.weight"].shape[0]
        w["fc.weight"] = torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1) + 0.05 * w["fc.weight"]
        for name in ("layers.0.self_attn.o_proj.weight", "layers.0.mlp.down_proj.weight"):
            w[name] = 0.1 * w[name]
        save_file(w, file)
    return path


# ---------------------------------------------------------------- the dense reference

def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


class ReferenceHead:
    def __init__(self, path: str, method: str, target) -> None:
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
        self.method = method
        self.cfg = LlamaConfig.from_pretrained(path)
        self.w = {k: v.double() if v.is_floating_point() else v for k, v in load_file(os.path.join(path, "model.safetensors")).items()}
        self.target = target
        self.rope = LlamaRotaryEmbedding(self.cfg)
        self.embed = target.model.embed_tokens.weight.double()
        self.lm_head = self.w["lm_head.weight"] if method == "eagle3" else target.lm_head.weight.double()
        self.prefix = "midlayer." if method == "eagle3" else "layers.0."
        n = target.config.num_hidden_layers
        self.aux = [2, n // 2, n - 3]

    def features(self, tokens: list[int]) -> torch.Tensor:
        with torch.no_grad():
            out = self.target(torch.tensor([tokens]), output_hidden_states=True)
        states = out.hidden_states
        if self.method == "eagle":
            return states[-1][0].double()
        return torch.cat([states[i][0] for i in self.aux], dim=-1).double() @ self.w["fc.weight"].T

    def _attention(self, x: torch.Tensor) -> torch.Tensor:
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
        cfg, p, w = self.cfg, self.prefix, self.w
        heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
        hd = cfg.hidden_size // heads
        m = x.shape[0]
        q = (x @ w[p + "self_attn.q_proj.weight"].T).view(m, heads, hd).transpose(0, 1)[None]
        k = (x @ w[p + "self_attn.k_proj.weight"].T).view(m, kv, hd).transpose(0, 1)[None]
        v = (x @ w[p + "self_attn.v_proj.weight"].T).view(m, kv, hd).transpose(0, 1)[None]
        cos, sin = self.rope(q.float(), torch.arange(m)[None])
        q, k = apply_rotary_pos_emb(q, k, cos.double(), sin.double())
        k, v = (t.repeat_interleave(heads // kv, dim=1) for t in (k, v))
        scores = (q @ k.transpose(-1, -2)) / hd ** 0.5
        scores = scores.masked_fill(torch.triu(torch.ones(m, m, dtype=torch.bool), 1), float("-inf"))
        o = (scores.softmax(-1) @ v)[0].transpose(0, 1).reshape(m, heads * hd)
        return o @ w[p + "self_attn.o_proj.weight"].T

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        p, w = self.prefix, self.w
        gate, up = x @ w[p + "mlp.gate_proj.weight"].T, x @ w[p + "mlp.up_proj.weight"].T
        return (torch.nn.functional.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T

    def forward(self, ids: list[int], feats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions 0..len(ids)-1 -> (logits' input, next feature) at each."""
        w, p, eps = self.w, self.prefix, self.cfg.rms_norm_eps
        e = self.embed[torch.tensor(ids)]
        if self.method == "eagle":
            x = torch.cat([e, feats], dim=-1) @ w["fc.weight"].T
            h = self._attention(x) + x
            out = self._mlp(_rms(h, w[p + "post_attention_layernorm.weight"], eps)) + h
            return out, out
        x = torch.cat([_rms(e, w[p + "input_layernorm.weight"], eps), _rms(feats, w[p + "hidden_norm.weight"], eps)], -1)
        h = self._attention(x) + feats
        pre = self._mlp(_rms(h, w[p + "post_attention_layernorm.weight"], eps)) + h
        return _rms(pre, w["norm.weight"], eps), pre

    def drafts(self, tokens: list[int], k: int) -> list[int]:
        feats = self.features(tokens)[:-1]      # position j reads token j+1 and the feature at j
        ids = list(tokens[1:])
        out = []
        for _ in range(k):
            normed, carry = self.forward(ids, feats)
            token = int((normed[-1] @ self.lm_head.T).argmax())
            if self.method == "eagle3":
                token += int(self.w["d2t"][token])
            out.append(token)
            ids.append(token)
            feats = torch.cat([feats, carry[-1:]])
        return out


# ---------------------------------------------------------------- tests

def make_core(target: str, head: str, method: str, **kw) -> EngineCore:
    args = EngineArgs(model=target, dtype="float32", device="cpu", block_size=4, max_model_len=256,
                      max_num_batched_tokens=16, generation_config="vllm",
                      speculative_config={"method": method, "model": head, "num_speculative_tokens": K,
                                          "disable_by_batch_size": 8}, **kw)
    return EngineCore.from_engine_args(args, UniProcExecutor)


CASES = [("eagle", False), ("eagle", True), ("eagle3", False)]


@pytest.mark.parametrize("method,predictive", CASES, ids=["eagle", "eagle-predictive", "eagle3"])
def test_drafts_equal_the_dense_reference_every_step(tmp_path_factory, target_dir, bigram_dir, method, predictive):
    from transformers import AutoModelForCausalLM
    target = bigram_dir if predictive else target_dir
    head = head_dir(tmp_path_factory, target, method, predictive)
    ref = ReferenceHead(head, method, AutoModelForCausalLM.from_pretrained(target, dtype=torch.float64).eval())
    core = make_core(target, head, method)
    core.scheduler.spec.cost = FixedStepCosts()             # verify every draft that may be accepted, however fast
    prompt = random_prompts(4, [37], 512)[0]                # three prefill chunks of 16
    core.add_request(EngineCoreRequest("r", prompt, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
                                       arrival_time=0.0))
    checked = full = 0
    while core.has_unfinished_requests():
        core.step()
        request = core.scheduler.requests.get("r")
        if request is None or not request.spec_token_ids:
            continue
        # as many as the core asked for (at most K; fewer near max_tokens), each the reference's
        assert request.spec_token_ids == ref.drafts(request.all_token_ids, K)[:len(request.spec_token_ids)], \
            f"after {request.num_output_tokens}"
        full += len(request.spec_token_ids) == K
        checked += 1
    assert checked >= 8 and full >= 5
    spec = core.scheduler.spec
    if predictive:      # drafts accepted in part and in full were part of the check
        assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens, (spec.num_accepted_tokens, spec.num_draft_tokens)


def test_eagle_head_follows_a_weight_update_of_the_model(tmp_path_factory, target_dir):
    """An EAGLE-1 head without its own embedding reads the model's embedding, LM head and hidden states: after
    reload_weights to another checkpoint its drafts are the reference's over that checkpoint, every step."""
    from transformers import AutoModelForCausalLM
    other = make_tiny_model(str(tmp_path_factory.mktemp("eagle_other")), arch="llama", tokenizer="synthetic",
                            num_hidden_layers=8, seed=7)
    head = head_dir(tmp_path_factory, target_dir, "eagle")
    core = make_core(target_dir, head, "eagle")
    drafter, model = core.executor.worker.runner.drafter.model, core.executor.worker.runner.model
    assert drafter.embed_tokens is model.model.embed_tokens and drafter.lm_head is model.lm_head   # shared modules
    core.call_utility("reload_weights", (other,))
    ref, stale = (ReferenceHead(head, "eagle", AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval())
                  for path in (other, target_dir))
    prompt = random_prompts(6, [21], 512)[0]
    core.add_request(EngineCoreRequest("r", prompt, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
                                       arrival_time=0.0))
    checked = differs = 0
    while core.has_unfinished_requests():
        core.step()
        request = core.scheduler.requests.get("r")
        if request is not None and request.spec_token_ids:
            n = len(request.spec_token_ids)             # as many as the core asked for
            assert request.spec_token_ids == ref.drafts(request.all_token_ids, K)[:n], \
                f"after {request.num_output_tokens}"
            checked += 1
            differs += request.spec_token_ids != stale.drafts(request.all_token_ids, K)[:n]
    assert checked >= 3 and differs > 0          # a head on the old weights would have drafted otherwise


@pytest.mark.parametrize("method,tp", [("eagle", 1), ("eagle3", 1), ("eagle", 2), ("eagle3", 2)])
def test_greedy_output_unchanged_by_a_head(tmp_path_factory, bigram_dir, target_dir, method, tp):
    """TP = 2: a worker process per rank (the head's config, with its aux layers set at start, crosses to them);
    the head is sharded over the ranks like the model (draft_tensor_parallel_size defaults to its TP size)."""
    target = bigram_dir if method == "eagle" else target_dir
    head = head_dir(tmp_path_factory, target, method, predictive=method == "eagle")
    prompts = random_prompts(5, [9, 40, 17, 70, 3], 512)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(target, dtype="float32").generate(prompts, params, use_tqdm=False)]
    llm = LLM(target, dtype="float32", max_num_batched_tokens=32, tensor_parallel_size=tp,
              speculative_config={
        "method": method, "model": head, "num_speculative_tokens": K, "disable_by_batch_size": 8})
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == want
    assert llm.engine.scheduler.spec.num_drafts > 0
    assert llm.engine.kv_cache_manager.num_free_blocks == llm.engine.num_blocks
    llm.shutdown()


def test_head_config_refusals(tmp_path_factory, target_dir):
    head = head_dir(tmp_path_factory, target_dir, "eagle")
    cfg = json.load(open(os.path.join(head, "config.json")))
    wide = str(tmp_path_factory.mktemp("wide_head"))
    with open(os.path.join(wide, "config.json"), "w") as f:
        json.dump({**cfg, "hidden_size": 2 * cfg["hidden_size"]}, f)
    with pytest.raises(ValueError, match="hidden_size"):
        EngineArgs(model=target_dir, speculative_config={"method": "eagle", "model": wide,
                                                         "num_speculative_tokens": 2}).create_engine_config()
    with pytest.raises(ValueError, match="speculative_config.model .*required"):
        EngineArgs(model=target_dir,
                   speculative_config={"method": "eagle3", "num_speculative_tokens": 2}).create_engine_config()
    # EAGLE-3 reads target layers 2, L/2 and L-3: a two-layer model has none of them.
    two = make_tiny_model(str(tmp_path_factory.mktemp("two_layers")), arch="llama", tokenizer="synthetic")
    head3 = head_dir(tmp_path_factory, two, "eagle3")
    with pytest.raises(ValueError, match="EAGLE-3 reads target layers"):
        EngineArgs(model=two, speculative_config={"method": "eagle3", "model": head3,
                                                  "num_speculative_tokens": 2}).create_engine_config()
