"""``launcher=ray``: engines and the trainer as Ray actors (see :mod:`.launcher`).

Needs the ``ray`` extra (``pip install -e '.[ray]'``).
"""

try:
    import ray  # noqa: F401
except ImportError as error:  # pragma: no cover - the extra is installed by scripts/setup.sh
    from orchestrator.errors import ConfigError

    raise ConfigError("launcher=ray needs Ray: pip install -e '.[ray]'") from error

from orchestrator.launch.ray.actors import WeightsLost
from orchestrator.launch.ray.engines import EnginesLost, RayEngine, RayKeeper, ray_router
from orchestrator.launch.ray.launcher import ActorResources, RayConfig, RayLauncher
from orchestrator.launch.ray.trainer import RayTrainer, TrainerLost

__all__ = ["ActorResources", "EnginesLost", "RayConfig", "RayEngine", "RayKeeper",
           "RayLauncher", "RayTrainer", "TrainerLost", "WeightsLost", "ray_router"]
