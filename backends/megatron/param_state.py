"""The distributed optimizer's state for a save, as views of its live tensors, at data-parallel size 1.

megatron's own `sharded_state_dict` in the "fully_reshardable" format (what `MegatronAdam` saves)
gathers every rank's optimizer shards whatever the data-parallel size: it allocates zeroed host
buffers for the whole float32 state several times over (each rank's shard, the gathered copies,
their concatenation, the world buffers), copies each parameter's master and moments to host one
synchronous `.cpu()` at a time, back to the device for the all-gather, and to host again, then
frees it all and runs `gc.collect()`. With one data-parallel rank there is nothing to gather:
each float32 master and its moments are already whole on the rank. `live` returns the same state
dict (the same keys, shard metadata, nesting and order) whose shards are views of those tensors,
so a save reads them where they are, and a snapshot (`HostCopier`) copies them device to host
once, into its reserved buffer.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory
from megatron.core.dist_checkpointing.utils import (
    add_prefix_for_sharding,
    extract_sharded_tensors_and_factories,
)
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

FORMAT = "fully_reshardable"


def applies(chained: Any) -> bool:
    """Whether `live` can describe this (chained) distributed optimizer: one data-parallel rank."""
    return all(inner.data_parallel_group.size() == 1 for inner in chained.chained_optimizers)


def live(chained: Any, model_state: Any) -> Any:
    """megatron's `ChainedOptimizer.sharded_state_dict(model_state, metadata={
    "distrib_optim_sharding_type": "fully_reshardable"})` for a save, without its copies."""
    parts = [_one(inner, model_state) for inner in chained.chained_optimizers]
    if len(parts) == 1:
        return parts[0]
    chained._synchronize_steps()
    for index, part in enumerate(parts):
        add_prefix_for_sharding(part, f"chained_{index}.")
    return dict(enumerate(parts))


def _one(inner: DistributedOptimizer, model_state: Any) -> dict[str, Any]:
    state = inner.state_dict()
    state["param_state"] = _param_state(inner, model_state)
    state["param_state_sharding_type"] = FORMAT
    return state


def _param_state(inner: DistributedOptimizer, model_state: Any) -> dict[int, dict[str, Any]]:
    """`sharded_param_state_fully_reshardable`'s result: for each model parameter, in its order
    (the grad buffers' parameters), the float32 master ("param") and each Adam moment, shaped
    as the parameter and described as its shard, under `optimizer.state.<name>.<parameter key>`."""
    shards = {
        sharded.data: sharded
        for sharded in nested_values(extract_sharded_tensors_and_factories(model_state)[0])
    }
    out: dict[int, dict[str, Any]] = {}
    for gbuf_idx, ranges in enumerate(inner.gbuf_ranges):
        assert len(ranges) == 1, "megatron's distributed optimizer holds one dtype a buffer"
        for model_param in inner.buffers[gbuf_idx].param_index_map:
            sharded = shards[model_param]
            assert sharded.flattened_range is None, f"flattened shard {sharded.key}"
            held = inner._get_main_param_and_optimizer_states(model_param)
            tensors = {}
            for name in ("param", *inner.optimizer_state_keys):
                tensor = held[name]
                assert tensor.numel() == model_param.numel(), f"{sharded.key}: {name} is not whole"
                data = tensor.detach().view(sharded.data.shape)
                fields: dict[str, Any] = dict(key=f"optimizer.state.{name}.{sharded.key}", data=data)
                if not isinstance(sharded, ShardedTensorFactory):
                    fields["dtype"] = data.dtype
                tensors[name] = replace(sharded, **fields)
                tensors[name].validate_metadata_integrity()
            out[len(out)] = tensors
    return out
