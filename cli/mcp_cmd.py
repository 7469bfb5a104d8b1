"""`cag mcp`: cag's corpora as an MCP server on stdin/stdout, for assistants and IDE agents (api/mcp_server.py)."""

from __future__ import annotations

from cag.cli.common import ModelOpt, StoreOpt, handle_errors


@handle_errors
def mcp(model: ModelOpt = None, store: StoreOpt = None):
    """Serve cag over the Model Context Protocol on stdin/stdout, for an assistant or IDE agent that starts it.

    Tools: list_corpora (names, freshness, tokens, size, shards); ask_corpus (corpus, question, mode cag / cag+rag / full / rag, max_tokens: the answer with its token counts and, where the mode reads passages, the passages and their documents); corpus_status (freshness with its reasons).

    In a desktop assistant's configuration: {"mcpServers": {"cag": {"command": "cag", "args": ["mcp"]}}}, with CAG_HOME and other CAG_* settings in "env" where they differ from the defaults. Ingest corpora first (`cag ingest`).

    Only the protocol goes to stdout. The model loads in the background; the first question waits for it. Over HTTP, `cag serve` answers the same tools at /mcp (streamable HTTP, behind CAG_API_KEYS when set)."""  # noqa: E501 (help text: its line breaks show)
    from cag.api.mcp_server import serve_stdio
    from cag.api.settings import load_api_settings
    from cag.config import get_settings

    serve_stdio(load_api_settings(), get_settings(model=model, store=store))  # a bad setting: one line, exit 1
