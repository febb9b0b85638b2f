"""UCM for vLLM: the ``UCMConnector`` KV connector and its tooling.

* :mod:`.ucm_connector` -- ``UCMConnector`` (name it with
  ``kv_connector_module_path="ucm.integration.vllm.ucm_connector"``);
* :mod:`.scheduler`, :mod:`.worker` -- its two halves; :mod:`.transfer` --
  the steps of every KV transfer (shard plan, host staging, the store
  calls); :mod:`.saves` -- saves in flight; :mod:`.layout` -- where each
  block of each layer lives in vLLM's KV cache; :mod:`.metadata`;
* :mod:`.sparse` -- the sparse methods inside vLLM (the bridge and its parts);
* :mod:`.config` -- config sources and priority; :mod:`.store_handle` -- the
  store, kept usable; :mod:`.stats` -- metrics carried to vLLM's ``/metrics``;
* :mod:`.cli` -- ``vllm`` CLI that also works with the CPU build.

Engines in child processes, the README's main job and random-weight
models are :mod:`ucm.vllm_demo`.

Importing this package does not import vLLM.
"""
