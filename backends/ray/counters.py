"""The Ray placement's running counts, logged as metrics on each step with `placement.backend: ray`."""

PLACEMENT_COUNTERS = (
    "placement/engine_restarts",  # engine actors that died and were replaced
    "placement/redispatched_requests",  # requests sent again after their replica died
    "placement/reward_worker_restarts",
    "placement/rescored_groups",  # groups scored again after their reward worker died
    "placement/environment_worker_restarts",  # environment workers that died and were replaced
)
