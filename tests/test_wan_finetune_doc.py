"""docs/wan_finetune.md, the fine-tuning recipe: every prepare and trainer command in it parses with the commands'
own parsers (flags renamed since the recipe was written would fail here), and it names the LoRA loading call."""
import os
import re
import shlex

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(ROOT, "docs", "wan_finetune.md")


def _commands(marker: str) -> list:
    """The argument lists after ``marker`` in the doc's bash blocks (line continuations joined, comments cut)."""
    text = open(DOC).read()
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            if marker in line:
                tail = line.split(marker, 1)[1].split(" #")[0]
                if "..." not in tail:   # a sketch with elided flags is not a command
                    out.append(shlex.split(tail))
    return out


def test_trainer_commands_parse():
    pytest.importorskip("diffusers")
    from training import train_wan_diffusers as entry
    cmds = _commands("train_wan_diffusers.py")
    assert len(cmds) >= 2, "the recipe's trainer commands are missing"
    for args in cmds:
        ns = entry.build_parser().parse_args(args)
        assert ns.lora_rank > 0 and ns.save_lora, args


def test_prepare_commands_parse():
    pytest.importorskip("diffusers")
    from training.wan_diffusers import prepare
    cmds = [c for c in _commands("training.wan_diffusers.prepare") if "--output" in c]
    assert cmds, "the recipe's prepare command is missing"
    for args in cmds:
        prepare.build_parser().parse_args(args)


def test_recipe_loads_the_lora_in_plain_diffusers():
    assert "load_lora_weights" in open(DOC).read()
