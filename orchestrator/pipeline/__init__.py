"""The asynchronous pipeline: rollout workers and the trainer under bounded staleness
(:mod:`~orchestrator.pipeline.pipeline`), where each group leaves it
(:mod:`~orchestrator.pipeline.outcomes`), the order tasks are drawn in
(:mod:`~orchestrator.pipeline.sampler`), and evaluation on the same engines
(:mod:`~orchestrator.pipeline.evaluation`)."""
