"""Moved to :mod:`kvtier.connectors.mooncake`; this path stays for the Mooncake
call forms: importing it gives that module itself (``sys.modules`` names
both), so settings, imports and monkeypatches of either reach one module.
"""

import sys

from .connectors import mooncake as _moved

sys.modules[__name__] = _moved
