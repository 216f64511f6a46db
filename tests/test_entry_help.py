"""What the entry points' --help shows (issue #83 item 4): a docstring that argparse prints keeps its command
examples runnable as printed (a backslash line continuation inside a plain docstring joined the lines with 9-space
gaps), and train_wan_diffusers.py lists no flag it refuses."""
import ast
import re
import shlex

import pytest

from tests.source_scan import offenders


def _joined_continuations(path) -> list:
    """Docstrings of ``path`` whose source has a backslash line continuation that Python removes (not a raw
    string): the printed text then runs the lines together."""
    src = path.read_text()
    hits = []
    for node in ast.walk(ast.parse(src)):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            seg = ast.get_source_segment(src, body[0].value) or ""
            if "\\\n" in seg and seg[:1] not in "rR":
                hits.append(getattr(node, "name", "<module>"))
    return hits


def test_docstring_continuations_are_kept():
    found = offenders(("training", "tools", "megatron_sp_ext"), _joined_continuations)
    assert not found, f"docstrings whose '\\' line continuations Python removes (make them r\"\"\"): {found}"


def _wan_entry():
    pytest.importorskip("diffusers", reason="train_wan_diffusers.py needs diffusers")
    from training import train_wan_diffusers as entry  # noqa: PLC0415
    return entry


def test_wan_help_lists_no_refused_flag_and_still_refuses_them(capsys):
    entry = _wan_entry()
    text = entry.build_parser().format_help()
    listed = [f for f in entry.VIDEO_DIT_ONLY if re.search(rf"{re.escape(f)}\b", text)]
    assert not listed, f"--help lists flags the entry refuses: {listed}"
    assert "--bf16" in text and "--frames" in text   # the shared flags it takes are still listed
    for flag, value in (("--modulation", "linear"), ("--pack-samples", None), ("--max-tokens-per-step", "64"),
                        ("--sample-steps", "2")):
        with pytest.raises(SystemExit):
            entry.parse([flag] + ([value] if value else []))
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and flag in err and "unrecognized" not in err, err


def test_wan_help_example_parses_as_printed(monkeypatch):
    """The command in the help text, copied as shown (continuation lines and all), is a valid command line."""
    entry = _wan_entry()
    monkeypatch.setenv("WORLD_SIZE", "2")   # its torchrun --nproc-per-node 2
    text = entry.build_parser().format_help()
    start = text.index("torchrun ")
    lines = []
    for line in text[start:].splitlines():
        lines.append(line.strip())
        if not line.rstrip().endswith("\\"):
            break
    assert len(lines) > 1 and all(re.search(r"\S {2,}\S", ln) is None for ln in lines), lines
    argv = shlex.split(" ".join(ln.removesuffix("\\") for ln in lines))   # the shell's line continuation
    args = entry.parse(argv[argv.index("training/train_wan_diffusers.py") + 1:])
    assert args.model == "wan-1.3b" and args.use_torch_fsdp2 and args.save_pretrained == "runs/wan/final"


def test_hide_names_only_shared_flags():
    import argparse  # noqa: PLC0415

    from training.video_dit.cli import add_common_args  # noqa: PLC0415
    with pytest.raises(ValueError, match="--no-such-flag"):
        add_common_args(argparse.ArgumentParser(), hide=("--sample-steps", "--no-such-flag"))


def test_deepspeed_entry_refuses_bf16_flag_naming_the_json_key(capsys):
    """#83 item 4's remainder: the DeepSpeed entry's precision is its JSON's; --bf16 (the other entries' autocast) was
    listed and ignored there (fp32 under a flag saying bf16): now refused by name, pointing at the JSON key, and not
    listed by --help."""
    import pytest
    from training import train_deepspeed
    with pytest.raises(SystemExit) as e:
        train_deepspeed.parse(["--bf16"])
    assert e.value.code == 2
    assert '"bf16": {"enabled": true}' in capsys.readouterr().err
    with pytest.raises(SystemExit):
        train_deepspeed.parse(["--help"])
    assert "--bf16" not in capsys.readouterr().out
