"""The HTTP side: an OpenAI-compatible FastAPI app over a Scheduler.

POST /v1/completions, POST /v1/chat/completions (streamed as server-sent events of OpenAI chunks
ending with `data: [DONE]`, or whole), GET /v1/models, GET /health, GET /metrics (Prometheus).
Client errors are 400 with an OpenAI error object, a full queue 429 with Retry-After, a closing
server 503; a client that goes away cancels its request (its slot is freed at the next chunk).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from typing import AsyncIterator

from fastapi import FastAPI, Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ddtree_jax.serve import protocol
from ddtree_jax.serve.chat import ChatTemplate
from ddtree_jax.serve.metrics import Metrics
from ddtree_jax.serve.protocol import BadRequest, Job, Limits, error_body
from ddtree_jax.serve.scheduler import Closed, Delta, Finish, QueueFull, Scheduler

DISCONNECT_POLL_S = 0.25


def _error(status: int, message: str, err_type: str = "invalid_request_error", param=None, code=None,
           headers=None) -> JSONResponse:
    return JSONResponse(error_body(message, err_type, param, code), status_code=status, headers=headers)


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def create_app(scheduler: Scheduler, limits: Limits, tokenizer, template: ChatTemplate | None, metrics: Metrics,
               info: dict | None = None, retry_after_s: int = 1) -> FastAPI:
    """The app; its lifespan starts the scheduler's thread and stops it (cancelling what is left).
    info: what /health reports about the server besides its load (mode, slots, device)."""
    created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(app):
        if not scheduler.alive:
            scheduler.start()
        try:
            yield
        finally:
            await asyncio.to_thread(scheduler.stop)

    app = FastAPI(title="ddtree-serve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, exc: StarletteHTTPException):
        return _error(exc.status_code, str(exc.detail), "invalid_request_error" if exc.status_code < 500 else
                      "server_error")

    @app.exception_handler(RequestValidationError)
    async def validation_error(request, exc: RequestValidationError):
        return _error(400, f"invalid request: {exc.errors()}")

    @app.exception_handler(Exception)
    async def internal_error(request, exc: Exception):
        return _error(500, f"internal error: {type(exc).__name__}: {exc}", "server_error")

    @app.get("/health")
    async def health():
        if not scheduler.alive:
            return _error(503, "the scheduler is not running", "server_error")
        return {"status": "ok", "active": scheduler.active, "queued": scheduler.queued, **(info or {})}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": limits.model, "object": "model", "created": created,
                                            "owned_by": "ddtree-jax", "max_model_len": limits.max_context}]}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=metrics.content_type)

    @app.post("/v1/completions")
    async def completions(request: HttpRequest):
        return await _generate(request, "completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: HttpRequest):
        return await _generate(request, "chat")

    async def _generate(request: HttpRequest, endpoint: str):
        try:
            raw = await request.body()
            try:
                body = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise BadRequest(f"the request body is not valid JSON: {e}", code="invalid_json") from e
            job = (protocol.parse_chat(body, limits, tokenizer, template) if endpoint == "chat"
                   else protocol.parse_completion(body, limits, tokenizer))
            handle = scheduler.submit(job.request, asyncio.get_running_loop())
        except BadRequest as e:
            metrics.on_request(endpoint, e.status)
            return _error(e.status, e.message, param=e.param, code=e.code)
        except QueueFull as e:
            metrics.on_request(endpoint, 429)
            return _error(429, str(e), "rate_limit_error", code="queue_full",
                          headers={"Retry-After": str(retry_after_s)})
        except Closed as e:
            metrics.on_request(endpoint, 503)
            return _error(503, str(e), "server_error", code="shutting_down",
                          headers={"Retry-After": str(retry_after_s)})
        metrics.on_request(endpoint, 200)
        rid = protocol.new_id(job.chat)
        if job.stream:
            return StreamingResponse(_events(handle, job, rid), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await _whole(request, handle, job, rid)

    async def _whole(request: HttpRequest, handle, job: Job, rid: str):
        texts, ids = [], []
        try:
            while True:
                try:
                    event = await asyncio.wait_for(handle.events.get(), DISCONNECT_POLL_S)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        handle.cancel()
                        return Response(status_code=499)
                    continue
                if isinstance(event, Delta):
                    texts.append(event.text)
                    ids.extend(event.token_ids)
                    continue
                if event.reason in ("cancelled", "error"):
                    status = 503 if event.reason == "cancelled" else 500
                    return _error(status, event.message or event.reason, "server_error")
                return protocol.response(job, rid, limits.model, "".join(texts), ids, event.reason,
                                         event.prompt_tokens, event.completion_tokens)
        finally:
            handle.cancel()  # no-op once finished; frees the slot when the handler is cancelled

    async def _events(handle, job: Job, rid: str) -> AsyncIterator[str]:
        model = limits.model
        try:
            if job.chat:
                yield _sse(protocol.chunk(job, rid, model, "", [], None, role=True))
            while True:
                event = await handle.events.get()
                if isinstance(event, Delta):
                    if event.text or job.return_token_ids:
                        yield _sse(protocol.chunk(job, rid, model, event.text, event.token_ids, None))
                    continue
                assert isinstance(event, Finish)
                if event.reason in ("cancelled", "error"):
                    yield _sse(error_body(event.message or event.reason, "server_error"))
                else:
                    yield _sse(protocol.chunk(job, rid, model, None if job.chat else "", None, event.reason))
                    if job.include_usage:
                        yield _sse(protocol.usage_chunk(job, rid, model, event.prompt_tokens,
                                                        event.completion_tokens))
                yield "data: [DONE]\n\n"
                return
        finally:
            handle.cancel()  # a disconnect cancels this generator: the slot is freed at the next chunk

    return app
