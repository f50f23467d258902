"""vLLM's HF renderer for an engine that sees token ids only (``skip_tokenizer_init=True``).

vLLM 0.32's ``LLM.__init__`` always warms up chat-template rendering
(``entrypoints/llm.py``: ``self.renderer.warmup(...)``; ``renderers/base.py``
``BaseRenderer.warmup``), which renders a chat through the tokenizer. Without one,
``HfRenderer.render_messages`` raises ``ValueError: Tokenizer not available when
skip_tokenizer_init=True`` and the warmup logs it with a traceback at every engine start. This
renderer is the HF renderer with that chat warmup skipped while there is no tokenizer (there is
no chat to render); the multimodal warmup still runs. Importing this module registers it, as
``tokenizer_mode=TOKEN_IDS_MODE`` (the mode names the renderer in vLLM's registry; with
``skip_tokenizer_init`` no tokenizer is loaded in any mode).
"""

from __future__ import annotations

from vllm.renderers.hf import HfRenderer
from vllm.renderers.registry import RENDERER_REGISTRY

TOKEN_IDS_MODE = "vapo_token_ids"
"""The ``tokenizer_mode`` to start an engine with ``skip_tokenizer_init=True`` under."""


class TokenIdsRenderer(HfRenderer):
    def warmup(self, chat_params) -> None:
        if self.tokenizer is not None:
            super().warmup(chat_params)
        else:
            self.warmup_mm()


if TOKEN_IDS_MODE not in RENDERER_REGISTRY.renderers:
    RENDERER_REGISTRY.register(TOKEN_IDS_MODE, __name__, TokenIdsRenderer.__name__)
