"""Names shared by checkpoint writers and readers: the directory format and SMP's reserved keys.

This module is SMP's path ``torch.sagemaker.checkpoint.constants`` itself.
"""

# Keys SMP reserves in a checkpoint's user content.
SMP_IS_LOAD_INFO_KEY = "smp_is_load_info"
SMP_IS_PARTIAL_KEY = "smp_is_partial"

# A checkpoint directory is complete when this file exists in it (written last, before the
# atomic rename that makes the directory visible under its final name).
COMPLETION_MARKER = ".sm_checkpoint_complete.json"
# Suffixes of the directories a save uses on the way (siblings of the final directory).
STAGING_SUFFIX = ".partial"
REPLACED_SUFFIX = ".replaced"
# The file in which PyTorch DCP's coordinator writes the checkpoint's metadata, last.
DCP_METADATA = ".metadata"
# Version of the marker's contents: 1 = file sizes; 2 = sizes and checksums.
FORMAT_VERSION = 2
