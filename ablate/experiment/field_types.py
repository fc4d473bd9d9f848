"""The config value checks of ablate.field_types, by the name ablate.experiment.config imports them
from (nothing else should: import ablate.field_types)."""
from ablate.field_types import check_field_types  # noqa: F401  (ablate.experiment.config's import)
