"""Helpers shared by the test modules (importable as ``support``: pytest puts
``python/tests`` on the path, see ``pythonpath`` in ``pyproject.toml``).

* :mod:`.store_helpers` -- the block geometry and config of the store tests;
* :mod:`.py_stores` -- stores written in Python (a dict store for pipelines);
* :mod:`.remote_helpers` -- block data and transfers of the S3 and NFS tests;
* :mod:`.servers` -- real S3 (moto) and NFS (Ganesha) servers, two vLLM
  engines sharing a store;
* :mod:`.engines` -- vLLM engines in child processes for the end-to-end tests;
* :mod:`.kernel_checks` -- tolerances and seeding of the Triton kernel tests;
* :mod:`.offload_sim` -- an engine-free simulation of an offloading method.
"""
