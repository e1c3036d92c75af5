"""moesub: which expert misses are worth waiting for?

Cache / substitution policies for Mixture-of-Experts models whose experts do not all fit in fast
memory: one C++ policy core (`moesub.policy`) drives the simulator, the exact emulator and the
real offloading engine.
"""

__version__ = "0.1.0"
