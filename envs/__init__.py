"""Environments: tasks, episodes and rewards. Depends on ``sandboxes``, never on ``orchestrator``."""
