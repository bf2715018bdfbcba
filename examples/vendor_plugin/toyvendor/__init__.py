"""toyvendor: an out-of-tree tritonspec vendor (a Triton backend in ``backend``, its spec in ``spec``).

Deliberately empty: Triton's backend discovery and tritonspec's registry import the subpackages
they name, and neither should pay for the other.
"""
