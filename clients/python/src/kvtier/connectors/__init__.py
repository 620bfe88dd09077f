"""The engines' connectors over :class:`kvtier.Client`: what they share
(``core``, ``shared_host``), LMCache's remote storage plugin (``lmcache``),
Mooncake's call forms (``mooncake``), SGLang's HiCache backend
(``sglang``) and vLLM's (``vllm``: the offloading tier, the KV connector and
its parts)."""
