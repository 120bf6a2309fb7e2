"""The fixtures every test module may ask for, from `support` (tests/support/): the toy's reference
checkpoints, the session's tiny mint, an S3 endpoint and publisher keys. Registered as plugins so
that no test module imports another one, or this file, for a fixture."""

from __future__ import annotations

import pytest

# Before anything imports `support`: its asserts fail with the values compared, as a test's do.
pytest.register_assert_rewrite("support")

from support.toy import copy_toy  # noqa: E402

__all__ = ["copy_toy"]  # benchmarks/kill_points.py imports it from here, with tests/ on its path

pytest_plugins = ["support.minted", "support.publishers", "support.s3", "support.toy"]
