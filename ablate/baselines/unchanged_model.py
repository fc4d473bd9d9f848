"""variant=none: the model as loaded."""
from __future__ import annotations

from dataclasses import dataclass

from ablate.api.slots import ModelVariant
from ablate.model.llama import LlamaModel
from ablate.api.plugin import PluginConfig


@dataclass
class UnchangedModelConfig(PluginConfig):
    name: str = "none"


class UnchangedModel(ModelVariant):
    name = "none"
    config_class = UnchangedModelConfig

    def apply(self, model: LlamaModel) -> LlamaModel:
        return model
