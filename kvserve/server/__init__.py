"""OpenAI-compatible HTTP server (`kvserve serve`): FastAPI app, request schemas, streaming, auth.

config.py               ServerConfig: every server option, and the CLI flags derived from it
protocol.py             pydantic request schemas (what the OpenAPI document shows)
errors.py               OpenAI-style error objects; no traceback ever reaches a client
serving_base.py         the shared base: checks, request -> SamplingParams, tenants, chat templates,
                        engine-client submit / collect, SSE helpers, engine errors -> HTTP errors
serving_completions.py  /v1/completions
serving_chat.py         /v1/chat/completions
serving_tokenize.py     /v1/tokenize, /v1/detokenize
serving_pins.py         /v1/prefix/pin, /v1/prefix/unpin, /v1/prefix/pins
app.py                  routes, auth, lifespan (engine client start/stop)
launcher.py             `kvserve serve`: the engine core process, the front-end process(es), signals
"""
