"""The training system. Importing it gives Hydra the typed defaults of ``conf/config.yaml``'s
plain sections (:func:`orchestrator.config.schema.register`), which that file composes as
``schema``."""

from orchestrator.config.schema import register

register()
