"""Which vision family a model belongs to, from its small files.

Order: ``config.json`` ``architectures`` then ``model_type`` (the keys vLLM's model
registry dispatches on); without config.json (several vendored repos ship only
processor/tokenizer files) the ``preprocessor_config.json`` ``processor_class`` /
``image_processor_type``, then ``tokenizer_config.json`` ``processor_class``.
A model with none of these is text-only. Every failure comes back as
``(None, reason)`` with a sentence fit for a start-up log line.
"""

from __future__ import annotations

from typing import Any, Mapping

from mmroute.models.base import VisionFamily
from mmroute.models.common import TokenLookup
from mmroute.models.gemma3 import Gemma3Family
from mmroute.models.llava import LlavaFamily
from mmroute.models.llava_next import LlavaNextFamily
from mmroute.models.phi3v import Phi3VFamily
from mmroute.models.qwen_vl import QwenVLFamily

_ARCHITECTURES = {
    "Qwen2VLForConditionalGeneration": "qwen2_vl",
    "Qwen2_5_VLForConditionalGeneration": "qwen2_5_vl",
    "Qwen3VLForConditionalGeneration": "qwen3_vl",
    "Qwen3VLMoeForConditionalGeneration": "qwen3_vl",
    "LlavaForConditionalGeneration": "llava",
    "LlavaNextForConditionalGeneration": "llava_next",
    "Phi3VForCausalLM": "phi3_v",
    "Gemma3ForConditionalGeneration": "gemma3",
}

_MODEL_TYPES = {
    "qwen2_vl": "qwen2_vl",
    "qwen2_5_vl": "qwen2_5_vl",
    "qwen3_vl": "qwen3_vl",
    "qwen3_vl_moe": "qwen3_vl",
    "llava": "llava",
    "llava_next": "llava_next",
    "phi3_v": "phi3_v",
    "gemma3": "gemma3",
}

_PROCESSORS = {
    "Qwen2VLProcessor": "qwen2_vl",
    "Qwen2_5_VLProcessor": "qwen2_5_vl",
    "Qwen3VLProcessor": "qwen3_vl",
    "LlavaProcessor": "llava",
    "LlavaNextProcessor": "llava_next",
    "Phi3VProcessor": "phi3_v",
    "Gemma3Processor": "gemma3",
    # image processor classes, when no processor_class is given
    "Qwen2VLImageProcessor": "qwen2_vl",
    "Qwen2VLImageProcessorFast": "qwen2_vl",
    "LlavaNextImageProcessor": "llava_next",
    "LlavaNextImageProcessorFast": "llava_next",
    "Phi3VImageProcessor": "phi3_v",
    "Gemma3ImageProcessor": "gemma3",
    "Gemma3ImageProcessorFast": "gemma3",
}

# Known multimodal families we do not model (anything else with a vision_config or a
# processor class is also reported as unsupported).
_VISION_HINT_KEYS = ("vision_config", "img_processor", "vision_tower", "mm_vision_tower", "visual")


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _identify(config: Mapping[str, Any], pre: Mapping[str, Any], tokcfg: Mapping[str, Any]) -> tuple[str | None, str]:
    """(family key or None, what identified it / the unsupported name / "")."""
    archs = [a for a in config.get("architectures") or () if isinstance(a, str)]
    for arch in archs:
        if arch in _ARCHITECTURES:
            return _ARCHITECTURES[arch], f"config.json architectures {arch}"
    model_type = config.get("model_type") if isinstance(config.get("model_type"), str) else None
    if model_type in _MODEL_TYPES:
        return _MODEL_TYPES[model_type], f"config.json model_type {model_type}"
    if config and any(k in config for k in _VISION_HINT_KEYS):
        return None, archs[0] if archs else (model_type or "with a vision_config")
    for source, value in (
        ("preprocessor_config.json processor_class", pre.get("processor_class")),
        ("preprocessor_config.json image_processor_type", pre.get("image_processor_type")),
        ("tokenizer_config.json processor_class", tokcfg.get("processor_class")),
    ):
        if isinstance(value, str) and value:
            if value in _PROCESSORS:
                return _PROCESSORS[value], f"{source} {value}"
            return None, value
    return None, ""


def detect_family(
    files: Any, tokenizer: TokenLookup | None, mm_processor_kwargs: Mapping[str, Any] | None = None
) -> tuple[VisionFamily | None, str]:
    """``files``: anything with ``config``, ``preprocessor_config`` and
    ``tokenizer_config`` dicts (``models.files.ModelFiles``). ``tokenizer`` offers
    ``token_to_id`` and ``encode(text, add_special_tokens)``. ``mm_processor_kwargs``
    mirrors vLLM ``--mm-processor-kwargs`` (``min_pixels``, ``max_pixels``, ``num_crops``)."""
    config = _dict(getattr(files, "config", None))
    pre = _dict(getattr(files, "preprocessor_config", None))
    tokcfg = _dict(getattr(files, "tokenizer_config", None))
    key, why = _identify(config, pre, tokcfg)
    if key is None:
        if why:
            return None, f"unsupported vision family {why}"
        return None, "text-only model"
    overrides = _dict(mm_processor_kwargs)
    try:
        family: VisionFamily
        if key.startswith("qwen"):
            family = QwenVLFamily.from_config(key, config, pre, tokenizer, overrides)
        elif key == "llava":
            family = LlavaFamily.from_config(config, pre, tokenizer)
        elif key == "llava_next":
            family = LlavaNextFamily.from_config(config, pre, tokenizer)
        elif key == "phi3_v":
            family = Phi3VFamily.from_config(config, pre, tokcfg, tokenizer, overrides)
        else:
            if tokenizer is None:
                return None, "gemma3 needs the tokenizer vocabulary"
            if pre.get("do_pan_and_scan") or overrides.get("do_pan_and_scan"):
                return None, "unsupported vision family gemma3 with pan-and-scan"
            family = Gemma3Family.from_config(config, tokcfg, tokenizer)
    except (ValueError, TypeError, KeyError, IndexError) as exc:
        return None, f"cannot model {key}: {exc}"
    return family, f"{family.name} (from {why})"
