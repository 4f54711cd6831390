"""One training run around the pipeline: the run loop (:mod:`~orchestrator.run.loop`), its
directory and files (:mod:`~orchestrator.run.directory`), checkpoints, resume, the best
checkpoint kept, and the supervised warm start before RL."""
