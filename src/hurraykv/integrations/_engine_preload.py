"""Imported once by the engine runs' fork server (``engine_run.run``): what every engine
process needs and takes seconds to import, nothing that starts threads or engines."""

import vllm
import vllm.v1.engine.llm_engine  # noqa: F401
from vllm import LLM, SamplingParams  # noqa: F401
from vllm.inputs import TokensPrompt  # noqa: F401
