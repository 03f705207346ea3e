"""The engine core and its process: EngineCore.step, the busy loop in its own process, the clients
that reach it (in-process, sync and async ZeroMQ), its launcher and the wire format between them."""
