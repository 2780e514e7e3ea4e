# Copyright (c) the DeepSpeed ZeRO-3 fork authors.
# SPDX-License-Identifier: Apache-2.0
"""The commands of tools/patches.py (its command line), one module per group; common.py what they share."""
