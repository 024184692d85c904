"""`glassformer serve`: an OpenAI-compatible HTTP API on the engine (seed 002's API, against a model
you can look inside), with continuous batching, and the browser lab at `/`.

app.py holds the app and the generation routes (responses.py shapes their replies),
embeddings.py and tokenize.py the other /v1 and vLLM routes, requests.py what every route does
with a request first, protocol.py the request models and errors, scheduler.py the engine thread,
metrics.py the Prometheus text.
"""
