"""SPConfig validation: every error names the setting as the user wrote it."""
import pytest

from megatron_sp_ext.config import SPConfig, parse_head_chunks
from megatron_sp_ext.errors import SPConfigError
from megatron_sp_ext.sp.heads import head_layout, split_more_first


def test_defaults_and_parse():
    c = SPConfig()
    assert c.mode == "ulysses" and c.head_chunks == 1
    assert parse_head_chunks("auto") == "auto" and parse_head_chunks("3") == 3
    assert SPConfig(mode="ulysses", head_chunks=2).mode == "hcms"


@pytest.mark.parametrize("source,name", [("python", "head_chunks="), ("megatron", "--hcms-head-chunks="),
                                         ("deepspeed", "sequence_parallel_ext.head_chunks=")])
def test_errors_name_the_setting(source, name):
    with pytest.raises(SPConfigError, match=name):
        SPConfig(head_chunks=0, source=source)


def test_bad_values():
    with pytest.raises(SPConfigError, match="mode='bogus'.*ulysses"):
        SPConfig(mode="bogus")
    with pytest.raises(SPConfigError, match="sequence_parallel_ext.mode='x'"):
        SPConfig.from_deepspeed_config({"sequence_parallel_ext": {"mode": "x"}})
    with pytest.raises(SPConfigError, match="sequence_parallel_ext.chunks is not a known setting"):
        SPConfig.from_deepspeed_config({"sequence_parallel_ext": {"chunks": 2}})
    with pytest.raises(SPConfigError, match="sequence_parallel_size=3 does not divide the world size 8"):
        SPConfig(source="deepspeed").validate_world(3, world_size=8)
    with pytest.raises(SPConfigError, match="--hcms-head-chunks=4 exceeds"):
        SPConfig(mode="hcms", head_chunks=4, source="megatron").validate_world(4, num_heads=12)


def test_symm_mem_transport_is_checked():
    assert SPConfig(mode="hcms", head_chunks=2, transport="symm_mem").transport == "symm_mem"
    with pytest.raises(SPConfigError, match="sequence_parallel_ext.transport='symm_mem' applies to the ulysses/hcms"):
        SPConfig(mode="ring", transport="symm_mem", source="deepspeed")
    assert SPConfig(mode="hcms", head_chunks=2, transport="copy_engine").transport == "copy_engine"
    with pytest.raises(SPConfigError, match="--sp-transport='ib' is invalid: choose one of nccl, symm_mem, copy_engine"):
        SPConfig(transport="ib", source="megatron")


def test_head_layouts():
    assert split_more_first(10, 4) == (3, 3, 2, 2)
    hl = head_layout(6, 6, 4, 1)
    assert hl.q_counts == (2, 2, 1, 1) and not hl.even
    g = head_layout(8, 2, 4, 1)  # GQA kv < P: kv replicated x2
    assert g.kv_repeat == 2 and g.kv_counts == (1, 1, 1, 1) and g.q_counts == (2, 2, 2, 2)
    g1 = head_layout(16, 4, 4, 1)
    assert g1.kv_repeat == 1 and g1.kv_counts == (1,) * 4
    g2 = head_layout(16, 4, 4, 2)  # two chunks need two kv heads per rank: replicate x2
    assert g2.kv_repeat == 2 and g2.kv_counts == (2,) * 4 and g2.q_chunks[0] == ((0, 2), (2, 2))
    with pytest.raises(SPConfigError, match="head_chunks=5 exceeds the heads per rank"):
        head_layout(16, 4, 4, 5, "head_chunks")
    h = head_layout(40, 40, 4, 3)
    assert [s for _, s in h.q_chunks[0]] == [4, 3, 3]


def test_async_qkv_forms():
    assert SPConfig(async_qkv="allgather").async_qkv == "allgather"
    assert SPConfig(async_qkv=True).async_qkv == "on"
    with pytest.raises(SPConfigError, match="--sp-async-qkv='fused' is invalid: choose one of off, on, allgather, auto"):
        SPConfig(async_qkv="fused", source="megatron")
    with pytest.raises(SPConfigError, match="sequence_parallel_ext.async_qkv='allgather' is not available through "
                                            "DeepSpeed"):
        SPConfig(async_qkv="allgather", source="deepspeed")
