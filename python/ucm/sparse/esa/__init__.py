"""ESA: block retrieval over sub-block mean keys, with offload (:mod:`.method`)."""

from ucm.sparse.esa.config import ESAConfig
from ucm.sparse.esa.method import ESA, ESASelector, esa_representatives, esa_scores

__all__ = ["ESA", "ESAConfig", "ESASelector", "esa_representatives", "esa_scores"]
