"""A reward worker process: ``python -m envs.reward_worker FD MV_TIMEOUT NAME…``, started by
:class:`envs.rewards.WorkerPool` (see there)."""

import sys

from envs.rewards import worker_main

if __name__ == "__main__":
    worker_main(int(sys.argv[1]), sys.argv[3:], int(sys.argv[2]))
