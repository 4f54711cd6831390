"""``python -m orchestrator.eval``, the name users type: runs :mod:`orchestrator.commands.eval`."""

import runpy

if __name__ == "__main__":
    runpy.run_module("orchestrator.commands.eval", run_name="__main__", alter_sys=True)
