"""Moved to :mod:`kvtier.connectors.sglang`; this path stays for SGLang's
HiCache storage backend setting: importing it gives that module itself
(``sys.modules`` names both), so settings, imports and monkeypatches of
either reach one module.
"""

import sys

from .connectors import sglang as _moved

sys.modules[__name__] = _moved
