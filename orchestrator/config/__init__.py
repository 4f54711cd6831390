"""The run's configuration: the typed defaults and bounds of the plain sections
(:mod:`~orchestrator.config.schema`), reading the composed config with one clear line for a
wrong key (:mod:`~orchestrator.config.read`), and a training run's configuration read and
checked once where the run starts (:mod:`~orchestrator.config.run`)."""
