"""The launch-time refusal of row-parallel AP blocks whose TP shards would split a group (serving/startup_check.py):
every family's row-parallel names are checked, Gemma-4's dense MLP (kept as the shared expert) included."""

from __future__ import annotations

import pytest

from pagedweight.format.layout import BlockSpec
from pagedweight.serving.startup_check import PagedWeightStartupError, _check_row_parallel_shards


class _Ckpt:
    """What the check reads of an AP checkpoint: block names and their specs."""

    def __init__(self, blocks: dict[str, int], dense: dict[str, int], group: int) -> None:
        self.blocks, self.dense, self.group = blocks, dense, group

    def names(self) -> list[str]:
        return sorted(self.blocks)

    def dense_names(self) -> list[str]:
        return sorted(self.dense)

    def spec(self, name: str) -> BlockSpec:
        k = {**self.blocks, **self.dense}[name]
        return BlockSpec(64, k, 2, 8, "ubcq", self.group)


@pytest.mark.parametrize("name", [
    "model.language_model.layers.0.mlp.down_proj",  # Gemma-4 (multimodal): the dense MLP as the shared expert
    "model.layers.3.mlp.down_proj",  # Gemma-4 text-only
    "model.layers.0.mlp.shared_expert.down_proj",  # Qwen2-MoE
    "model.layers.1.mlp.shared_experts.down_proj",  # DeepSeek / GLM
    "model.language_model.layers.2.self_attn.o_proj",  # a dense attention output (scope all)
])
def test_a_row_parallel_block_split_inside_a_group_is_refused(name):
    # 256 inputs at group 128 over 4 ranks: 64 each, half a group
    ckpt = _Ckpt({name: 256, "model.layers.0.mlp.experts.0.down_proj": 256}, {}, 128)
    with pytest.raises(PagedWeightStartupError, match=rf"{name} has 256 inputs, so each rank would keep 64"):
        _check_row_parallel_shards(ckpt, 4)
    _check_row_parallel_shards(ckpt, 2)  # 128 each: whole groups
    _check_row_parallel_shards(ckpt, 1)


def test_routed_experts_and_column_parallel_blocks_are_not_checked():
    # routed experts are split by expert / by SGLang's MoE layer, gate/up and q/k/v by output rows
    ckpt = _Ckpt({"model.layers.0.mlp.experts.0.down_proj": 256, "model.layers.0.mlp.gate_proj": 256},
                 {"model.layers.0.self_attn.q_proj": 256}, 128)
    _check_row_parallel_shards(ckpt, 4)
