"""``mlxterm serve``: the engine behind an OpenAI-compatible HTTP API.

One job per module: ``errors`` (OpenAI-style error bodies), ``requests`` (request bodies to
engine requests), ``toolcalls`` (tools in, ``tool_calls`` out), ``shapes`` (response objects),
``streaming`` (a request's events as SSE chunks), ``app`` (the Starlette routes, auth and
admission) and ``server`` (binding and running it under uvicorn).
"""
