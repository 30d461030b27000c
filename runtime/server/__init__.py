"""OpenAI-compatible HTTP serving over one `LLMEngine`: `build_app(engine, ServerConfig(...))` in
`runtime.server.app`; `python -m runtime.serve` is the command line.

    config.py          ServerConfig (what the app takes)
    protocol.py        request bodies (pydantic) and the OpenAI error object
    engine_messages.py what handlers and the engine thread exchange: requests, commands, sinks
    engine_loop.py     the one thread that owns and steps the engine
    text.py            cumulative text -> stream deltas, stop strings
    metrics.py         Prometheus metrics
    request_inputs.py  a request body checked and turned into prompts and SamplingParams
    choices.py         an answer as it grows (Job, Choice) and its OpenAI JSON shape
    generation.py      one API request: submit its prompts, stream or collect the answer
    app.py             FastAPI routes, errors, lifespan
    http_server.py     uvicorn whose shutdown drains, then aborts, the engine loop

Kept free of heavy imports: `runtime.cli` imports `runtime.server.config` for the Hydra schema.
"""
