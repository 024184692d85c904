"""A real `glassformer serve` process for the tests that drive it over HTTP (the official
openai client, raw httpx, a browser): the lab's helper (glassformer/lab/serving.py), one
implementation for both: a free loopback port, one torch thread, /health polled until it
answers."""

from __future__ import annotations

from glassformer.lab.serving import free_port, start_server, stop_server

__all__ = ["free_port", "start_server", "stop_server"]
