"""A vLLM general plugin that checks the UCM config before anything loads.

vLLM constructs its KV connectors only once the model's weights are loaded
and its KV cache is sized, which can take minutes; a typo in a UCM key would
fail the server only then. vLLM loads its general plugins (entry point group
``vllm.general_plugins``) in the server process while it parses its
arguments, so this plugin finds the connector config on the command line
(``--kv-transfer-config``) and in ``UCM_CONFIG_FILE`` and checks it exactly
as the connector will, failing the start at once with the key, its source
and a suggestion. Where it finds no UCM connector it does nothing; the
connector itself checks again when vLLM constructs it.

The Python ``LLM(...)`` API has no command line: vLLM loads the plugins from
``EngineArgs.__post_init__``, in the caller's process, before it starts the
engine core (whose failure would only be reported after the model loads, as
"Engine core initialization failed"). The plugin finds that ``EngineArgs``
among its callers and checks its ``kv_transfer_config`` the same way,
raising :class:`~ucm.shared.config.ConfigError` out of ``LLM(...)``.
"""

from __future__ import annotations

import inspect
import json
import sys
from collections.abc import Mapping, Sequence
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


def transfer_config_of_engine_args() -> dict[str, Any] | None:
    """The ``kv_transfer_config`` of the vLLM ``EngineArgs`` whose
    ``__post_init__`` is loading the plugins, as a dict; ``None`` when the
    plugins load from anywhere else."""
    frame = inspect.currentframe()
    while frame is not None:
        if frame.f_code.co_name == "__post_init__":
            owner = frame.f_locals.get("self")
            if type(owner).__name__.endswith("EngineArgs") and hasattr(owner, "kv_transfer_config"):
                return _as_dict(owner.kv_transfer_config)
        frame = frame.f_back
    return None


def _as_dict(transfer: Any) -> dict[str, Any] | None:
    if transfer is None:
        return None
    if isinstance(transfer, Mapping):
        return dict(transfer)
    return {
        "kv_connector": getattr(transfer, "kv_connector", None),
        "kv_connector_extra_config": getattr(transfer, "kv_connector_extra_config", None),
    }


def check_transfer_config(cfg: Mapping[str, Any] | None) -> None:
    """Checks a ``kv_transfer_config`` that names the UCM connector; raises
    :class:`~ucm.shared.config.ConfigError` naming the bad key."""
    if not cfg or cfg.get("kv_connector") != "UCMConnector":
        return
    from ucm.integration.vllm.config_check import check_config

    check_config(cfg.get("kv_connector_extra_config") or {})


def check_early(argv: Sequence[str] | None = None) -> None:
    """Entry point: raises ``SystemExit`` naming the bad key of a UCM config
    given on this process's command line, or ``ConfigError`` for one given
    to ``LLM(...)``."""
    from ucm.shared.config import ConfigError

    cfg = transfer_config_from_argv(sys.argv if argv is None else argv)
    if cfg:
        try:
            check_transfer_config(cfg)
        except ConfigError as e:
            raise SystemExit(f"UCM config error: {e}") from None
        return
    offline = transfer_config_of_engine_args() if argv is None else None
    try:
        check_transfer_config(offline)
    except ConfigError as e:
        raise ConfigError(f"UCM config error in kv_transfer_config: {e}") from None


__all__ = [
    "check_early",
    "check_transfer_config",
    "transfer_config_from_argv",
    "transfer_config_of_engine_args",
]
