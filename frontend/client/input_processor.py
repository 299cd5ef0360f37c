"""Prompts in, EngineCoreRequests out: tokenization, chat templates, validation, n-way fan-out."""
from __future__ import annotations

import inspect
import time
from dataclasses import dataclass
from typing import Any, Union

from pagedserve.common.errors import RequestError
from pagedserve.common.params.pooling_params import check_generation_allowed
from pagedserve.common.request_checks import check_params, check_prompt
from pagedserve.common.params.sampling_params import SamplingParams
from pagedserve.frontend.client.prompt_constraints import bad_words_token_ids, truncated_ids
from pagedserve.frontend.multimodal.chat_parts import MediaItem, take_media
from pagedserve.frontend.multimodal.processor import MultiModalProcessor, load_images, load_videos, offline_videos
from pagedserve.ipc.messages import EngineCoreRequest, EngineInfo, MultiModalFeature

PromptType = Union[str, list[int], dict[str, Any]]


@dataclass
class ProcessedPrompt:
    prompt: str | None
    prompt_token_ids: list[int]
    mm_features: list[MultiModalFeature] | None = None     # its images, placeholders expanded in the ids
    # A chat's images and videos, not yet loaded: attach_media loads and processes them (placeholders still
    # single).
    pending_media: list[MediaItem] | None = None


@dataclass
class PreparedRequest:
    """One user request, validated and ready for the engine: one EngineCoreRequest per sample."""
    request_id: str
    prompt: ProcessedPrompt
    params: SamplingParams
    child_ids: list[str]
    requests: list[EngineCoreRequest]


class InputProcessor:
    def __init__(self, tokenizer: Any, info: EngineInfo, chat_template: str | None = None,
                 mm: MultiModalProcessor | None = None) -> None:
        """chat_template: the template to render chats with instead of the tokenizer's own; mm: a multimodal
        model's image processing."""
        self.tokenizer = tokenizer
        self.info = info
        self.mm = mm
        self.chat_template = chat_template
        self._reserved: set[str] | None = None

    def parse_prompt(self, prompt: PromptType, add_special_tokens: bool = True) -> ProcessedPrompt:
        if isinstance(prompt, str):
            return ProcessedPrompt(prompt, self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens))
        if isinstance(prompt, dict):
            if prompt.get("multi_modal_data") is not None:
                return self._multimodal_prompt(prompt, add_special_tokens)
            if "prompt_token_ids" in prompt:
                return ProcessedPrompt(prompt.get("prompt"), self._check_ids(prompt["prompt_token_ids"]))
            if isinstance(prompt.get("prompt"), str):
                return self.parse_prompt(prompt["prompt"], add_special_tokens)
            raise RequestError.at("prompt", "a dict prompt needs 'prompt' (str) or 'prompt_token_ids' (list of int)")
        if isinstance(prompt, (list, tuple)):
            return ProcessedPrompt(None, self._check_ids(prompt))
        raise RequestError("prompt", "prompt must be a string, a list of token ids or a dict, got "
                           f"{type(prompt).__name__}")

    def _multimodal_prompt(self, prompt: dict[str, Any], add_special_tokens: bool) -> ProcessedPrompt:
        """{"prompt": text with one placeholder per image and per video (or "prompt_token_ids"),
        "multi_modal_data": {"image": an image or a list of them, "video": a video or a list of them}}."""
        data = prompt["multi_modal_data"]
        if self.mm is None:
            raise RequestError.at("multi_modal_data", "this model takes text only")
        taken = set(self.mm.tokens)
        if not isinstance(data, dict) or set(data) - taken:
            raise RequestError.at("multi_modal_data", f"must be {{'image': image or list of images"
                                  f"{', video: video or list of videos' if 'video' in taken else ''}}}; this model "
                                  f"takes {' and '.join(f'{m}s' for m in sorted(taken))} only, got "
                                  f"{sorted(data) if isinstance(data, dict) else data!r}")
        images = data.get("image") or []
        images = list(images) if isinstance(images, (list, tuple)) else [images]
        videos = offline_videos(data.get("video"), self.mm.num_frames, "multi_modal_data.video")
        base = self.parse_prompt({k: v for k, v in prompt.items() if k != "multi_modal_data"}, add_special_tokens)
        return self.with_images(base, images, videos=videos)

    def with_images(self, prompt: ProcessedPrompt, images: list[Any], field: str = "multi_modal_data",
                    videos: list[Any] | None = None) -> ProcessedPrompt:
        """The prompt with each image's (and video's) placeholder expanded and its feature attached (blocking:
        media is processed here; the async client runs it on its media pool)."""
        if self.mm is None:
            raise RequestError.at(field, "this model takes text only")
        ids, features = self.mm.expand(prompt.prompt_token_ids, images, field, videos, text=prompt.prompt)
        return ProcessedPrompt(prompt.prompt, ids, features or None)

    def _check_ids(self, ids: Any) -> list[int]:
        if not isinstance(ids, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool)
                                                         for t in ids):
            raise RequestError("prompt_token_ids", "prompt_token_ids must be a list of integers")
        return list(ids)       # their range is checked with the rest, in check_prompt

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            chat_template: str | None = None, template_kwargs: dict[str, Any] | None = None,
                            continue_final_message: bool = False,
                            tools: list[dict[str, Any]] | None = None) -> ProcessedPrompt:
        """Render and tokenize (tools: OpenAI's tool list, as HF templates take it); template_kwargs are extra template variables (a request's
        chat_template_kwargs), never arguments of the call. continue_final_message: the last message is
        left open (no end of turn) for the model to continue."""
        kwargs = dict(template_kwargs or {})
        if continue_final_message and add_generation_prompt:
            raise RequestError.at("continue_final_message", "cannot be combined with add_generation_prompt=true "
                                  "(set add_generation_prompt to false)")
        if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
            raise RequestError("messages", "messages must be a list of {'role': ..., 'content': ...} dicts")
        chat_template = chat_template if chat_template is not None else self.chat_template
        if getattr(self.tokenizer, "chat_template", None) is None and chat_template is None:
            raise RequestError.at("messages", "this model's tokenizer has no chat template; pass chat_template")
        # Template variables only: a request must not swap the template, or change what the call returns.
        reserved = sorted(set(kwargs) & self._reserved_template_args())
        if reserved:
            raise RequestError.at("chat_template_kwargs", f"{', '.join(reserved)} cannot be set per request")
        try:
            messages, media = take_media(messages) if self.mm is not None else (messages, [])
            text = self.tokenizer.apply_chat_template(_with_text_content(messages), tokenize=False,
                                                      chat_template=chat_template,
                                                      add_generation_prompt=add_generation_prompt,
                                                      continue_final_message=continue_final_message,
                                                      tools=tools, **kwargs)
        except Exception as exc:   # the template is fixed, so a failure to render comes from the messages
            raise RequestError.at("messages", f"the chat template cannot render them: {type(exc).__name__}: "
                                  f"{exc}") from exc
        if not isinstance(text, str):
            raise RequestError.at("messages", "the chat template did not render to text")
        # The template already placed any BOS: do not add special tokens again.
        return ProcessedPrompt(text, self.tokenizer.encode(text, add_special_tokens=False),
                               pending_media=media or None)

    def attach_media(self, prompt: ProcessedPrompt) -> ProcessedPrompt:
        """A rendered chat with its images and videos loaded (URLs fetched, within the media limits) and
        processed (blocking: the async client runs it on its media pool, never on the event loop)."""
        if not prompt.pending_media:
            return prompt
        refs = {m: [ref for kind, ref in prompt.pending_media if kind == m] for m in ("image", "video")}
        for modality, items in refs.items():
            self.mm.check_count(len(items), "messages", modality)
        images = load_images(refs["image"], self.mm.media_limits, "messages")
        videos = load_videos(refs["video"], self.mm.media_limits, "messages", self.mm.num_frames)
        return self.with_images(ProcessedPrompt(prompt.prompt, prompt.prompt_token_ids), images, "messages",
                                videos)

    def _reserved_template_args(self) -> set[str]:
        if self._reserved is None:
            params = inspect.signature(self.tokenizer.apply_chat_template).parameters
            self._reserved = {n for n, p in params.items() if p.kind != p.VAR_KEYWORD} | {"tokenizer_kwargs", "messages"}
        return self._reserved

    def truncate(self, prompt: ProcessedPrompt, keep: int | None) -> ProcessedPrompt:
        """truncate_prompt_tokens: the prompt's last `keep` tokens (its text no longer matches them)."""
        ids = truncated_ids(prompt.prompt_token_ids, keep, self.info.max_model_len)
        if len(ids) == len(prompt.prompt_token_ids):
            return prompt
        if prompt.mm_features:
            raise RequestError.at("truncate_prompt_tokens", "a prompt with images is not cut (an image's "
                                  "placeholders must stay whole)")
        return ProcessedPrompt(None, ids)

    def make_requests(self, request_id: str, prompt: ProcessedPrompt, params: SamplingParams,
                      priority: int = 0, arrival_time: float | None = None, lora_int_id: int = 0) -> PreparedRequest:
        """Validate (the rules the core runs again at its socket, run here once and early) and build one
        engine request per sample: n > 1 fans out into children that share the prompt's blocks through the
        prefix cache. truncate_prompt_tokens is applied here, and only here."""
        if prompt.pending_media:        # a caller's bug, not the user's: the images were never loaded
            raise RuntimeError("make_requests: the prompt's images were not attached (attach_media)")
        check_params(params, priority)
        check_generation_allowed(self.info.pooling_tasks)
        prompt = self.truncate(prompt, params.truncate_prompt_tokens)
        if params.bad_words:
            params = params.clone(_bad_words_token_ids=bad_words_token_ids(self.tokenizer, params.bad_words))
        check_prompt(prompt.prompt_token_ids, params, self.info.max_model_len, self.info.vocab_size)
        arrival = time.time() if arrival_time is None else arrival_time
        if params.n == 1:
            children = [(request_id, params)]
        else:
            # The prompt is scored once, by the first sample (the others may then hit the prefix cache).
            children = [(f"{request_id}#{i}", params.clone(
                n=1, seed=None if params.seed is None else params.seed + i,
                prompt_logprobs=params.prompt_logprobs if i == 0 else None)) for i in range(params.n)]
        requests = [EngineCoreRequest(cid, prompt.prompt_token_ids, p, arrival, priority, lora_int_id=lora_int_id,
                                      mm_features=prompt.mm_features) for cid, p in children]
        return PreparedRequest(request_id, prompt, params, [c for c, _ in children], requests)


def _with_text_content(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """An assistant turn that only calls tools has no content (null, or left out): it renders as "", as vLLM
    renders it, so a template that knows no tools and concatenates message['content'] still renders the
    conversation. Other messages reach the template as sent."""
    return [{**m, "content": ""} if m.get("role") == "assistant" and m.get("tool_calls") and m.get("content") is None
            else m for m in messages]
