"""OpenAI-compatible HTTP server (`kvserve serve`): FastAPI app, request schemas, streaming, auth.

config.py    ServerConfig: every server option, and the CLI flags derived from it
protocol.py  pydantic request schemas (what the OpenAPI document shows)
errors.py    OpenAI-style error objects; no traceback ever reaches a client
serving.py   request -> SamplingParams -> AsyncEngine -> JSON / SSE responses
app.py       routes, auth, lifespan (engine thread start/stop), run_server
"""
