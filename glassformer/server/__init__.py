"""`glassformer serve`: an OpenAI-compatible HTTP API on the engine (seed 002's API, against a model
you can look inside), with continuous batching, and the browser lab at `/`.

app.py holds the routes, protocol.py the request models and errors, scheduler.py the engine
thread, metrics.py the Prometheus text.
"""
