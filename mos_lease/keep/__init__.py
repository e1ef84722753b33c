r"""The keep engine: keeping N >= 1 leases alive, written once.

:class:`~mos_lease.supervisor.Supervisor` and :class:`~mos_lease.supervisor.AsyncSupervisor`
are its public face; :func:`~mos_lease.hold` is the engine with one binding, a wait deadline,
a takeover policy and a ``with`` block; the keepers (:class:`~mos_lease.LeaseKeeper`) are the
engine with one binding already held. The modules:

* the pure parts: ``timing`` (a lease's deadline arithmetic: when to renew, retry, or count
  it lost), ``campaign`` (the campaign rule), ``schedule`` (the decisions for all bindings,
  indexed by its ``timeline``\ s) with the values of ``slots`` (the bindings, their state and
  the calls to make), reporting the ``changes``;
* the turn written once as a generator of store calls (``turn``), its part for a member of a
  fleet (``fleet``), a planned hand-off (``handover``), a grant for a binding
  (``granting``), the one notice subscription (``notices``);
* the runner (``runner``): the asyncio supervisor, and the thread one generated from it by
  ``tools/async_to_sync.py``, over the thread and asyncio ``primitives`` (with the health of
  their renewal connections in ``lanes``) and what they share in ``supervising``;
* the facades: ``hold`` (with ``hold_options`` and the two holders of ``holding``) and the
  keepers (``keeper``, ``keeper_calls``, ``thread_keeper``, ``asyncio_keeper``).

The public names are re-exported by :mod:`mos_lease.supervisor`, :mod:`mos_lease.holder`,
:mod:`mos_lease.keeper` and :mod:`mos_lease`.
"""
