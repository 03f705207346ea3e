"""The OpenAI-compatible HTTP front end: `build_app(engine, settings)` returns the FastAPI app that
`raypage api-server` runs under uvicorn and that the Ray Serve ingress mounts."""

from cluster.openai.app import ServerSettings, build_app

__all__ = ["ServerSettings", "build_app"]
