"""Shared test settings: deterministic hypothesis runs in CI, quiet logs, bounded threads."""

import os

from hypothesis import settings

# CI runs on 2 shared cores: examples are derandomised there so a red run is reproducible, and no
# per-example deadline is enforced (timing on a loaded machine is not what these tests check).
settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
settings.register_profile("dev", deadline=None)
settings.load_profile("ci" if os.environ.get("CI") else "dev")
