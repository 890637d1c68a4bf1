"""Serving: the HTTP API (FastAPI) and the web page."""
