"""The training system. Importing it gives Hydra the typed defaults of ``conf/config.yaml``'s
plain sections (:func:`orchestrator.schema.register`), which that file composes as ``schema``."""

from orchestrator.schema import register

register()
