"""Integrations of UCM into inference engines (:mod:`ucm.integration.vllm`)."""
