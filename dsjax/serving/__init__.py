"""The serving loop: OpenAI / Anthropic APIs through deepseek-recipe on top of the engine.

    dsjax serve --model tiny --port 8000          # or: python -m dsjax.serving ...

loop.py (the engine thread) -> dsjax.protocol (recipe conversions, limits; shared with batch
jobs) -> app.py (Starlette routes, SSE, errors, auth) -> server.py (build + uvicorn);
metrics.py (Prometheus); command.py (`dsjax serve`: its flags and start-up).
"""
