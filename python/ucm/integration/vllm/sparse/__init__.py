"""Sparse methods (:mod:`ucm.sparse`) inside vLLM: everything vLLM-specific.

* :mod:`.bridge` -- the one route: the connector's bridge creates the method
  and sets up what it declares it needs;
* :mod:`.model_info` -- vLLM's config read into the
  :class:`~ucm.sparse.base.SparseModelInfo` a method is built from;
* :mod:`.hooks` -- installing wrappers on this engine's objects (version
  gate, attention and allocation wrappers, undone at shutdown);
* :mod:`.steps` -- per-step request facts sent from the scheduler to the workers;
* :mod:`.offload` (scheduler) and :mod:`.selection` (worker) -- the
  selecting methods: offloaded blocks released, swap loads, sparse attention;
* :mod:`.blend` (scheduler), :mod:`.blend_worker` and :mod:`.rerope` -- the
  plans and model patches of the methods that declare chunk reuse, row
  cutting or un-rotated keys;
* :mod:`.state` -- the process's method instance, for hooks given no driver.
"""
