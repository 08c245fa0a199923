"""Every served VLM family, registered here and nowhere else: ``config.json`` ``model_type`` → its
``FamilyTower`` subclass."""

from __future__ import annotations

from visenc.models.families.gemma3 import Gemma3Tower
from visenc.models.families.gemma4 import Gemma4Tower
from visenc.models.families.glm4v import Glm4vTower
from visenc.models.families.idefics3 import Idefics3Tower, SmolVLMTower
from visenc.models.families.internvl import InternVLTower
from visenc.models.families.llava_onevision import LlavaOnevisionTower
from visenc.models.families.mistral3 import Mistral3Tower
from visenc.models.families.qwen3_vl import Qwen3VLMoeTower, Qwen3VLTower
from visenc.models.vlm import FamilyTower

_TOWERS: tuple[type[FamilyTower], ...] = (
    Qwen3VLTower,
    Qwen3VLMoeTower,
    Glm4vTower,
    Gemma3Tower,
    Gemma4Tower,
    InternVLTower,
    LlavaOnevisionTower,
    Mistral3Tower,
    Idefics3Tower,
    SmolVLMTower,
)

FAMILIES: dict[str, type[FamilyTower]] = {t: tower for tower in _TOWERS for t in tower.model_types}
