"""``python -m orchestrator.serve``, the name users type: runs
:mod:`orchestrator.commands.serve`."""

import runpy

if __name__ == "__main__":
    runpy.run_module("orchestrator.commands.serve", run_name="__main__", alter_sys=True)
