"""The algorithm ``conf/algo`` composes, built from its section (``algo.filter`` is the
pipeline's and is left out), with a piece's bad setting said in one line naming its key."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from orchestrator.algo.base import Algorithm
from orchestrator.algo.filters import FILTER_KEY
from orchestrator.errors import ConfigError

PIPELINE_KEYS = (FILTER_KEY,)  # read by the pipeline, never passed to the algorithm


def algorithm_values(section: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in section.items() if k not in PIPELINE_KEYS}


def build_algorithm(section: Mapping[str, Any]) -> Algorithm:
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    try:
        algorithm = instantiate(algorithm_values(section))
    except InstantiationException as e:
        cause = e.__cause__
        if isinstance(cause, ConfigError):
            raise cause from None
        where = next((line.removeprefix("full_key:").strip() for line in str(e).splitlines()
                      if line.startswith("full_key:")), "")
        key = f"algo.{where}" if where else "algo"
        raise ConfigError(f"{key}: {cause or e}".replace("\n", " ")) from e
    if not isinstance(algorithm, Algorithm):
        raise ConfigError(f"algo._target_ must name an Algorithm (e.g. orchestrator.algo."
                          f"composed.PolicyGradient), got {type(algorithm).__name__}")
    return algorithm
