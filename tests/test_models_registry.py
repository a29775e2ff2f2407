"""Family detection from model files, and image-token id resolution."""

from __future__ import annotations

import pytest

from mmroute.models.base import ImageInput, MMItem
from mmroute.models.common import resolve_image_token_id
from mmroute.models.gemma3 import Gemma3Family
from mmroute.models.llava import LlavaFamily
from mmroute.models.llava_next import LlavaNextFamily
from mmroute.models.phi3v import Phi3VFamily
from mmroute.models.qwen_vl import QwenVLFamily
from mmroute.models.registry import detect_family

from fixture_models import GEMMA3, LLAVA15, LLAVA_NEXT, MODELS, PHI3V, QWEN2_VL, QWEN3_VL, QWEN3_EMBED, QWEN25_VL
from models_helpers import Files, expected_prompts, files, tokenizer


@pytest.mark.parametrize(
    "model,cls,name,source",
    [
        (QWEN2_VL, QwenVLFamily, "qwen2_vl", "config.json architectures Qwen2VLForConditionalGeneration"),
        (QWEN25_VL, QwenVLFamily, "qwen2_5_vl", "config.json architectures Qwen2_5_VLForConditionalGeneration"),
        (QWEN3_VL, QwenVLFamily, "qwen3_vl", "config.json architectures Qwen3VLForConditionalGeneration"),
        (QWEN3_EMBED, QwenVLFamily, "qwen3_vl", "config.json architectures Qwen3VLForConditionalGeneration"),
        (LLAVA15, LlavaFamily, "llava", "config.json architectures LlavaForConditionalGeneration"),
        (LLAVA_NEXT, LlavaNextFamily, "llava_next", "preprocessor_config.json processor_class LlavaNextProcessor"),
        (PHI3V, Phi3VFamily, "phi3_v", "preprocessor_config.json processor_class Phi3VProcessor"),
        (GEMMA3, Gemma3Family, "gemma3", "tokenizer_config.json processor_class Gemma3Processor"),
    ],
)
def test_fixture_families(model, cls, name, source):
    fam, why = detect_family(files(model), tokenizer(model))
    assert isinstance(fam, cls) and fam.name == name
    assert why == f"{name} (from {source})"


@pytest.mark.parametrize("model", ["Qwen__Qwen2.5-0.5B-Instruct", "Qwen__Qwen3-tokenizer", "ortx-testdata__phi-3-mini"])
def test_text_only_fixtures(model):
    assert detect_family(files(model), tokenizer(model)) == (None, "text-only model")


def test_text_only_config():
    f = Files(config={"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"})
    assert detect_family(f, None) == (None, "text-only model")
    assert detect_family(object(), None) == (None, "text-only model")  # no attributes at all


def test_unknown_vision_families():
    f = Files(config={"architectures": ["Idefics3ForConditionalGeneration"], "vision_config": {"patch_size": 14}})
    assert detect_family(f, None) == (None, "unsupported vision family Idefics3ForConditionalGeneration")
    f = Files(config={"model_type": "mystery_vl", "vision_config": {}})
    assert detect_family(f, None) == (None, "unsupported vision family mystery_vl")
    f = Files(preprocessor_config={"processor_class": "PixtralProcessor"})
    assert detect_family(f, None) == (None, "unsupported vision family PixtralProcessor")
    f = Files(tokenizer_config={"processor_class": "MllamaProcessor"})
    assert detect_family(f, None) == (None, "unsupported vision family MllamaProcessor")


def test_config_wins_over_processor_hints():
    f = Files(config=files(QWEN25_VL).config, preprocessor_config={"processor_class": "LlavaProcessor"})
    fam, _ = detect_family(f, tokenizer(QWEN25_VL))
    assert fam.name == "qwen2_5_vl"


def test_gemma_pan_and_scan_unsupported():
    f = Files(tokenizer_config=files(GEMMA3).tokenizer_config, preprocessor_config={"do_pan_and_scan": True})
    fam, why = detect_family(f, tokenizer(GEMMA3))
    assert fam is None and "pan-and-scan" in why


def test_bad_config_values_are_reasons():
    f = Files(config={"architectures": ["LlavaNextForConditionalGeneration"], "image_grid_pinpoints": [[0, 5]]})
    fam, why = detect_family(f, tokenizer(LLAVA_NEXT))
    assert fam is None and why.startswith("cannot model llava_next:")
    f = Files(config={"architectures": ["Qwen2VLForConditionalGeneration"]})
    fam, why = detect_family(f, None)  # no image_token_id and no vocabulary
    assert fam is None and "image token id" in why


class _Vocab:
    def __init__(self, table):
        self.table = table

    def token_to_id(self, token):
        return self.table.get(token)


def test_image_token_resolution_order():
    vocab = _Vocab({"<image>": 7})
    full = {"image_token_id": 1, "image_token_index": 2, "media_placeholder_token_id": 3, "vision_token_id": 4}
    assert resolve_image_token_id(full, vocab, "<image>") == 1
    assert resolve_image_token_id({k: v for k, v in full.items() if k != "image_token_id"}, vocab, "<image>") == 2
    assert resolve_image_token_id({"media_placeholder_token_id": 3, "vision_token_id": 4}, vocab, "<image>") == 3
    assert resolve_image_token_id({"vision_token_id": 4}, vocab, "<image>") == 7  # never vision_token_id
    assert resolve_image_token_id({"vision_token_id": 4}, vocab, "<missing>") is None
    assert resolve_image_token_id({"image_token_id": None}, None, "<image>") is None


def test_llava_next_without_config_uses_processor_geometry():
    fam, _ = detect_family(files(LLAVA_NEXT), tokenizer(LLAVA_NEXT))
    assert fam.image_token_id == 32000 and fam.tile_size == 336 and fam.features_per_tile == 24
    assert fam.pinpoints == ((336, 672), (672, 336), (672, 672), (1008, 336), (336, 1008))


# ---- with the project's own loaders (models.files / render.tokenizer) ----


def _project_loaders():
    from mmroute.models.files import ModelFiles
    from mmroute.render.tokenizer import ModelTokenizer

    return ModelFiles, ModelTokenizer


@pytest.mark.parametrize("model", [QWEN25_VL, LLAVA15, LLAVA_NEXT, PHI3V])
def test_with_model_files_and_model_tokenizer(model):
    import os

    ModelFiles, ModelTokenizer = _project_loaders()
    mf = ModelFiles.load(os.path.join(MODELS, model))
    tok = ModelTokenizer.from_files(mf)
    fam, why = detect_family(mf, tok)
    assert fam is not None, why
    raw_fam, _ = detect_family(files(model), tokenizer(model))
    assert fam == raw_fam


def test_phi3_reference_with_model_tokenizer():
    import os

    ModelFiles, ModelTokenizer = _project_loaders()
    mf = ModelFiles.load(os.path.join(MODELS, PHI3V))
    tok = ModelTokenizer.from_files(mf)
    fam, _ = detect_family(mf, tok)
    case = expected_prompts()["Phi-3-vision-128k-instruct"]
    ids, items = fam.expand_text(case["rendered"], [ImageInput("u", 640, 480)], tok.encode)
    assert len(ids) == 1938 and items == [MMItem("u", 4, 1921)]
    assert ids[:4] == [1, 32010, 29871, 13] and ids[1925:] == [1, 29871, 13, 5618, 338, 297, 445, 1967, 29973, 32007, 29871, 13, 32001]
