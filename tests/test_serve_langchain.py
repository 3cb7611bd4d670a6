"""A client nobody here wrote: LangChain's `ChatOpenAI` against `dlm serve`, used as its documentation
shows (invoke and stream, with usage), so that what frameworks send is accepted."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("fastapi", reason="fastapi is not installed (pip install -e '.[serve-test]')")
pytest.importorskip("greenlet", reason="greenlet is not installed (pip install -e '.[serve-test]')")
langchain_openai = pytest.importorskip(
    "langchain_openai", reason="langchain-openai is not installed (pip install -e '.[serve-test]')"
)

import test_serve  # noqa: E402
from test_serve import WAIT, running  # noqa: E402

pytestmark = pytest.mark.serve_extra
model_dir = pytest.fixture(scope="module")(test_serve.model_dir.__wrapped__)


def test_langchain_chat_openai_invokes_and_streams(model_dir: Path) -> None:
    with running(model_dir, api_key="sesame") as handle:
        chat = langchain_openai.ChatOpenAI(
            model="model",
            base_url=f"{handle.url}/v1",
            api_key="sesame",
            max_tokens=8,
            seed=5,
            temperature=0.7,
            timeout=WAIT,
            max_retries=0,
            stream_usage=True,
        )
        messages = [("system", "You are a player."), ("human", "Who art thou?")]
        answer = chat.invoke(messages)
        assert isinstance(answer.content, str) and answer.response_metadata["finish_reason"] in ("stop", "length")
        assert answer.usage_metadata is not None and 0 < answer.usage_metadata["output_tokens"] <= 8
        chunks = list(chat.stream(messages))
        streamed = "".join(str(chunk.content) for chunk in chunks)
        assert streamed == answer.content  # the same seed, the same text, sent piece by piece
        usage = [chunk.usage_metadata for chunk in chunks if chunk.usage_metadata]
        assert usage and usage[-1]["output_tokens"] == answer.usage_metadata["output_tokens"]
        handle.assert_healthy()
