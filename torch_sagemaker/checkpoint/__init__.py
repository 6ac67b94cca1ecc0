"""SMP's module paths for checkpoint helpers (``torch.sagemaker.checkpoint``), re-exported.

Nothing is defined here: ``constants`` and ``utils`` re-export
``torch_sagemaker.distributed.checkpoint.constants`` and ``...retention``, where the code
lives next to the save/load machinery that uses it. The library itself never imports this
package.
"""
