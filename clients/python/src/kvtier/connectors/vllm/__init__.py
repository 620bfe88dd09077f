"""vLLM: the offloading tier (``offloading``, vLLM's ``spec_module_path``)
and the KV connector (``connector``, its ``kv_connector_module_path``) with
its parts: what the scheduler sends the workers and the per-rank
namespaces (``plan``), hybrid models' KV cache groups (``groups``), the
lookups' deadlines (``lookup``), when blocks move (``mover``), how they are
copied (``blocks``), and the digest and byte oracle (``verify``). Nothing is
imported here: importing the package must not import vLLM."""
