"""Tools for testing code that uses UCM; public API.

* :mod:`.conformance` -- the store conformance suite: the checks every store
  backend passes, to run against a store of your own (its docstring shows
  how). UCM's own tests run it against every built-in backend.

Nothing in :mod:`ucm` outside this package imports it. UCM's own test and
benchmark helpers are not here: they live with the tests
(``python/tests/support``) and are not product API.
"""
