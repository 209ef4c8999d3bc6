"""OpenAI-compatible aiohttp server: `serve(engine_config, host, port, api_key)` and `build_app(async_engine)`.

Imported lazily so `import minidsa.server` stays cheap and does not pull in aiohttp until it is used.
"""

__all__ = ["AsyncEngine", "build_app", "serve"]


def __getattr__(name: str):
    if name in ("build_app", "serve"):
        from minidsa.server import app

        return getattr(app, name)
    if name == "AsyncEngine":
        from minidsa.server.async_engine import AsyncEngine

        return AsyncEngine
    raise AttributeError(f"module 'minidsa.server' has no attribute {name!r}")
