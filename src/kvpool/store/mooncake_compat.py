"""The Mooncake Store adapter's earlier import path: see ``kvpool.integrations.mooncake``."""

from kvpool.integrations.mooncake import *  # noqa: F403
from kvpool.integrations.mooncake import __all__  # noqa: F401
