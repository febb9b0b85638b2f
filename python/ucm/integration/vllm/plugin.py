"""A vLLM general plugin that checks the UCM config before anything loads.

vLLM constructs its KV connectors only once the model's weights are loaded
and its KV cache is sized, which can take minutes; a typo in a UCM key would
fail the server only then. vLLM loads its general plugins (entry point group
``vllm.general_plugins``) in the server process while it parses its
arguments, so this plugin finds the connector config on the command line
(``--kv-transfer-config``) and in ``UCM_CONFIG_FILE`` and checks it exactly
as the connector will, failing the start at once with the key, its source
and a suggestion. Where it finds no UCM connector it does nothing; the
connector itself checks again when vLLM constructs it (the Python ``LLM``
API passes its config there).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from typing import Any

FLAGS = ("--kv-transfer-config", "--kv_transfer_config")


def transfer_config_from_argv(argv: Sequence[str]) -> dict[str, Any] | None:
    """The ``--kv-transfer-config`` JSON of a vLLM command line, if any."""
    for i, arg in enumerate(argv):
        for flag in FLAGS:
            if arg == flag and i + 1 < len(argv):
                raw = argv[i + 1]
            elif arg.startswith(flag + "="):
                raw = arg[len(flag) + 1 :]
            else:
                continue
            try:
                value = json.loads(raw)
            except json.JSONDecodeError:
                return None  # vLLM reports its own argument errors
            return value if isinstance(value, dict) else None
    return None


def check_early(argv: Sequence[str] | None = None) -> None:
    """Entry point: raises ``SystemExit`` naming the bad key of a UCM config
    given on this process's command line."""
    cfg = transfer_config_from_argv(sys.argv if argv is None else argv)
    if not cfg or cfg.get("kv_connector") != "UCMConnector":
        return
    from ucm.integration.vllm.config_check import check_config
    from ucm.shared.config import ConfigError

    try:
        check_config(cfg.get("kv_connector_extra_config") or {})
    except ConfigError as e:
        raise SystemExit(f"UCM config error: {e}") from None


__all__ = ["check_early", "transfer_config_from_argv"]
