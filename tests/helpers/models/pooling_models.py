"""Tiny random pooling models saved as real folders (HF weights, a tokenizer, and sentence-transformers'
modules.json + 1_Pooling + 2_Normalize), for the parity tests against sentence-transformers and HF."""
from __future__ import annotations

import json
import os
from typing import Any

import torch

# A WordPiece vocabulary small enough for tiny models and big enough for English test sentences.
_WORDS = ("the a an of to in and is was for on with as by at from that this it be are or not what which who how "
          "where when why cat dog fox quick brown lazy jumps over city capital paris france berlin germany "
          "rome italy weather today sunny rain cold warm machine learning model text embedding search query "
          "document relevant answer question good bad").split()
_PIECES = [chr(c) for c in range(ord("a"), ord("z") + 1)] + [f"##{chr(c)}" for c in range(ord("a"), ord("z") + 1)]
_PUNCT = list(".,?!'-:;0123456789")


def _write_vocab(path: str, specials: list[str]) -> int:
    vocab = specials + _PUNCT + _PIECES + _WORDS
    with open(os.path.join(path, "vocab.txt"), "w") as f:
        f.write("\n".join(vocab) + "\n")
    return len(vocab)


def _bert_tokenizer(path: str, roberta: bool) -> int:
    """A BertTokenizerFast over the vocabulary above; RoBERTa's special tokens (and their ids) for XLM-R."""
    from transformers import BertTokenizerFast
    if roberta:
        specials = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
        size = _write_vocab(path, specials)
        tok = BertTokenizerFast(os.path.join(path, "vocab.txt"), cls_token="<s>", sep_token="</s>",
                                pad_token="<pad>", unk_token="<unk>", mask_token="<mask>")
    else:
        size = _write_vocab(path, ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"])
        tok = BertTokenizerFast(os.path.join(path, "vocab.txt"))
    tok.model_max_length = 512
    tok.save_pretrained(path)
    return size


def write_sentence_transformers(path: str, pooling: str, normalize: bool, dim: int) -> None:
    """modules.json (Transformer, Pooling, optionally Normalize) and 1_Pooling/config.json."""
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
        os.makedirs(os.path.join(path, "2_Normalize"), exist_ok=True)
    with open(os.path.join(path, "modules.json"), "w") as f:
        json.dump(modules, f)
    os.makedirs(os.path.join(path, "1_Pooling"), exist_ok=True)
    modes = {"cls": pooling == "CLS", "mean_tokens": pooling == "MEAN", "lasttoken": pooling == "LAST"}
    with open(os.path.join(path, "1_Pooling", "config.json"), "w") as f:
        json.dump({"word_embedding_dimension": dim, "pooling_mode_cls_token": modes["cls"],
                   "pooling_mode_mean_tokens": modes["mean_tokens"], "pooling_mode_max_tokens": False,
                   "pooling_mode_mean_sqrt_len_tokens": False, "pooling_mode_lasttoken": modes["lasttoken"],
                   "include_prompt": True}, f)
    with open(os.path.join(path, "sentence_bert_config.json"), "w") as f:
        json.dump({"max_seq_length": 512, "do_lower_case": False}, f)


def _encoder_config(arch: str, vocab: int, **overrides: Any) -> Any:
    from transformers import BertConfig, XLMRobertaConfig
    fields = {**dict(vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=64, max_position_embeddings=512, initializer_range=0.2), **overrides}
    if arch == "xlm-roberta":
        return XLMRobertaConfig(pad_token_id=1, bos_token_id=0, eos_token_id=2, type_vocab_size=1,
                                **{**fields, "max_position_embeddings": 514})
    return BertConfig(type_vocab_size=2, **fields)


def make_encoder_embedder(path: str, arch: str = "bert", pooling: str = "MEAN", normalize: bool = True,
                          seed: int = 0, **overrides: Any) -> str:
    """BertModel or XLMRobertaModel (arch "bert" | "xlm-roberta") with random weights, as a
    sentence-transformers folder."""
    from transformers import BertModel, XLMRobertaModel
    os.makedirs(path, exist_ok=True)
    vocab = _bert_tokenizer(path, roberta=arch == "xlm-roberta")
    config = _encoder_config(arch, vocab, **overrides)
    torch.manual_seed(seed)
    model = (XLMRobertaModel if arch == "xlm-roberta" else BertModel)(config).eval()
    model.save_pretrained(path)
    write_sentence_transformers(path, pooling, normalize, config.hidden_size)
    return path


def make_cross_encoder(path: str, num_labels: int = 1, seed: int = 0) -> str:
    """BertForSequenceClassification with random weights: what sentence-transformers' CrossEncoder loads."""
    from transformers import BertForSequenceClassification
    os.makedirs(path, exist_ok=True)
    vocab = _bert_tokenizer(path, roberta=False)
    config = _encoder_config("bert", vocab, num_labels=num_labels)
    torch.manual_seed(seed)
    BertForSequenceClassification(config).eval().save_pretrained(path)
    return path


def make_decoder_embedder(path: str, arch: str = "qwen3", seed: int = 0, base_model: bool = False) -> str:
    """A causal LM (Qwen3 / Qwen2 shape) served with --convert embed: last-token pooling, normalized, as
    Qwen3-Embedding's sentence-transformers folder says. base_model: saved as gte-Qwen2 is, the base model
    alone (no `model.` prefix, no LM head, untied) under a *ForCausalLM config."""
    from pagedserve.tests.helpers.models.tiny_models import make_tiny_model
    make_tiny_model(path, arch=arch, seed=seed, vocab_size=49152, tie_word_embeddings=not base_model,
                    hidden_size=32, intermediate_size=64, max_position_embeddings=1024, initializer_range=0.05)
    if base_model:
        from transformers import AutoModelForCausalLM
        full = AutoModelForCausalLM.from_pretrained(path)
        for f in os.listdir(path):
            if f.endswith(".safetensors"):
                os.remove(os.path.join(path, f))
        full.model.save_pretrained(path)
        with open(os.path.join(path, "config.json")) as f:
            config = json.load(f)
        config["architectures"] = [type(full).__name__]       # save_pretrained wrote the base model's class
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(config, f)
    with open(os.path.join(path, "tokenizer_config.json")) as f:
        tok_cfg = json.load(f)
    if not tok_cfg.get("pad_token"):          # sentence-transformers pads batches
        tok_cfg["pad_token"] = tok_cfg.get("eos_token") or "<|endoftext|>"
        with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
            json.dump(tok_cfg, f)
    write_sentence_transformers(path, "LAST", True, 32)
    return path


def make_causal_classifier(path: str, arch: str = "qwen2", num_labels: int = 3, seed: int = 0) -> str:
    """Qwen2ForSequenceClassification / Qwen3ForSequenceClassification with random weights (a score head over
    the last token), the embedded tokenizer; no LM head in the checkpoint."""
    import transformers

    from pagedserve.tests.helpers.models.tiny_models import embedded_tokenizer
    config_cls = {"qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config}[arch]
    model_cls = {"qwen2": transformers.Qwen2ForSequenceClassification,
                 "qwen3": transformers.Qwen3ForSequenceClassification}[arch]
    config = config_cls(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                        initializer_range=0.05, num_labels=num_labels, tie_word_embeddings=False,
                        bos_token_id=1, eos_token_id=2, pad_token_id=2, head_dim=8)
    torch.manual_seed(seed)
    model_cls(config).eval().save_pretrained(path)
    embedded_tokenizer().save_pretrained(path)
    return path
