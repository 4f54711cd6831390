"""Services that tools run on (code sandboxes, the mock search server).

The sandbox interface sits here (:mod:`.api`, :mod:`.config`, the session runner and its
protocol); each backend (:mod:`.docker`, :mod:`.local`, or a module elsewhere) is chosen by the
``_target_`` of ``conf/sandbox/*.yaml``.

Knows nothing about RL, models or tokens; ``envs`` builds tools on top of it.
"""
