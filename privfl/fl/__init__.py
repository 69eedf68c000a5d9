"""The machinery every federated method is built on, kept apart from the methods themselves (``privfl/methods``):

- :mod:`privfl.fl.method`: the method contract, :class:`FLMethod`, read by role (declarations, server side,
  client side; ``docs/writing-a-method.md``), its environment (:class:`FLEnv`, :class:`Client`, :class:`DataView`,
  :class:`ModelRequest`, :class:`LeakageContext`), :class:`GlobalModelServer` and the method registry;
- :mod:`privfl.fl.trainer`: the shared local training loop (:class:`LocalTrainer`);
- :mod:`privfl.fl.layout`, :mod:`privfl.fl.parallel`, :mod:`privfl.fl.shared`: memory layout, clients trained
  at once in threads, copy-on-write client state;
- building blocks several methods share: :mod:`privfl.fl.headserver` (a server that aggregates heads),
  :mod:`privfl.fl.prototypes` (class prototypes), :mod:`privfl.fl.entangle` (FedRE's entangled representations),
  :mod:`privfl.fl.finch` (FINCH clustering, for FPL).
"""
