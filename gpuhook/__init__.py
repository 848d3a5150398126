"""gpuhook: an OCI runtime hook that gives containers NVIDIA GPUs.

This module must stay import-light: it is imported on every container start,
including the no-GPU fast path (never import pynvml or yaml here).
"""

__version__ = "0.1.0"
