"""One episode on an engine: the rollout of a task's turns and tool calls
(:mod:`~orchestrator.episodes.rollout`) and the token trajectory it leaves
(:mod:`~orchestrator.episodes.trajectory`)."""
