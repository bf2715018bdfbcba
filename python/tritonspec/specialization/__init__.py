"""The spec layer: FlagTree-style backend specialization installed into stock Triton.

- ``hooks``: the declared hook points (names, kinds, contracts, defaults), read everywhere.
- ``backend_info``: what a backend says about itself (targets, devices, where it really runs).
- ``providers``: who provides each backend's spec (entry points, ``register_spec``, the allow-list).
- ``resolve``: which backend's spec applies now, and ``spec`` / ``spec_func`` lookups.
- ``inject``: FlagTree's injectors, putting a backend's builtins into ``tl``.
- ``fingerprint``: a provider's identity in compile-cache keys.
- ``points``: where the hooks go into stock Triton, one module per area; ``install`` puts them there
  (``activate`` / ``deactivate``) and ``patches`` undoes them exactly.
- ``check``: ``tritonspec check``.
"""
