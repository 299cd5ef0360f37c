"""The pooling routes over AsyncEngineClient: embeddings, pooling, score, rerank, classify. Each one tokenizes
and checks every input first (a bad one fails the request with a 400 naming the field before anything runs),
then runs them all as pooling requests and answers with vLLM's response shapes."""
from __future__ import annotations

import asyncio
import base64
import json
import os
import uuid
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from pagedserve.common.errors import RequestError
from pagedserve.common.params.pooling_params import PoolingParams, check_pooling_task
from pagedserve.frontend.http.admission import Admission
from pagedserve.frontend.client.async_client import AsyncEngineClient
from pagedserve.frontend.client.input_processor import PreparedRequest, ProcessedPrompt
from pagedserve.frontend.client.outputs import RequestOutput
from pagedserve.frontend.pooling import requests as pooling
from pagedserve.frontend.pooling.outputs import decode_vector
from pagedserve.frontend.pooling.protocol import (ClassificationRequest, EmbeddingRequest, PoolingRequest,
                                                  RerankRequest, ScoreRequest, listing, rerank_response)


class PoolingServing:
    def __init__(self, engine: AsyncEngineClient, model_name: str, admission: Admission,
                 check_model: Any) -> None:
        self.engine, self.model_name, self.admission, self.check_model = engine, model_name, admission, check_model
        self._labels: dict[int, str] | None = None

    # ---------------------------------------------------------------- routes

    async def embeddings(self, body: EmbeddingRequest, task: str = "embed") -> JSONResponse:
        params = PoolingParams(task=task, dimensions=body.dimensions, normalize=body.normalize,
                               truncate_prompt_tokens=body.truncate_prompt_tokens)
        outs, used = await self._run_inputs(body, params)
        kind = "embedding" if task == "embed" else "pooling"
        data = []
        for i, out in enumerate(outs):
            # base64: the engine's little-endian float32 bytes as they are (what OpenAI's clients decode)
            value = (base64.b64encode(out.pooling_output).decode() if body.encoding_format == "base64"
                     else decode_vector(out.pooling_output).tolist())
            data.append({"index": i, "object": kind, ("embedding" if task == "embed" else "data"): value})
        prefix = "embd" if task == "embed" else "pool"
        return JSONResponse(listing(f"{prefix}-{uuid.uuid4().hex}", self.model_name, data, used))

    async def classify(self, body: ClassificationRequest) -> JSONResponse:
        params = PoolingParams(task="classify", truncate_prompt_tokens=body.truncate_prompt_tokens)
        outs, used = await self._run_inputs(body, params)
        data = []
        for i, out in enumerate(outs):
            probs = decode_vector(out.pooling_output).tolist()
            best = max(range(len(probs)), key=probs.__getitem__)
            data.append({"index": i, "label": self._label(best), "probs": probs, "num_classes": len(probs)})
        return JSONResponse(listing(f"classify-{uuid.uuid4().hex}", self.model_name, data, used))

    async def score(self, body: ScoreRequest) -> JSONResponse:
        self.check_model(body.model)
        scores, used = await self._scores(pooling.score_pairs(body.text_1, body.text_2), body)
        data = [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)]
        return JSONResponse(listing(f"score-{uuid.uuid4().hex}", self.model_name, data, used))

    async def rerank(self, body: RerankRequest) -> JSONResponse:
        """Documents by relevance to the query, best first (top_n of them; 0: all)."""
        self.check_model(body.model)
        if not body.documents:
            raise RequestError.at("documents", "must not be empty")
        scores, used = await self._scores([(body.query, d) for d in body.documents], body)
        order = sorted(range(len(scores)), key=lambda i: -scores[i])[:body.top_n or len(scores)]
        results = [{"index": i, "relevance_score": scores[i],
                    **({"document": {"text": body.documents[i]}} if body.return_documents else {})} for i in order]
        return JSONResponse(rerank_response(f"rerank-{uuid.uuid4().hex}", self.model_name, results, used))

    # ---------------------------------------------------------------- running

    async def _run_inputs(self, body: Any, params: PoolingParams) -> tuple[list[RequestOutput], int]:
        self.check_model(body.model)
        info = self.engine.info
        check_pooling_task(params, info.pooling_tasks, info.is_matryoshka, info.matryoshka_dimensions)
        items = _inputs(body.input)
        prompts = [await self._tokenize(pooling.tokenize_input, item, params.truncate_prompt_tokens) for item in items]
        return await self._run([self._prepare(p, params, body.priority) for p in prompts])

    async def _scores(self, pairs: list[tuple[str, str]], body: Any) -> tuple[list[float], int]:
        """A cross-encoder scores each pair as one prompt; an embedding model embeds both texts (cosine)."""
        truncate = body.truncate_prompt_tokens
        if "score" in self.engine.info.pooling_tasks:
            params = PoolingParams(task="score", truncate_prompt_tokens=truncate)
            jobs = []
            for a, b in pairs:
                prompt, types = await self._tokenize(pooling.tokenize_pair, a, b, truncate)
                jobs.append(self._prepare(prompt, params.clone(token_type_ids=types), body.priority))
            outs, used = await self._run(jobs)
            return [float(decode_vector(o.pooling_output)[0]) for o in outs], used
        params = PoolingParams(task="embed", truncate_prompt_tokens=truncate)
        check_pooling_task(params, self.engine.info.pooling_tasks, False, None)
        texts = [t for pair in pairs for t in pair]
        prompts = [await self._tokenize(pooling.tokenize_input, t, truncate) for t in texts]
        outs, used = await self._run([self._prepare(p, params, body.priority) for p in prompts])
        return [pooling.cosine_score(outs[2 * i], outs[2 * i + 1], "").outputs.score for i in range(len(pairs))], used

    async def _tokenize(self, fn: Any, *args: Any) -> Any:
        """fn(input processor, *args) on the engine client's tokenizer thread (the event loop keeps serving)."""
        return await self.engine.run_tokenizer(fn, self.engine.processors.input, *args)

    def _prepare(self, prompt: ProcessedPrompt, params: PoolingParams, priority: int) -> PreparedRequest:
        return pooling.prepare_pooling(self.engine.processors.input, f"pool-{uuid.uuid4().hex}", prompt, params,
                                       priority)

    async def _run(self, jobs: list[PreparedRequest]) -> tuple[list[RequestOutput], int]:
        """Every job's final output, in order, and the prompt tokens they used (usage)."""
        self.admission.check()
        leave = self.admission.enter()
        try:
            outs = await asyncio.gather(*(self._final(job) for job in jobs))
        finally:
            leave()
        return list(outs), sum(len(job.prompt.prompt_token_ids) for job in jobs)

    async def _final(self, job: PreparedRequest) -> RequestOutput:
        last = None
        async for out in self.engine.stream(job):
            last = out
        if last is None or last.pooling_output is None:
            raise RuntimeError(f"pooling request {job.request_id} ended without a pooled output")
        return last

    def _label(self, index: int) -> str:
        """The class name from the model's config.json id2label, as vLLM answers (LABEL_i without one)."""
        if self._labels is None:
            path = os.path.join(self.engine.info.model_path, "config.json")
            try:
                with open(path) as f:
                    self._labels = {int(k): v for k, v in (json.load(f).get("id2label") or {}).items()}
            except (OSError, ValueError):
                self._labels = {}
        return self._labels.get(index, f"LABEL_{index}")


def _inputs(value: Any) -> list[Any]:
    """One prompt (a string or token ids) or a list of them."""
    if isinstance(value, str):
        return [value]
    if not value:
        raise RequestError.at("input", "must not be empty")
    if all(isinstance(t, int) for t in value):
        return [list(value)]
    return list(value)


def add_pooling_routes(app: FastAPI, engine: AsyncEngineClient, model_name: str, admission: Admission,
                       check_model: Any) -> None:
    serving = PoolingServing(engine, model_name, admission, check_model)

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest) -> JSONResponse:
        return await serving.embeddings(body)

    @app.post("/pooling")
    async def pooling_route(body: PoolingRequest) -> JSONResponse:
        return await serving.embeddings(body, task="encode")

    @app.post("/classify")
    async def classify(body: ClassificationRequest) -> JSONResponse:
        return await serving.classify(body)

    for path in ("/score", "/v1/score"):
        app.post(path)(serving.score)
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        app.post(path)(serving.rerank)
