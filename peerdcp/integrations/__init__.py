"""Integrations of peerdcp into serving frameworks.

``peerdcp.integrations.sglang`` is the SGLang general plugin (entry-point group ``sglang.srt.plugins``);
see ``docs/sglang.md``. Nothing here is imported by ``import peerdcp``.
"""
