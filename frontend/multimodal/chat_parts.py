"""Image content parts of chat messages (OpenAI's image_url, the Responses API's input_image, vLLM's
image_pil): each becomes a {"type": "image"} part, which a multimodal chat template renders as the model's
placeholder, and the image it points at is collected, in order, to be loaded and processed."""
from __future__ import annotations

from typing import Any, Union

from pagedserve.common.errors import RequestError

IMAGE_PARTS = ("image_url", "input_image", "image_pil")
MediaRef = Union[str, Any]          # a URL (data:, http(s)://, file://) or a PIL image


def _image_ref(part: dict[str, Any], where: str) -> MediaRef:
    kind = part["type"]
    if kind == "image_pil":
        return part.get("image_pil")
    value = part.get("image_url")
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str) or not url:
        raise RequestError.at(f"{where}.image_url", "must be a URL string or {'url': URL}")
    return url


def take_images(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[MediaRef]]:
    """(messages as the template takes them, the images in order). A message with images keeps its content
    as a list of parts; text parts stay as they are."""
    out: list[dict[str, Any]] = []
    refs: list[MediaRef] = []
    for i, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list) or not any(isinstance(p, dict) and p.get("type") in IMAGE_PARTS
                                                    for p in content):
            out.append(message)
            continue
        parts = []
        for j, part in enumerate(content):
            if isinstance(part, dict) and part.get("type") in IMAGE_PARTS:
                refs.append(_image_ref(part, f"messages[{i}].content[{j}]"))
                parts.append({"type": "image"})
            elif isinstance(part, dict) and part.get("type") in ("text", "input_text"):
                parts.append({"type": "text", "text": str(part.get("text", ""))})
            else:
                raise RequestError.at(f"messages[{i}].content[{j}].type", f"content parts of type "
                                      f"{part.get('type') if isinstance(part, dict) else part!r} are not supported")
        out.append({**message, "content": parts})
    return out, refs
