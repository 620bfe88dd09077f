"""Moved to :mod:`kvtier.connectors.lmcache`; this path stays for LMCache's
remote_storage_plugin setting: importing it gives that module itself
(``sys.modules`` names both), so settings, imports and monkeypatches of
either reach one module.
"""

import sys

from .connectors import lmcache as _moved

sys.modules[__name__] = _moved
