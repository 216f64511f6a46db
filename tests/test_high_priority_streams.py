"""--high-priority-stream-groups on the Megatron DiT entry (Megatron-LM's flag of the same name, passed to
megatron-core's initialize_model_parallel): refused by name without CUDA, group names checked, parsed where CUDA is."""
from __future__ import annotations

import pytest
import torch

BASE = ["--model", "tiny", "--frames", "2", "--latent-size", "8x8", "--train-iters", "1", "--quiet"]


def test_refused_by_name_without_cuda(capsys, monkeypatch):
    from training.pretrain_video_dit import parse
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit):
        parse([*BASE, "--high-priority-stream-groups", "cp"])
    err = capsys.readouterr().err
    assert "--high-priority-stream-groups sets the priority of NCCL's CUDA streams" in err and "Traceback" not in err


def test_groups_parsed_and_checked_where_cuda_is(capsys, monkeypatch):
    from training.pretrain_video_dit import HIGH_PRIORITY_GROUPS, parse
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert parse([*BASE, "--high-priority-stream-groups", "cp", "dp_cp"]).high_priority_stream_groups == \
        ["cp", "dp_cp"]
    assert parse(BASE).high_priority_stream_groups is None and "cp" in HIGH_PRIORITY_GROUPS
    with pytest.raises(SystemExit):
        parse([*BASE, "--high-priority-stream-groups", "ring"])
    assert "invalid choice: 'ring'" in capsys.readouterr().err
