"""Whether the tests run under CI (``CI=true``), where a missing real component or shared
dataset fails its tests instead of skipping them."""

from __future__ import annotations

import os


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("true", "1", "yes")
