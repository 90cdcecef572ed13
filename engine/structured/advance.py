"""Advancing a constrained request's matcher with its committed tokens.

The scheduler calls `advance_grammar` for each output token it appends (drafts reach it only
once kept), so the matcher always matches `output_token_ids`. A token the grammar refuses
(possible only if the mask left nothing allowed) puts the matcher in its error state, which
counts as terminated (its mask then allows only EOS) and is logged. A terminated grammar is
not advanced further.
"""

from __future__ import annotations

import logging

from engine.core.request import Request

logger = logging.getLogger(__name__)


def advance_grammar(request: Request, token_id: int) -> None:
    grammar = request.grammar
    if grammar is None or grammar.is_terminated:
        return  # complete (only EOS followed) or failed: nothing more to follow
    if not grammar.accept_token(token_id):
        logger.warning(
            "request %s: token %d refused by its grammar (%s); finishing it",
            request.request_id, token_id, grammar.error,
        )
