# Copyright (c) the DeepSpeed ZeRO-3 fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The compatibility-matrix cell each test validates (unit/cells.py records them per run; tools/cells.py prints
the matrix). Kept here, not as markers in the test files, so that those files run unchanged under upstream's
harness, which has no `cell` marker.

A key is a test id relative to tests/ (a file, file::Class, file::Class::test or file::Class::test[params]); it
applies to every test under it, and a longer key overrides a shorter one. A parametrize argument named after an
axis (stage, precision, checkpoint, settings, ...) fills that axis; a list value means the test covers each of
those cells (e.g. checkpoint=["rigid", "universal"]). Axes left out take unit/cells.py's DEFAULTS."""

ALIAS = "unit/v1/zero/test_zero3_master_alias.py"
SERIAL = "unit/checkpoint/test_zero3_serial_load.py"
ZERO3 = "unit/checkpoint/test_zero_resume_fp32_masters.py"
AUTOTP = "unit/checkpoint/test_universal_zero3_autotp.py"
ONE_FORMAT = "unit/checkpoint/test_universal_one_format.py"
ZERO12 = "unit/checkpoint/test_zero12_resume_fp32_masters.py"
NVME = "unit/checkpoint/test_zero3_nvme_resume.py"
RESHARD = "unit/checkpoint/test_zero3_reshard.py"
LAYOUT_REFUSALS = "unit/checkpoint/test_zero3_rigid_layout_refusals.py"
TP_RESHARD = "unit/checkpoint/test_zero3_tensor_parallel_reshard.py"
TP_LAYOUT = "unit/checkpoint/test_zero3_tensor_parallel_layout.py"
OWN_PARTITION = "unit/checkpoint/test_zero3_own_partition_load.py"
READER = "unit/checkpoint/test_zero3_checkpoint_reader.py"
LAYOUT_CHANGE = "unit/checkpoint/test_zero3_layout_change.py"
HP_LINK = "unit/runtime/zero/test_zero12_hp_link_param_groups.py"
LOAD_TAG = "unit/checkpoint/test_zero3_load_tag.py"
FP32_FALSE = "unit/checkpoint/test_zero3_load_from_fp32_weights.py"
FROZEN = "unit/checkpoint/test_zero_frozen_module_load.py"
REFUSALS = "unit/checkpoint/test_zero_load_refusals.py"
ZERO12_BY_NAME = "unit/checkpoint/test_zero12_resume_by_name.py"
ZERO12_FULL_BY_NAME = "unit/checkpoint/test_zero12_full_resume_by_name.py"
UNIVERSAL_FLAGS = "unit/checkpoint/test_universal_zero12_load_flags.py"
ZERO12_RESHARD = "unit/checkpoint/test_zero12_reshard.py"
ZERO_INIT_LAYOUT = "unit/checkpoint/test_autotp_zero_init_layout.py"
ZERO_INIT_TP = "unit/checkpoint/test_zero3_tensor_parallel_zero_init.py"
CRASH = "unit/checkpoint/test_checkpoint_crash_consistency.py"
CONTENT_ENGINES = "unit/checkpoint/test_checkpoint_content_engines.py"

# yapf: disable
CELLS = {
    # 0001: master and weight partitions shared
    ALIAS: dict(feature="master-alias", stage=3),
    f"{ALIAS}::TestMasterPartitionIdentity::test_separate_master_with_optimizer_offload": dict(offload="cpu"),
    f"{ALIAS}::TestOffloadReloadRoundTrips": dict(offload="offload_states"),
    # 0002: serial checkpoint load
    SERIAL: dict(feature="serial-load", stage=3, precision="bf16"),
    f"{SERIAL}::TestSerialLoadOneNode": dict(checkpoint=["rigid", "universal"]),
    f"{SERIAL}::TestSerialLoadOneNode::test_failure_inside_the_chain_fails_every_rank": dict(checkpoint="rigid"),
    f"{SERIAL}::TestSerialLoadTwoNodes": dict(checkpoint=["rigid", "universal"], layout="none, 2 nodes x 2 ranks"),
    # 0003: ZeRO-3 consolidating loads read the tag asked for
    LOAD_TAG: dict(feature="resume older tag", stage=3, precision="bf16", checkpoint="rigid"),
    # 0004: ZeRO-3 honours load_from_fp32_weights=false
    FP32_FALSE: dict(feature="load_from_fp32_weights=false", stage=3, precision="bf16"),
    f"{FP32_FALSE}::TestZero3LoadFromFp32WeightsFalse::test_default_restores_the_saved_masters":
        dict(checkpoint="rigid"),
    # 0005: loads with frozen parameters
    FROZEN: dict(feature="frozen parameters", precision="bf16", checkpoint="rigid", layout="trainable set"),
    f"{FROZEN}::TestZero3FrozenModuleLoad": dict(stage=3),
    f"{FROZEN}::TestZero3FrozenModuleLoad::test_frozen_at_save_and_load": dict(stage=3, layout="none, frozen"),
    f"{FROZEN}::TestZero3FrozenModuleLoad::test_frozen_at_another_dp_size": dict(stage=3, layout="dp2->dp1, frozen"),
    f"{FROZEN}::TestZero2FrozenModuleLoad": dict(stage=2),
    # 0008: a load one rank cannot carry out is refused on every rank
    REFUSALS: dict(feature="load refused on every rank", precision="fp32", checkpoint="rigid", layout="none"),
    f"{REFUSALS}::TestRefusedOnEveryRank::test_missing_shard_of_one_rank":
        dict(checkpoint="rigid, shard missing on one rank"),
    f"{REFUSALS}::TestRefusedOnEveryRank::test_truncated_shard_on_one_rank":
        dict(stage=3, checkpoint="rigid, truncated shard on one rank"),
    f"{REFUSALS}::TestRefusedAcrossATensorParallelGrid":
        dict(stage=3, checkpoint="rigid, shard missing on one rank", layout="none, TP2 x DP2"),
    # 0009: ZeRO-3 fresh-optimizer resume
    ZERO3: dict(feature="resume", stage=3, precision="bf16"),
    f"{ZERO3}::TestZero3ResumeRejected": dict(checkpoint="rigid"),
    f"{ZERO3}::TestZero3ResumeRejected::test_dp_size_change_with_a_missing_shard": dict(layout="dp4->dp2"),
    f"{ZERO3}::TestZero3ResumeOlderTag": dict(checkpoint="rigid"),
    f"{ZERO3}::TestZero3UniversalModuleOnly": dict(offload="none", checkpoint="universal", layout="none"),
    # 0006, 0007: universal checkpoints under AutoTP
    AUTOTP: dict(feature="universal-autotp", stage=3, precision="fp32", checkpoint="universal"),
    f"{AUTOTP}::TestZero3UniversalIntoAutoTP::test_restore_bitwise_and_resume[1-converted]": dict(layout="dp2->dp2"),
    f"{AUTOTP}::TestZero3UniversalIntoAutoTP::test_restore_bitwise_and_resume[1-bare_0198]": dict(layout="dp2->dp2"),
    f"{AUTOTP}::TestZero3UniversalIntoAutoTP::test_restore_bitwise_and_resume[2-bare_0198]": dict(layout="dp2->tp2"),
    f"{AUTOTP}::TestZero3UniversalIntoAutoTP::test_hf_llama_restores_bitwise_under_autotp": dict(layout="dp2->tp2"),
    f"{AUTOTP}::TestZero3UniversalIntoAutoTP::test_bad_folder_refused_on_every_rank": dict(layout="dp2->tp2"),
    f"{AUTOTP}::TestLayoutRoundTrip::test_layout_round_trip[dp2]": dict(layout="dp2->tp2->dp2"),
    f"{AUTOTP}::TestLayoutRoundTrip::test_layout_round_trip[dp4]": dict(layout="dp4->tp2xdp2->dp4"),
    # 0007: one universal state file format
    ONE_FORMAT: dict(feature="universal-autotp", stage=3, precision="fp32", checkpoint="universal", layout="dp2->dp2"),
    f"{ONE_FORMAT}::TestUniversalOneFormat::test_zero1_loads_bare_tensor_folder": dict(stage=1),
    # 0010: universal and BF16_Optimizer loads honour the load flags
    UNIVERSAL_FLAGS: dict(feature="resume", offload="none", checkpoint="universal", layout="none"),
    f"{UNIVERSAL_FLAGS}::TestBF16OptimizerLoadFromFp32WeightsFalse":
        dict(stage=1, precision="bf16_fp32_grad_accum", checkpoint="rigid"),
    # 0011: ZeRO-1/2 fresh-optimizer resume
    ZERO12: dict(feature="resume", offload="none", checkpoint="rigid", layout="none"),
    f"{ZERO12}::TestZero12ResumeWithoutShards::test_missing_shards":
        dict(checkpoint="rigid, shard missing on one rank"),
    f"{ZERO12}::TestZero12ResumeWithoutShards::test_truncated_shard_on_one_rank":
        dict(stage=1, precision="bf16", checkpoint="rigid, truncated shard on one rank"),
    f"{ZERO12}::TestZero12ResumeAlignmentChange": dict(stage=1, precision="bf16", layout="parameter_alignment"),
    f"{ZERO12}::TestZero1LayoutBefore0317": dict(stage=1, precision="bf16", checkpoint="rigid, saved before 0.3.17"),
    # 0012: ZeRO-1/2 fresh-optimizer masters restored by name after a trainable-set or param-group change
    ZERO12_BY_NAME: dict(feature="resume", offload="none", checkpoint="rigid"),
    f"{ZERO12_BY_NAME}::TestZero12TrainableSetChange": dict(layout="trainable set"),
    f"{ZERO12_BY_NAME}::TestZero12ParamGroupsByName": dict(layout="param groups"),
    # 0013: ZeRO-1/2 full resume by name after a trainable-set or param-group change
    ZERO12_FULL_BY_NAME: dict(feature="resume", offload="none", checkpoint="rigid"),
    f"{ZERO12_FULL_BY_NAME}::TestZero12FullResumeTrainableSetChange": dict(layout="trainable set"),
    f"{ZERO12_FULL_BY_NAME}::TestZero12FullResumeParamGroupsByName": dict(layout="param groups"),
    # 0014: ZeRO-3 NVMe resume
    NVME: dict(feature="resume", stage=3, precision="bf16", offload="nvme", checkpoint="rigid"),
    f"{NVME}::TestZero3NVMeResume::test_universal_refused_before_anything_changes":
        dict(checkpoint="universal (refused)"),
    f"{NVME}::TestZero3NVMeResume::test_serial_load": dict(feature="serial-load"),
    f"{NVME}::TestZero3NVMeResume::test_unusable_offload_folder_refused_before_anything_changes":
        dict(checkpoint="rigid (refused)"),
    f"{NVME}::TestZero3NVMeResume::test_loaded_without_nvme_refused_before_anything_changes":
        dict(offload="nvme when saved", checkpoint="rigid (refused)"),
    # 0016: ZeRO-1/2 optimizer-state fragments linked for every param group
    HP_LINK: dict(feature="hp-link", checkpoint="-"),
    f"{HP_LINK}::TestZero12HpLinkParamGroups::test_readable_right_after_a_load": dict(checkpoint="rigid"),
    # 0018: ZeRO-3 rigid loads at the saved tensor-parallel size (0023 loads them at another)
    LAYOUT_REFUSALS: dict(feature="resume", stage=3, checkpoint="rigid (refused)"),
    f"{LAYOUT_REFUSALS}::TestZero3SavedTensorParallelSize": dict(precision="fp32", layout="tp2xdp1",
                                                                  checkpoint="rigid"),
    f"{LAYOUT_REFUSALS}::TestZero3SavedModelParallelSize": dict(precision="bf16"),
    f"{LAYOUT_REFUSALS}::TestZero3SavedModelParallelSize::test_recorded_sequence_parallel_degree_loads":
        dict(precision="bf16", checkpoint="rigid"),
    # 0019: ZeRO-3 direct resume at another data-parallel size: its reader of a rigid checkpoint's partitions by
    # parameter name (no process group)
    READER: dict(feature="direct-reshard", stage=3, precision="fp32", checkpoint="rigid", layout="dp1-9->dp1-9"),
    # 0019: its engine route (layout from the tests' `layout` argument)
    RESHARD: dict(feature="direct-reshard", stage=3, checkpoint="rigid"),
    f"{RESHARD}::TestZero3Reshard::test_every_parameter_trainable": dict(precision="bf16", settings="nothing frozen"),
    f"{RESHARD}::TestZero3ReshardSettings": dict(precision="bf16"),
    f"{RESHARD}::TestZero3ReshardFp16": dict(precision="fp16"),
    f"{RESHARD}::TestZero3ReshardParameterKinds": dict(precision="bf16", settings="tied and 1-element params"),
    f"{RESHARD}::TestZero3ReshardQuantizedWeights": dict(precision="bf16", settings="zero_quantized_weights"),
    f"{RESHARD}::TestZero3ReshardLayouts::test_saved_padded_in_sub_groups":
        dict(precision="bf16", settings="sub_group_size=100 (saved)"),
    f"{RESHARD}::TestZero3ReshardLayouts::test_param_groups": dict(precision="bf16"),
    f"{RESHARD}::TestZero3ReshardRefused": dict(precision="bf16", checkpoint="rigid (refused)"),
    f"{RESHARD}::TestZero3ReshardRefused::test_nvme_offload":
        dict(precision="bf16", offload="nvme", checkpoint="rigid (refused)"),
    f"{RESHARD}::TestZero3ReshardSerialLoad": dict(feature="serial-load", precision="bf16"),
    # 0020: ZeRO-3 loads that restore no masters read only this rank's partition
    OWN_PARTITION: dict(feature="resume", stage=3, precision="bf16", checkpoint="rigid"),
    # 0021: ZeRO-3 restore by name after a trainable-set, sub_group_size or param-group change (layout from the tests'
    # `layout` argument: the saved data-parallel size, or another)
    LAYOUT_CHANGE: dict(feature="resume", stage=3, precision="bf16", checkpoint="rigid"),
    f"{LAYOUT_CHANGE}::TestZero3LayoutChange::test_trainable_set_change": dict(settings="trainable set changed"),
    f"{LAYOUT_CHANGE}::TestZero3LayoutChange::test_sub_group_size_change_at_the_saved_size":
        dict(layout="dp2", settings="sub_group_size=100 (loaded)"),
    f"{LAYOUT_CHANGE}::TestZero3ParamGroupHyperparameters": dict(settings="param groups changed"),
    # 0022: ZeRO-1/2 and BF16_Optimizer resume a rigid checkpoint at another data-parallel size (stage, precision
    # and layout from the tests' arguments)
    ZERO12_RESHARD: dict(feature="direct-reshard", checkpoint="rigid"),
    f"{ZERO12_RESHARD}::TestZero12Reshard::test_cpu_optimizer_offload": dict(offload="cpu"),
    f"{ZERO12_RESHARD}::TestZero12Reshard::test_param_groups_and_a_frozen_layer":
        dict(settings="param groups, frozen layer"),
    f"{ZERO12_RESHARD}::TestZero12ReshardRefused": dict(stage=2, precision="bf16", checkpoint="rigid (refused)"),
    # 0023: ZeRO-3 + AutoTP resume a rigid checkpoint at another tensor-parallel size (layout and settings from the
    # tests' arguments)
    TP_RESHARD: dict(feature="direct-reshard", stage=3, precision="fp32", checkpoint="rigid"),
    f"{TP_RESHARD}::TestZero3TensorParallelChangeRefusals": dict(layout="tp2xdp1 -> tp1xdp2",
                                                                 checkpoint="rigid (refused)"),
    f"{TP_RESHARD}::TestZero3ResumeAtAnotherTensorParallelSizeFourRanks":
        dict(settings="frozen layer, sub_group_size=100"),
    f"{TP_RESHARD}::TestZero3TensorParallelChangeOneRankRefuses":
        dict(layout="tp1xdp2 -> tp2xdp1", settings="frozen layer", checkpoint="rigid (refused)"),
    # 0024: AutoTP resume at the saved tensor-parallel size under another partition_config
    TP_LAYOUT:
        dict(feature="direct-reshard", stage=3, precision="fp32", checkpoint="rigid", layout="tp2 -> tp2 (re-split)"),
    f"{TP_LAYOUT}::TestZero2AnotherTensorParallelLayoutRefused": dict(stage=2, checkpoint="rigid (refused)"),
    f"{TP_LAYOUT}::TestFirstTensorParallelMapChange": dict(layout="tp2 -> tp2 (maps only, no ranks)"),
    # 0025: under zero.Init, the parameters AutoTP leaves whole are partitioned over the data-parallel group
    ZERO_INIT_LAYOUT: dict(feature="zero.Init autotp", stage=3, precision="fp32", layout="tp2xdp1"),
    f"{ZERO_INIT_LAYOUT}::TestAutoTPZeroInitLayout::test_partitioned_over_data_parallel[bf16_clipping]":
        dict(precision="bf16", settings="gradient_clipping=1.0"),
    f"{ZERO_INIT_LAYOUT}::TestAutoTPZeroInitLayout::test_partitioned_over_data_parallel[persistence_threshold=0]":
        dict(settings="persistence_threshold=0"),
    f"{ZERO_INIT_LAYOUT}::TestAutoTPZeroInitLayout::test_partitioned_over_data_parallel[param_offload_frozen]":
        dict(offload="param cpu", settings="frozen layer"),
    f"{ZERO_INIT_LAYOUT}::TestAutoTPZeroInitLayout::test_two_data_parallel_ranks": dict(layout="tp2xdp2"),
    f"{ZERO_INIT_LAYOUT}::TestAutoTPZeroInitCheckpointConverts":
        dict(checkpoint="universal", layout="tp2xdp1 -> tp1xdp2"),
    f"{ZERO_INIT_LAYOUT}::TestAutoTPZeroInitKeptLayout": dict(checkpoint="rigid (kept layout; refused otherwise)"),
    # 0026: zero.Init AutoTP checkpoints at another tensor-parallel size
    ZERO_INIT_TP: dict(feature="direct-reshard zero.Init", stage=3, precision="fp32", checkpoint="rigid"),
    f"{ZERO_INIT_TP}::TestZero3TensorParallelKeptZeroInitLayout":
        dict(layout="tp2 -> tp2", checkpoint="rigid (kept layout; refused otherwise)"),
    # 0027: a rank killed during save_checkpoint leaves `latest` naming a whole checkpoint (the kill trials cover
    # ZeRO-0/1/2/3 and bf16 too; the cell is their first, DeepSpeed's defaults)
    CRASH: dict(feature="crash-consistent save", stage=3, precision="fp32", checkpoint="rigid"),
    f"{CRASH}::test_saving_again_at_another_world_size_leaves_no_file_of_the_earlier_save":
        dict(layout="dp2 (killed) -> dp1 save"),
    f"{CRASH}::test_each_node_names_its_saves_in_latest_with_node_local_storage":
        dict(layout="none, 2 nodes, node-local storage"),
    # 0028: every engine's checked load refuses on every rank
    CONTENT_ENGINES: dict(feature="checked load, every engine", precision="fp32", checkpoint="rigid"),
    f"{CONTENT_ENGINES}::TestEveryEngineRefusesOnEveryRank::test_pipeline_layer_file_damaged_on_one_stage":
        dict(stage=0, layout="pipeline, 2 stages"),
    f"{CONTENT_ENGINES}::TestEveryEngineRefusesOnEveryRank::test_moe_expert_file_damaged_or_missing_on_one_rank":
        dict(stage=[2, 0], layout="MoE, expert-parallel 2"),
    f"{CONTENT_ENGINES}::TestNodesWithDifferentSaves": dict(stage=3, layout="none, 2 nodes, node-local storage"),
    f"{CONTENT_ENGINES}::TestEditedCheckpoint": dict(stage=3, precision="bf16"),
}
# yapf: enable
