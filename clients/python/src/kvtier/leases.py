"""Moved to :mod:`kvtier.memory.leases`; this path stays for client.lease's
Leases: importing it gives that module itself (``sys.modules`` names both),
so settings, imports and monkeypatches of either reach one module.
"""

import sys

from .memory import leases as _moved

sys.modules[__name__] = _moved
