"""``python -m orchestrator.export``, the name users type: runs
:mod:`orchestrator.commands.export`."""

import runpy

if __name__ == "__main__":
    runpy.run_module("orchestrator.commands.export", run_name="__main__", alter_sys=True)
