"""The run's configuration: the typed defaults and bounds of the plain sections
(:mod:`~orchestrator.config.schema`) and reading the composed config, with one clear line for
a wrong key (:mod:`~orchestrator.config.read`)."""
