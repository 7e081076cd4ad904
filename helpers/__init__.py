"""Troubleshooting multi-GPU training with Hugging Face Accelerate: the logic behind the notebooks.

Light on import: torch, accelerate and matplotlib are imported inside the functions that need
them, and importing ``helpers`` loads only the CUDA watch (standard library), so
``python -m helpers lint`` or ``facts`` start in a fraction of a second. The module map is in
``helpers/README.md``.
"""

__version__ = "0.1.0"

from helpers.cuda_watch import install_cuda_watch as _install_cuda_watch

_install_cuda_watch()
