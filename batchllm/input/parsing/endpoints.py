"""The OpenAI endpoints a batch line may name (its `url`), in one table: each one's body, the
row kind and job task its lines run as, and what answers it. Validation, the Batch API and the
export all read it (docs/batch-api.md lists the same)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict

from batchllm.input.formats.schemas import (
    OpenAIChatBody,
    OpenAIClassifyBody,
    OpenAICompletionBody,
    OpenAIEmbeddingBody,
    OpenAIRerankBody,
    OpenAIScoreBody,
    RequestKind,
)
from batchllm.input.parsing.responses import OpenAIResponsesBody
from batchllm.spec import CLASSIFY, EMBED, GENERATE, NonEmptyStr, Task


@dataclass(frozen=True)
class Endpoint:
    url: str
    body: type[BaseModel]  # its lines' `body`
    kind: RequestKind  # the row kind its lines are stored as
    task: Task  # the job task that runs them (one task per job)
    response_object: str | None  # the `object` of the body answering a line (none for rerank)
    # Its lines are text pairs: an embedding job scores them as the cosine of the texts'
    # vectors (input/formats/scoring.py), a classification job with a cross-encoder (metadata task).
    pairs: bool = False


CHAT_COMPLETIONS = Endpoint(
    "/v1/chat/completions", OpenAIChatBody, "chat", GENERATE, "chat.completion"
)
COMPLETIONS = Endpoint(
    "/v1/completions", OpenAICompletionBody, "prompt", GENERATE, "text_completion"
)
EMBEDDINGS = Endpoint("/v1/embeddings", OpenAIEmbeddingBody, "embed", EMBED, "list")
# A chat request whose stored settings mark it, so the export answers with a Response.
RESPONSES = Endpoint("/v1/responses", OpenAIResponsesBody, "chat", GENERATE, "response")
SCORE = Endpoint("/v1/score", OpenAIScoreBody, "score", EMBED, "list", pairs=True)
RERANK = Endpoint("/v1/rerank", OpenAIRerankBody, "score", EMBED, None, pairs=True)
CLASSIFICATION = Endpoint("/v1/classify", OpenAIClassifyBody, "classify", CLASSIFY, "list")

ENDPOINTS = (CHAT_COMPLETIONS, COMPLETIONS, EMBEDDINGS, RESPONSES, SCORE, RERANK, CLASSIFICATION)
BY_URL = {endpoint.url: endpoint for endpoint in ENDPOINTS}
URLS = tuple(BY_URL)

if TYPE_CHECKING:
    EndpointUrl = str
else:  # the table's urls as a Literal: a refusal lists them, in pydantic's wording
    EndpointUrl = Literal[URLS]


class OpenAIBatchLine(BaseModel):
    """The OpenAI batch line form: `body` is checked against its endpoint's model."""

    model_config = ConfigDict(extra="forbid")

    custom_id: NonEmptyStr
    method: Literal["POST"]
    url: EndpointUrl
    body: dict[str, Any]

    @property
    def endpoint(self) -> Endpoint:
        return BY_URL[self.url]


def endpoint_of(obj: Any) -> Endpoint | None:
    """The endpoint a decoded line names; None for a line naming none, or another url."""
    url = obj.get("url") if isinstance(obj, dict) else None
    return BY_URL.get(url) if isinstance(url, str) else None


def is_embedding_line(obj: Any) -> bool:
    """Whether a decoded line is an embedding request ({"input": ...} or OpenAI's
    /v1/embeddings), which only an embedding job runs."""
    return isinstance(obj, dict) and (
        endpoint_of(obj) is EMBEDDINGS or ("input" in obj and not {"method", "body"} & obj.keys())
    )


def is_score_line(obj: Any) -> bool:
    """Whether a decoded line is a /v1/score or /v1/rerank request, which an embedding job
    runs (input/formats/scoring.py says why), or with a cross-encoder a classification job."""
    endpoint = endpoint_of(obj)
    return endpoint is not None and endpoint.pairs


def is_classify_line(obj: Any) -> bool:
    return endpoint_of(obj) is CLASSIFICATION


def task_of_line(obj: dict[str, Any]) -> Task:
    """The task a decoded line asks for: embed for embedding, score and rerank lines,
    classify for /v1/classify lines, else generate."""
    if is_classify_line(obj):
        return CLASSIFY
    return EMBED if is_embedding_line(obj) or is_score_line(obj) else GENERATE


def batch_task(url: str, metadata_task: str | None) -> Task:
    """The task of a batch of `url` lines (generate for a url not in the table); a
    pair-scoring batch asks for a cross-encoder's classify in its metadata."""
    endpoint = BY_URL.get(url)
    if endpoint is None:
        return GENERATE
    return CLASSIFY if endpoint.pairs and metadata_task == CLASSIFY else endpoint.task
