"""``python -m orchestrator.data``, the name users type: runs :mod:`orchestrator.commands.data`."""

import runpy

if __name__ == "__main__":
    runpy.run_module("orchestrator.commands.data", run_name="__main__", alter_sys=True)
