"""Layer 1: the enable transaction (``enable.py``), one path from checked options to a live
handle, and what it puts on the target itself (``installs.py``): the handle mark and a
pipeline's subclass, taken off again by ``disable()``."""
