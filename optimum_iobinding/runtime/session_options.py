"""A user's ``onnxruntime.SessionOptions``, kept whole in every session the project makes, and the settings the project
itself needs on them, refused by name where the user's own conflict.

ORT's Python ``SessionOptions`` can be neither copied (no ``copy``, no pickle) nor asked which session config entries
it holds (``get_session_config_entry(key)`` reads one key it is given). So a session to which the project adds
nothing is made from the user's own object, exactly as given. One to which it adds something (fixed input dims for
a captured signature, owned weights, a quiet log level) gets a copy, :func:`copy_session_options`, since what the
project adds (``add_initializer``, ``add_free_dimension_override_by_name``) cannot be taken back: added to the user's
object it would reach every later session made with it, another model's or pipeline component's included. The copy
holds every property ``SessionOptions`` has (enumerated from the class, so that one a later ORT adds is copied too)
and every session config entry among the keys ORT documents (:data:`SESSION_CONFIG_KEYS`). What a
``SessionOptions`` takes but never tells (free-dimension overrides, initializers, custom op libraries, providers
added to it, config keys ORT does not document) reaches only the sessions made from the user's own object.
"""

from __future__ import annotations

import inspect
from typing import Dict, Optional, Tuple

import onnxruntime as ort

from ..errors import ArgumentError

# The session config keys of onnxruntime_session_options_config_keys.h, and the ones onnxruntime 1.31's library reads
# beside them. A key a build does not know is simply never set on a user's object, so keys of other versions can stay.
SESSION_CONFIG_KEYS: Tuple[str, ...] = (
    # session
    "session.disable_prepacking",
    "session.use_env_allocators",
    "session.load_model_format",
    "session.save_model_format",
    "session.set_denormal_as_zero",
    "session.disable_quant_qdq",
    "session.disable_double_qdq_remover",
    "session.enable_quant_qdq_cleanup",
    "session.disable_aot_function_inlining",
    "session.graph_optimizations_loop_level",
    "session.use_device_allocator_for_initializers",
    "session.inter_op.allow_spinning",
    "session.intra_op.allow_spinning",
    "session.inter_op.spin_duration_us",
    "session.intra_op.spin_duration_us",
    "session.inter_op.spin_backoff_max",
    "session.intra_op.spin_backoff_max",
    "session.use_ort_model_bytes_directly",
    "session.use_ort_model_bytes_for_initializers",
    "session.qdqisint8allowed",
    "session.x64quantprecision",
    "session.dynamic_block_base",
    "session.force_spinning_stop",
    "session.strict_shape_type_inference",
    "session.allow_released_opsets_only",
    "session.node_partition_config_file",
    "session.intra_op_thread_affinities",
    "session.debug_layout_transformation",
    "session.disable_cpu_ep_fallback",
    "session.optimized_model_external_initializers_file_name",
    "session.optimized_model_external_initializers_min_size_in_bytes",
    "session.model_external_initializers_file_folder_path",
    "session.save_external_prepacked_constant_initializers",
    "session.collect_node_memory_stats_to_file",
    "session.resource_cuda_partitioning_settings",
    "session.qdq_matmulnbits_accuracy_level",
    "session.qdq_matmulnbits_block_size",
    "session.enable_dq_matmulnbits_fusion",
    "session.disable_qdq_constant_folding",
    "session.disable_model_compile",
    "session.fail_on_suboptimal_compiled_model",
    "session.record_ep_graph_assignment_info",
    "session.compile_only",
    "session.enable_saved_runtime_optimizations",
    "session.function_expansion_byte_limit",
    "session.function_expansion_node_limit",
    "session.gqa_value_layout",
    "session.layer_assignment_settings",
    "session.name_based_layer_assignment",
    "session.max_shape_override",
    "session.prepack.enable_parallel",
    "session.strict_workspace_verification",
    "session.use_external_initializer_file_buffers_directly",
    "session.enable_moe_expert_counting",
    "session.enable_moe_expert_statistics",
    "session.moe_expert_counter_alpha",
    "session.moe_expert_counter_beta",
    "session.moe_expert_counter_state_file",
    # optimization
    "optimization.enable_gelu_approximation",
    "optimization.enable_cast_chain_elimination",
    "optimization.memory_optimizer_config",
    "optimization.enable_memory_probe_recompute_config",
    "optimization.disable_specified_optimizers",
    "optimization.minimal_build_optimizations",
    "optimization.constant_folding_max_output_size_in_bytes",
    # execution providers
    "ep.context_enable",
    "ep.context_file_path",
    "ep.context_embed_mode",
    "ep.context_node_name_prefix",
    "ep.share_ep_contexts",
    "ep.stop_share_ep_contexts",
    "ep.context_model_external_initializers_file_name",
    "ep.enable_weightless",
    "ep.nnapi.partitioning_stop_ops",
    "ep.dynamic.workload_type",
    "ep.dynamic.qnn_htp_performance_mode",
    "ep.cuda.fpa_intb_gemm",
    "ep.cuda.fpa_intb_profile_m",
    "ep.cuda.gqa_workspace_max_total_sequence_length",
    # the CPU's math library
    "mlas.enable_gemm_fastmath_arm64_bfloat16",
    "mlas.use_lut_gemm",
    "mlas.disable_kleidiai",
    "mlas.kleidiai.conv_igemm_max_work",
    "mlas.nchwc_depthwise_sliding",
    "mlas.nchwc_pointwise_conv_max_input_channel_batch",
    "mlas.qnbit.force_fp32",
)


def session_option_properties() -> Tuple[str, ...]:
    """The settable properties of this onnxruntime's ``SessionOptions`` (``graph_optimization_level``,
    ``enable_profiling``, ``profile_file_prefix``, ``optimized_model_filepath`` …), read from the class."""
    return tuple(
        name
        for name, member in inspect.getmembers(ort.SessionOptions)
        if isinstance(member, property) and member.fset is not None
    )


def config_entry(options: ort.SessionOptions, key: str) -> Optional[str]:
    """The session config entry ``key`` of ``options``, or ``None`` where it is not set."""
    try:
        return options.get_session_config_entry(key)
    except Exception:  # ORT raises a plain RuntimeError ("does not have configuration with key") for a key not set
        return None


def session_config_entries(options: ort.SessionOptions) -> Dict[str, str]:
    """The session config entries of ``options`` among :data:`SESSION_CONFIG_KEYS`."""
    entries = {key: config_entry(options, key) for key in SESSION_CONFIG_KEYS}
    return {key: value for key, value in entries.items() if value is not None}


def copy_session_options(base: Optional[ort.SessionOptions]) -> ort.SessionOptions:
    """A new ``SessionOptions`` with every property of ``base`` and its session config entries (see the module's
    doc for what no copy can hold); ``base`` is never changed. ``None``: ORT's defaults."""
    copy = ort.SessionOptions()
    if base is None:
        return copy
    for name in session_option_properties():
        value = getattr(base, name)
        if value != getattr(copy, name):
            setattr(copy, name, value)
    for key, value in session_config_entries(base).items():
        copy.add_session_config_entry(key, value)
    return copy


def require_config_entry(options: ort.SessionOptions, key: str, value: str, why: str) -> None:
    """Sets the session config entry ``key`` of ``options`` (a copy the project made) to ``value``; a different value
    there (the user's) is refused, naming the entry, what is needed and ``why``."""
    current = config_entry(options, key)
    if current is not None and current != value:
        raise ArgumentError(
            "sess_options",
            f"its session config entry {key!r} is {current!r}, but {why} needs "
            f"{value!r}; leave it unset or set it to {value!r}",
        )
    options.add_session_config_entry(key, value)


def require_optimization_level_at_most(
    options: ort.SessionOptions, level: ort.GraphOptimizationLevel, why: str
) -> None:
    """Lowers ``graph_optimization_level`` of ``options`` (a copy the project made) to ``level`` where it is higher.
    A higher level the user chose is refused, naming the setting, what is needed and ``why``; ORT's default level
    (``ORT_ENABLE_ALL``), which no object tells apart from a user's choice of it, is lowered."""
    current = options.graph_optimization_level
    if int(current) <= int(level):
        return
    if current != ort.SessionOptions().graph_optimization_level:
        raise ArgumentError(
            "sess_options", f"its graph_optimization_level is {current.name}, but {why} needs {level.name} or lower"
        )
    options.graph_optimization_level = level
