"""The engine core and its clients: ``core`` (the engine-core process's busy loop), ``core_client``
(the frontend's handle on it over ZeroMQ), ``messages`` (what travels between them), ``streams``
(request streams, queue limits and errors every client shares) and ``async_engine`` (an engine on
a thread of the caller's process)."""
