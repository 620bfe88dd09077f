"""vLLM: the offloading tier (``offloading``, vLLM's ``spec_module_path``)
and the KV connector (``connector``, its ``kv_connector_module_path``), a
dispatcher to its scheduler side (``scheduler``) and its worker side
(``worker``), with their parts: what one step moves (``transfer``), vLLM's
metadata and the request state (``plan``), hybrid models' KV cache groups
and per-rank namespaces (``groups``), the lookups' deadlines (``lookup``),
when blocks move (``mover``), how they are copied (``blocks``), and the
digest and byte oracle (``verify``). The worker side and everything it uses
import torch but not vLLM. Nothing is imported here: importing the package
must not import vLLM."""
