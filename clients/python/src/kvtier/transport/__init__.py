"""How blocks travel: the one transport interface (``base``), HTTP (``http``
over the keep-alive pool of ``http_pool``), the same-host socket (``unix``
over the session of ``session``, whose one connection is ``local``, the
native one, with the shared index of ``shared_index``), which one serves a
call (``link``), and backoff, written once (``retry``)."""
