"""Media content parts of chat messages (OpenAI's image_url, the Responses API's input_image, vLLM's image_pil
and video_url): each becomes a {"type": "image"} or {"type": "video"} part, which a multimodal chat template
renders as the model's placeholder, and the media it points at is collected, in order, to be loaded and
processed."""
from __future__ import annotations

from typing import Any, Union

from pagedserve.common.errors import RequestError

IMAGE_PARTS = ("image_url", "input_image", "image_pil")
VIDEO_PARTS = ("video_url",)
MEDIA_PARTS = IMAGE_PARTS + VIDEO_PARTS
MediaRef = Union[str, Any]          # a URL (data:, http(s)://, file://) or a PIL image
MediaItem = tuple[str, MediaRef]    # (modality, what names it)


def _media_ref(part: dict[str, Any], where: str) -> MediaItem:
    kind = part["type"]
    if kind == "image_pil":
        return "image", part.get("image_pil")
    key = "video_url" if kind in VIDEO_PARTS else "image_url"
    value = part.get(key)
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str) or not url:
        raise RequestError.at(f"{where}.{key}", "must be a URL string or {'url': URL}")
    return ("video" if kind in VIDEO_PARTS else "image"), url


def take_media(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[MediaItem]]:
    """(messages as the template takes them, the media in order). A message with media keeps its content
    as a list of parts; text parts stay as they are."""
    out: list[dict[str, Any]] = []
    refs: list[MediaItem] = []
    for i, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list) or not any(isinstance(p, dict) and p.get("type") in MEDIA_PARTS
                                                    for p in content):
            out.append(message)
            continue
        parts = []
        for j, part in enumerate(content):
            if isinstance(part, dict) and part.get("type") in MEDIA_PARTS:
                modality, ref = _media_ref(part, f"messages[{i}].content[{j}]")
                refs.append((modality, ref))
                parts.append({"type": modality})
            elif isinstance(part, dict) and part.get("type") in ("text", "input_text"):
                parts.append({"type": "text", "text": str(part.get("text", ""))})
            else:
                raise RequestError.at(f"messages[{i}].content[{j}].type", f"content parts of type "
                                      f"{part.get('type') if isinstance(part, dict) else part!r} are not supported")
        out.append({**message, "content": parts})
    return out, refs
