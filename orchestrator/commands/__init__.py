"""The commands beside a run, each ``python -m orchestrator.<name>``: ``eval`` (one evaluation
of a checkpoint or a model), ``export`` (a checkpoint out as a Hugging Face directory),
``data`` (a user's dataset files and reward checked before a run), ``serve`` (a model behind an
OpenAI-compatible URL); ``targets`` finds what ``eval`` and ``export`` are pointed at, and
``config_reference`` writes ``docs/config-reference.md``. The names users type are modules of
their own at the top of :mod:`orchestrator` that run these."""
