# Copyright (c) the DeepSpeed ZeRO-3 fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Checkpoint conversion shared by the checkpoint tests."""

import argparse
import os

import deepspeed.comm as dist


def convert_to_universal(save_dir, tag, universal_tag=None, inject_missing_state=False):
    """Convert save_dir/tag with ds_to_universal on rank 0 (the others wait); returns the universal tag."""
    universal_tag = universal_tag or f"{tag}_universal"
    if dist.get_rank() == 0:
        from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal
        ds_to_universal(
            converter_args(os.path.join(save_dir, tag),
                           os.path.join(save_dir, universal_tag),
                           inject_missing_state=inject_missing_state))
    dist.barrier()
    return universal_tag


def converter_args(input_folder, output_folder, inject_missing_state=False):
    """ds_to_universal's command-line arguments, as its main() takes them."""
    return argparse.Namespace(input_folder=input_folder,
                              output_folder=output_folder,
                              num_extract_workers=1,
                              num_merge_workers=1,
                              keep_temp_folder=False,
                              strict=True,
                              inject_missing_state=inject_missing_state)
