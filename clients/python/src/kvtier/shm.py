"""Moved to :mod:`kvtier.memory.shm`; this path stays for SharedBuffer and the
buffer helpers: importing it gives that module itself (``sys.modules`` names
both), so settings, imports and monkeypatches of either reach one module.
"""

import sys

from .memory import shm as _moved

sys.modules[__name__] = _moved
