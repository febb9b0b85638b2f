"""``ucm proxy``: one OpenAI endpoint in front of prefill and decode engines
(prefill/decode disaggregation over a shared UCM store)."""

from __future__ import annotations

import click


def _urls(values: tuple[str, ...]) -> list[str]:
    return [u for v in values for u in v.split(",") if u]


@click.command()
@click.option(
    "--prefill",
    "prefill",
    multiple=True,
    required=True,
    metavar="URL",
    help="A prefill engine (ucm serve --kv-role producer); repeat or comma-separate.",
)
@click.option(
    "--decode",
    "decode",
    multiple=True,
    required=True,
    metavar="URL",
    help="A decode engine (ucm serve --kv-role consumer); repeat or comma-separate.",
)
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8000, show_default=True, type=int)
@click.option(
    "--health-interval", default=5.0, show_default=True, type=float, help="Seconds between checks."
)
@click.option(
    "--prefill-timeout",
    default=300.0,
    show_default=True,
    type=float,
    help="Seconds a prefill may take before the decode engine computes the prompt itself.",
)
def proxy(
    prefill: tuple[str, ...],
    decode: tuple[str, ...],
    host: str,
    port: int,
    health_interval: float,
    prefill_timeout: float,
) -> None:
    """Route /v1/completions and /v1/chat/completions to a prefill engine,
    then a decode engine that loads the prompt's KV from the shared store.
    GET /metrics serves the proxy's requests, phase times and engine errors
    in Prometheus text format.

    Example: `ucm proxy --prefill http://p1:8100 --decode http://d1:8200,http://d2:8200`
    """
    from ucm.integration.vllm.proxy import ProxyConfig, run

    try:
        config = ProxyConfig(
            prefill=_urls(prefill),
            decode=_urls(decode),
            host=host,
            port=port,
            health_interval_s=health_interval,
            prefill_timeout_s=prefill_timeout,
        )
    except ValueError as e:
        raise click.BadParameter(str(e)) from e
    run(config)
