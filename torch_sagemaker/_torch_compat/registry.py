"""Every private PyTorch name the layer touches, for ``tests/unit/test_torch_compat.py``.

Each entry is a dotted path: its longest importable prefix is a module, the rest are
attributes looked up in turn. An attribute that PyTorch sets on each instance rather than on
the class (``FullyShardedDataParallel._handle``, ``nn.Module._parameters``, ...) is named on
its class, and the test looks it up on an instance it builds. Add an entry with every private
name a module of the layer starts to use; the test then fails on a torch that lacks it.
"""

from __future__ import annotations

_C10D = "torch.distributed.distributed_c10d"
_FSDP1 = "torch.distributed.fsdp"
_FLAT_PARAM = "torch.distributed.fsdp._flat_param"
_FSDP2_PARAM_GROUP = "torch.distributed.fsdp._fully_shard._fsdp_param_group.FSDPParamGroup"
_CHECKPOINT_WRAPPER = "torch.distributed.algorithms._checkpoint.checkpoint_wrapper"

PRIVATE_NAMES: tuple[str, ...] = (
    # the compiled core, reached by autograd.py and dtensor.py
    "torch._C",
    # aten.py
    "torch.ops.aten._scaled_dot_product_flash_attention_for_cpu",
    "torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward",
    # autograd.py
    "torch._C._current_graph_task_id",
    "torch.autograd.Variable._execution_engine",
    # compile.py
    "torch._check",
    # c10d.py
    f"{_C10D}._get_object_coll_device",
    f"{_C10D}._get_default_store",
    f"{_C10D}._get_default_group",
    "torch._C._distributed_c10d",
    "torch._C._distributed_c10d._create_work_from_future",
    f"{_C10D}._get_default_timeout",
    f"{_C10D}._new_process_group_helper",
    f"{_C10D}._world",
    f"{_C10D}._world._default_pg",
    f"{_C10D}._world.pg_map",
    f"{_C10D}._world.pg_group_ranks",
    "torch.distributed.ProcessGroup._get_backend",
    "torch._C._distributed_c10d.Backend.Options._timeout",
    "torch.distributed._functional_collectives.all_reduce",
    "torch.distributed._functional_collectives.wait_tensor",
    "torch._C._distributed_c10d._get_work_registry_size",
    "torch.distributed._functional_collectives.AsyncCollectiveTensor",
    "torch.distributed._functional_collectives.AsyncCollectiveTensor.completed",
    "torch.distributed._functional_collectives.AsyncCollectiveTensor.elem",
    # checkpoint_wrapper.py
    _CHECKPOINT_WRAPPER,
    f"{_CHECKPOINT_WRAPPER}.ActivationWrapper",
    f"{_CHECKPOINT_WRAPPER}.ActivationWrapper._checkpoint_wrapped_module",
    f"{_CHECKPOINT_WRAPPER}.CheckpointImpl",
    f"{_CHECKPOINT_WRAPPER}.CheckpointWrapper",
    f"{_CHECKPOINT_WRAPPER}.OffloadWrapper",
    f"{_CHECKPOINT_WRAPPER}.apply_activation_checkpointing",
    f"{_CHECKPOINT_WRAPPER}.checkpoint_wrapper",
    f"{_CHECKPOINT_WRAPPER}.offload_wrapper",
    # dcp.py
    "torch.distributed.checkpoint._nested_dict.flatten_state_dict",
    "torch.distributed.checkpoint._nested_dict.unflatten_state_dict",
    "torch.distributed.checkpoint.utils._DistWrapper",
    # device_mesh.py
    "torch.distributed.device_mesh.DeviceMesh._concatenate",
    "torch.distributed.device_mesh.DeviceMesh._flatten",
    "torch.distributed.device_mesh.DeviceMesh._unflatten",
    # dtensor.py
    "torch._C._clear_DTensor_sharding_propagator_cache",
    "torch.distributed.tensor.DTensor._op_dispatcher",
    "torch.distributed.tensor.DTensor._op_dispatcher._allow_implicit_replication",
    "torch.distributed.tensor._redistribute.clear_redistribute_planner_cache",
    "torch.distributed.tensor._redistribute._gen_transform_infos",
    "torch.distributed.tensor._collective_utils.MeshTopoInfo.build_from_mesh",
    "torch.distributed.tensor.placement_types._StridedShard",
    "torch.distributed.tensor._utils.compute_local_shape_and_global_offset",
    # float8.py
    "torch._scaled_mm",
    # fsdp1.py
    f"{_FSDP1}._common_utils.clean_tensor_name",
    f"{_FSDP1}._common_utils.FSDP_PREFIX",
    f"{_FSDP1}._common_utils._is_fsdp_flattened",
    f"{_FSDP1}.ShardingStrategy._HYBRID_SHARD_ZERO2",
    f"{_FSDP1}.MixedPrecision._module_classes_to_ignore",
    f"{_FSDP1}.wrap._Policy",
    f"{_FSDP1}.wrap._Policy._run_policy",
    f"{_FSDP1}.wrap._or_policy",
    f"{_FSDP1}.FullyShardedDataParallel._handle",
    f"{_FSDP1}.FullyShardedDataParallel._fsdp_extension",
    f"{_FSDP1}.FullyShardedDataParallel._state_dict_type",
    f"{_FSDP1}.FullyShardedDataParallel._state_dict_config",
    f"{_FSDP1}.FullyShardedDataParallel._comm_hook",
    f"{_FSDP1}.FullyShardedDataParallel._device_handle",
    f"{_FSDP1}._runtime_utils._reduce_grad",
    f"{_FSDP1}._runtime_utils._reduce_grad_no_shard",
    f"{_FSDP1}._state_dict_utils._set_use_dtensor",
    f"{_FSDP1}._state_dict_utils.init_from_local_shards",
    "torch.distributed._shard.sharded_tensor.Shard",
    f"{_FLAT_PARAM}.FlatParamHandle",
    f"{_FLAT_PARAM}.FlatParamHandle._use_unsharded_views",
    f"{_FLAT_PARAM}.FlatParamHandle._use_unsharded_grad_views",
    f"{_FLAT_PARAM}.FlatParamHandle._get_unflat_views",
    f"{_FLAT_PARAM}.FlatParamHandle._init_flat_param_and_metadata",
    f"{_FLAT_PARAM}.FlatParamHandle._setattr_param",
    f"{_FLAT_PARAM}.FlatParamHandle._use_orig_params",
    f"{_FLAT_PARAM}.FlatParamHandle._fsdp_extension",
    f"{_FLAT_PARAM}.FlatParamHandle._reduce_dtype",
    f"{_FLAT_PARAM}.FlatParamHandle._offload_params",
    f"{_FLAT_PARAM}.FlatParamHandle._keep_low_precision_grads",
    f"{_FLAT_PARAM}.FlatParameter",
    f"{_FLAT_PARAM}.FlatParameter._params",
    f"{_FLAT_PARAM}.FlatParameter._param_infos",
    f"{_FLAT_PARAM}.FlatParameter._shard_param_infos",
    f"{_FLAT_PARAM}.FlatParameter._param_extensions",
    f"{_FLAT_PARAM}.FlatParameter._fqns",
    f"{_FLAT_PARAM}.FlatParameter._shared_param_infos",
    f"{_FLAT_PARAM}.FlatParameter._shared_params",
    f"{_FLAT_PARAM}.FlatParameter._modules",
    f"{_FLAT_PARAM}.ParamInfo",
    f"{_FLAT_PARAM}.SharedParamInfo",
    f"{_FLAT_PARAM}._ShardParamInfo",
    # fsdp2.py
    _FSDP2_PARAM_GROUP,
    f"{_FSDP2_PARAM_GROUP}._all_gather_process_group",
    f"{_FSDP2_PARAM_GROUP}._reduce_scatter_process_group",
    "torch.distributed.fsdp.FSDPModule._get_fsdp_state",
    "torch.distributed.fsdp._fully_shard._fsdp_state.FSDPState._fsdp_param_group",
    "torch.distributed.fsdp._fully_shard._fsdp_state.FSDPState._lazy_init",
    # nn.py
    "torch.nn.utils.stateless._reparametrize_module",
    "torch.nn.Module._parameters",
    "torch.nn.Module._buffers",
    "torch.nn.Module._state_dict_pre_hooks",
    "torch.nn.Module._register_state_dict_hook",
    # pytree.py
    "torch.utils._pytree.tree_leaves",
    # signals.py
    "torch._C._set_print_stack_traces_on_fatal_signal",
    # tensor.py
    "torch.Tensor._base",
    "torch.Tensor._values",
    "torch.Tensor._version",
    "torch.distributed.tensor.DTensor._local_tensor",
)

__all__ = ["PRIVATE_NAMES"]


#: Private attributes PyTorch sets on an instance only in some states, which the test's sample
#: instances do not reach: a hybrid unit's replica group, a root's streams and a handle's
#: optimizer-in-backward flag (both made at the first forward), and a flat parameter's
#: sharded gradient between its reduction and the end of backward. Each is (the module that
#: sets it, the attribute); the test looks for the assignment in that module's source.
STATEFUL_NAMES: tuple[tuple[str, str], ...] = (
    (f"{_FSDP1}._init_utils", "_inter_node_pg"),
    (f"{_FSDP1}._runtime_utils", "_saved_grad_shard"),
    (f"{_FSDP1}._runtime_utils", "_all_reduce_stream"),
    (f"{_FSDP1}._runtime_utils", "_has_optim_in_backward"),
)
