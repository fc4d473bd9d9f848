"""variant=none: the model as loaded."""
from __future__ import annotations

from dataclasses import dataclass

from ablate.api import ModelVariant, PluginConfig


@dataclass
class UnchangedModelConfig(PluginConfig):
    name: str = "none"


class UnchangedModel(ModelVariant):
    name = "none"
    config_class = UnchangedModelConfig

    def apply(self, model):
        return model
