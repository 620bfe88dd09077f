"""Moved to :mod:`kvtier.transport.local`; this path stays for the same-host
connection (tests and tools speak the protocol with it): importing it gives
that module itself (``sys.modules`` names both), so settings, imports and
monkeypatches of either reach one module.
"""

import sys

from .transport import local as _moved

sys.modules[__name__] = _moved
