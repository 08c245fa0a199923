"""A staged load shape for ramp tests, in its own file so it applies only when asked for."""

from __future__ import annotations

from loadtest.payloads import parse_stages
from locust import LoadTestShape


class StagedShape(LoadTestShape):
    """Steps through ``--stages``; ``tick`` returns None (stop) after the last one."""

    def tick(self) -> tuple[int, float] | None:
        stages = parse_stages(self.runner.environment.parsed_options.stages)
        now = self.get_run_time()
        for end_s, users, rate in stages:
            if now < end_s:
                return users, rate
        return None
