"""The serving loop: OpenAI / Anthropic APIs through deepseek-recipe on top of the engine.

    dsjax serve --model tiny --port 8000          # or: python -m dsjax.serving ...

loop.py (the engine thread) -> protocol.py (recipe conversions, limits) -> app.py (Starlette
routes, SSE, errors, auth) -> server.py (build + uvicorn); metrics.py (Prometheus).
"""
