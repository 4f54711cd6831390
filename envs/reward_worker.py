"""The reward workers' zygote: ``python -m envs.reward_worker FD MV_TIMEOUT NAME…``, started by
:class:`envs.reward_pool.WorkerPool` (see there); it forks each worker from itself."""

import sys

from envs.reward_functions import prepare_worker
from envs.reward_pool import zygote_main

if __name__ == "__main__":
    zygote_main(int(sys.argv[1]), sys.argv[3:], int(sys.argv[2]), prepare_worker)
