"""A staged load shape for ramp tests, in its own file so it applies only when asked for.

Locust uses any ``LoadTestShape`` it finds in the files it loads, so this
shape lives apart from the scenarios: add it with
``-f loadtest/locustfile.py,loadtest/shapes.py`` (``loadtest/run --ramp``).
The stages come from ``--stages END_S:USERS:SPAWN_RATE,...`` (defined with the
other options in ``locustfile.py``): until second ``END_S`` of the run hold
``USERS`` users, spawning or stopping ``SPAWN_RATE`` a second; the run stops
after the last stage.
"""

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
