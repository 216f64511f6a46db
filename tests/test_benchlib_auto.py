"""tools/benchlib.AutoDecisions: the library's auto decisions captured while a block runs, also when the block
replaces the logger's handlers and level (as the entries' setup_logging does); nothing captured after it."""
from __future__ import annotations

import logging

from tools.benchlib import AutoDecisions


def test_captures_auto_decisions_through_a_handler_reset():
    lg = logging.getLogger("megatron_sp_ext")
    before, handlers = lg.level, list(lg.handlers)
    try:
        _run(lg, before)
    finally:
        lg.handlers[:] = handlers
        lg.setLevel(before)


def _run(lg, before):
    with AutoDecisions() as d:
        lg.info("megatron_sp_ext: auto mode -> hcms for (1,) (reason)")
        lg.handlers[:] = [logging.NullHandler()]   # what setup_logging does
        lg.setLevel(logging.INFO)
        lg.info("megatron_sp_ext: head_chunks=auto -> 2 for q(1,) (reason)")
        lg.info("megatron_sp_ext: something else")
    lg.info("megatron_sp_ext: auto mode -> ring after the block")
    assert d.messages == ["megatron_sp_ext: auto mode -> hcms for (1,) (reason)",
                          "megatron_sp_ext: head_chunks=auto -> 2 for q(1,) (reason)"]
    assert lg.level == before and d not in lg.filters
