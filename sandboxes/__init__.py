"""Services that tools run on (Docker containers, the mock search server).

Knows nothing about RL, models or tokens; ``envs`` builds tools on top of it.
"""
