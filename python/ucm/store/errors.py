"""Store exceptions (re-exported from :mod:`ucm.errors`)."""

from ucm.errors import *  # noqa: F403
from ucm.errors import __all__  # noqa: F401
