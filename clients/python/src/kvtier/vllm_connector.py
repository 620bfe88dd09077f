"""Moved to :mod:`kvtier.connectors.vllm.connector`; this path stays for vLLM's
kv_transfer_config kv_connector_module_path: importing it gives that module
itself (``sys.modules`` names both), so settings, imports and monkeypatches
of either reach one module.
"""

import sys

from .connectors.vllm import connector as _moved

sys.modules[__name__] = _moved
