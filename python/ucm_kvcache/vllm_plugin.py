"""The vLLM general plugin of ``ucm-kvcache`` (its entry point).

vLLM loads it by entry point in every process it starts. It first checks
that ``ucm`` is this project's package: where another project's ``ucm``
shadows it, a command line that asks for the UCM connector stops with the
conflict and its fix, and any later import of the connector (the Python
``LLM`` API names it in code) raises the same message instead of
``No module named 'ucm.integration'``. Then it runs the UCM config check.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from ucm_kvcache import ForeignUcmError, check_ucm, guard_imports

#: Words of a vLLM command line that ask for the UCM connector.
UCM_WORDS = ("UCMConnector", "ucm.integration")


def check_early(argv: Sequence[str] | None = None) -> None:
    try:
        check_ucm()
    except ForeignUcmError as e:
        if any(word in arg for arg in (sys.argv if argv is None else argv) for word in UCM_WORDS):
            raise SystemExit(f"UCM install error: {e}") from None
        guard_imports(str(e))
        return
    from ucm.integration.vllm.plugin import check_early as check_config

    # Passed on as given: with no argv, the check also looks for the config
    # of an offline ``LLM(...)`` that is loading the plugins.
    check_config(argv)


__all__ = ["check_early"]
